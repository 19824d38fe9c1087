"""Where `kmix.export` writes: the path checked at the call, the artifact moved in whole, nothing else removed.

`Target.commit` moves the artifact in with one rename, one exchange (`renameat2`), or file by file under a record
that undoes them; the next export cleans up after a killed one (docs/guide.md, "What `export` writes at the path").
"""

import contextlib
import ctypes
import json
import os
import re
import shutil
import uuid
import warnings

_LEFTOVER = re.compile(r"^\.kmix-(partial|replaced)-(\d+)-")
# A SavedModel's own files: a directory holding only these is an artifact that overwrite replaces whole.
_SAVED_MODEL_FILE = re.compile(r"^(saved_model\.pb(?:txt)?|fingerprint\.pb|keras_metadata\.pb"
                               r"|variables/variables\.index|variables/variables\.data-\d+-of-\d+)$")
_SAVED_MODEL_DIRS = ("variables", "assets")
_JOURNAL, _REPLACED = ".kmix-moves.json", ".kmix-replaced"
_LAST = "saved_model.pb"  # moved in last: the directory holds no new SavedModel until every file is in


class Target:
    """One path `kmix.export` writes, checked where it is made; `partial` is where the artifact is written.

    `path`: a SavedModel directory or a path ending in `.keras`; `overwrite`: whether an existing artifact (or other
    files) may be there; `name`: the argument's name, for errors.
    """

    def __init__(self, path, overwrite, name="filepath"):
        self.given, self.overwrite, self.name = path, overwrite, name
        self.path = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
        self.keras = self.path.endswith(".keras")
        head, tail = os.path.split(self.path)
        for directory in {head, self.path}:
            clean_leftovers(directory)
        into = self.path if self.mode() == "merge" else head
        self.partial = os.path.join(into, f".kmix-partial-{os.getpid()}-{uuid.uuid4().hex[:8]}-{tail}")

    def mode(self):
        """How the artifact goes in now (`"new"`, `"file"`, `"swap"`, `"merge"`); raises where it may not."""
        path, shown = self.path, f"{self.name}={self.given!r}, overwrite={self.overwrite!r}"
        if self.keras:
            if os.path.isdir(path):
                raise ValueError(f"`{self.name}` ends in '.keras' but names a directory: a `.keras` artifact is a "
                                 "file, and kmix.export never replaces a directory (Keras's `model.save` refuses "
                                 f"one too). Received: {shown}. Pass a new path.")
            if os.path.lexists(path) and not self.overwrite:
                raise ValueError(f"`{self.name}` names an existing file. Received: {shown}. Pass overwrite=True "
                                 "to replace it (the new file is moved in whole), or a new path.")
            return "file" if os.path.lexists(path) else "new"
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(f"`{self.name}` names an existing file: a SavedModel is a directory, and kmix.export "
                             "never replaces a file it did not write (Keras's `model.export` refuses one too). "
                             f"Received: {shown}. Pass a new path or an empty directory.")
        if not os.path.lexists(path):
            return "new"
        ours = os.path.basename(getattr(self, "partial", ""))
        entries = sorted(e for e in os.listdir(path) if e != ours)
        working = _holds_working_directory(path)
        if (entries or working) and not self.overwrite:
            what = "the working directory (or holds it)" if working else "a directory that is not empty"
            raise ValueError(f"`{self.name}` names {what}, holding {entries[:5]}{' ...' if len(entries) > 5 else ''}: "
                             f"kmix.export writes into a new or empty directory. Received: {shown}. Pass a new path, "
                             "or overwrite=True to write the SavedModel's files (saved_model.pb, fingerprint.pb, "
                             "variables/, assets/) into it: every other file there is kept, as Keras's "
                             "`model.export` keeps them.")
        for entry, directory in [("saved_model.pb", False), ("fingerprint.pb", False), ("variables", True),
                                 ("assets", True)]:
            there = os.path.join(path, entry)
            if os.path.lexists(there) and os.path.isdir(there) != directory:
                raise ValueError(f"`{self.name}` holds {entry!r}, which is {'not ' if directory else ''}a directory, "
                                 f"where the SavedModel writes its {entry}: kmix.export does not replace it. "
                                 f"Received: {shown}.")
        swap = entries and not working and not os.path.ismount(path) and _only_saved_model_files(path)
        return "swap" if swap else "merge"

    def commit(self):
        """Moves the artifact at `partial` to the path (see the module); the path's state checked again first."""
        mode = self.mode()
        if mode in ("new", "file"):
            os.replace(self.partial, self.path)
        elif mode == "swap":
            _swap(self.partial, self.path)
        else:
            _merge(self.partial, self.path)
        _remove(self.partial)

    def discard(self):
        """Removes the partial artifact (after a failure); a merge it began and did not finish is undone first."""
        _undo_merge(self.partial)
        _remove(self.partial)
        _put_back(_aside(self.partial), self.path)


def clean_leftovers(directory):
    """Removes what killed exports left in `directory`, undoing their unfinished moves; warns of running ones."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    running = []
    for name in sorted(names):
        match = _LEFTOVER.match(name)
        if not match or int(match.group(2)) == os.getpid():
            continue
        leftover = os.path.join(directory, name)
        if _running(int(match.group(2))):
            running.append(leftover)
        elif match.group(1) == "replaced":  # an old artifact moved aside
            _put_back(leftover, os.path.join(directory, name[match.end():].split("-", 1)[-1]))
        else:
            _undo_merge(leftover)  # a merge it did not finish
            _remove(leftover)
    if running:
        warnings.warn(f"kmix.export found partial artifacts left by processes that are still running: {running}. "
                      "They are another export's, in progress, or a killed export's whose process id was taken "
                      "since; remove them once no export is running.", stacklevel=5)


def _swap(partial, path):
    """Exchanges the directories `partial` (new) and `path` (old): the new one in place, the old one at `partial`."""
    if _exchange(partial, path):
        return
    aside, swapped = _aside(partial), False
    try:
        os.rename(path, aside)
        os.rename(partial, path)
        swapped = True
    finally:
        if not swapped:
            _put_back(aside, path)
    _remove(aside)


def _put_back(aside, path):
    """The old directory back at `path` from `aside` where nothing took its place; else it is removed."""
    if os.path.lexists(aside) and not os.path.lexists(path):
        os.rename(aside, path)
    _remove(aside)


def _aside(partial):
    """Where `_swap` moves the old directory when it cannot exchange the two."""
    return os.path.join(os.path.dirname(partial), os.path.basename(partial).replace("-partial-", "-replaced-", 1))


def _exchange(a, b):
    """Swaps paths `a` and `b` in one step (Linux `renameat2`); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):  # not Linux (or a C library without it)
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not on this file system
        return False
    raise OSError(error, os.strerror(error), b)


def _merge(partial, path):
    """Moves the files of `partial` into the directory `path`, replacing only those of the same names.

    The record (`_JOURNAL`) is written first and removed last (the commit); a replaced file is hard-linked
    into `partial` first, so `_undo_merge` can put everything back while the record is there.
    """
    dirs, files = _tree(partial)
    record = {"target": path, "files": files,
              "replaced": [f for f in files if os.path.lexists(os.path.join(path, f))],
              "created": [d for d in dirs if not os.path.isdir(os.path.join(path, d))]}
    _write_json(os.path.join(partial, _JOURNAL), record)
    try:
        for d in dirs:
            os.makedirs(os.path.join(path, d), exist_ok=True)
        for rel in files:
            source, there, kept = (os.path.join(p, rel) for p in (partial, path, os.path.join(partial, _REPLACED)))
            if rel in record["replaced"]:
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                _keep(there, kept)
            os.replace(source, there)
        os.remove(os.path.join(partial, _JOURNAL))
    finally:
        _undo_merge(partial)  # not committed: undone


def _undo_merge(partial):
    """Puts back what `_merge` moved from `partial` (a file no longer there was moved); nothing without its record."""
    if not os.path.isfile(os.path.join(partial, _JOURNAL)):
        return
    with open(os.path.join(partial, _JOURNAL)) as f:
        record = json.load(f)
    path = record["target"]
    for rel in reversed(record["files"]):
        there, kept = os.path.join(path, rel), os.path.join(partial, _REPLACED, rel)
        if os.path.lexists(os.path.join(partial, rel)):
            continue  # not moved
        if rel not in record["replaced"]:
            if os.path.lexists(there):
                os.remove(there)  # added by the export: nothing was there
        elif os.path.lexists(kept):
            os.replace(kept, there)
    for d in sorted(record["created"], reverse=True):
        with contextlib.suppress(OSError):  # not empty (or gone): kept
            os.rmdir(os.path.join(path, d))
    os.remove(os.path.join(partial, _JOURNAL))


def _keep(there, kept):
    """A second name for the file `there` at `kept` (a hard link; a copy where links are not possible)."""
    try:
        os.link(there, kept)
    except OSError:
        shutil.copy2(there, kept)


def _tree(root):
    """`(directories, files)` under `root`, relative, parents first; `saved_model.pb` last among the files."""
    dirs, files = [], []
    for here, subdirs, names in os.walk(root):
        rel = os.path.relpath(here, root)
        subdirs.sort()
        dirs += [os.path.normpath(os.path.join(rel, d)) for d in subdirs]
        files += [os.path.normpath(os.path.join(rel, n)) for n in sorted(names)]
    return dirs, sorted(files, key=lambda f: f == _LAST)


def _only_saved_model_files(path):
    """Whether the directory `path` holds a SavedModel's files and nothing else (no links)."""
    for here, subdirs, names in os.walk(path):
        rel = os.path.relpath(here, path)
        if rel != "." and rel not in _SAVED_MODEL_DIRS:
            return False
        for name in names + subdirs:
            full = os.path.join(here, name)
            entry = os.path.normpath(os.path.join(rel, name))
            if os.path.islink(full) or not (_SAVED_MODEL_FILE.match(entry) or entry in _SAVED_MODEL_DIRS):
                return False
    return True


def _holds_working_directory(path):
    here, there = os.path.realpath(os.getcwd()), os.path.realpath(path)
    return here == there or here.startswith(there.rstrip(os.sep) + os.sep)


def _running(pid):
    try:
        with contextlib.suppress(PermissionError):  # another user's process: running
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _write_json(path, value):  # a step of its own: tests interrupt the export at each file-system step
    with open(path, "w") as f:
        json.dump(value, f)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
