"""Where `kmix.export` writes (`kmix.serving.destination`): the old artifact or the new one, whole, at the path.

The artifacts here are directories of small files named as a SavedModel's
(or a `.keras` file), so that every interrupt point can be tried in a
second: a `KeyboardInterrupt` injected before and after each file-system
step of `Target.commit`, and a SIGKILL before each step in a child process
that loads `destination.py` alone. Each outcome is compared byte for byte
with the two artifacts and the user's files written by the test itself.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from kmix.serving import destination

USER_FILES = {"train.py": b"print('train')\n", "src/data.csv": b"a,b\n1,2\n"}


def saved_model(tag):
    """The files of a SavedModel-like artifact, their bytes tagged, relative path -> bytes."""
    return {"saved_model.pb": b"graph " + tag, "fingerprint.pb": b"fp " + tag,
            "variables/variables.index": b"index " + tag, "variables/variables.data-00000-of-00001": b"data " + tag}


def write(root, files, dirs=("assets",)):
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)) or root, exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    for d in dirs:
        os.makedirs(os.path.join(root, d), exist_ok=True)


def files_under(root):
    """Every file under `root` (relative path -> bytes); a file `root` gives {'': bytes}."""
    if os.path.isfile(root):
        return {"": open(root, "rb").read()}
    found = {}
    for here, _, names in os.walk(root):
        for name in names:
            full = os.path.join(here, name)
            found[os.path.relpath(full, root)] = open(full, "rb").read()
    return found


def leftovers(*directories):
    return [name for d in directories if os.path.isdir(d) for name in os.listdir(d) if name.startswith(".kmix-")]


# (name, old state at the path, user files beside the artifact, overwrite, the path's name)
SCENARIOS = [
    ("new directory", None, {}, False, "served"),
    ("empty directory", {}, {}, False, "served"),
    ("old artifact alone", saved_model(b"old"), {}, True, "served"),
    ("old artifact and user files", saved_model(b"old"), USER_FILES, True, "served"),
    ("user files only", {}, USER_FILES, True, "served"),
    ("new keras file", None, {}, False, "model.keras"),
    ("old keras file", {"": b"old zip"}, {}, True, "model.keras"),
]


def prepare(tmp_path, old, user, name):
    path = str(tmp_path / "out" / name)
    os.makedirs(os.path.dirname(path))
    if old is not None and name.endswith(".keras"):
        open(path, "wb").write(old[""])
    elif old is not None:
        os.makedirs(path)
        write(path, {**old, **user}, dirs=("assets",) if old else ())
    new = {"": b"new zip"} if name.endswith(".keras") else saved_model(b"new")
    expected_old = None if old is None else {**old, **user}
    return path, new, expected_old, {**new, **user}


def write_new(target, new):
    if target.keras:
        open(target.partial, "wb").write(new[""])
    else:
        write(target.partial, new)


class Interrupter:
    """Raises `KeyboardInterrupt` once, before or after the `at`-th file-system step (counted from 0)."""

    STEPS = [(os, "replace"), (os, "rename"), (os, "link"), (os, "remove"), (os, "rmdir"), (os, "makedirs"),
             (shutil, "rmtree"), (destination, "_exchange"), (destination, "_write_json")]

    def __init__(self, monkeypatch, at, when):
        self.calls, self.at, self.when, self.fired = 0, at, when, False
        for module, name in self.STEPS:
            monkeypatch.setattr(module, name, self.wrap(getattr(module, name)))

    def wrap(self, real):
        def step(*args, **kwargs):
            n, self.calls = self.calls, self.calls + 1
            if n == self.at and not self.fired and self.when == "before":
                self.fired = True
                raise KeyboardInterrupt
            result = real(*args, **kwargs)
            if n == self.at and not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return result
        return step


def with_exchange(scenarios):
    """`(scenario, exchange)` pairs: renameat2 for every scenario, and two renames where the old artifact is
    swapped out (the one move `_exchange` makes; the others move with `os.replace` whatever the system)."""
    pairs = [pytest.param(s, True, id=f"{s[0]}-renameat2") for s in scenarios]
    return pairs + [pytest.param(s, False, id=f"{s[0]}-two renames") for s in scenarios if s[0] == "old artifact alone"]


@pytest.mark.parametrize("scenario,exchange", with_exchange(SCENARIOS))
def test_an_interrupt_at_any_step_leaves_the_old_or_the_new_artifact_whole(tmp_path, monkeypatch, scenario, exchange):
    _, old, user, overwrite, name = scenario
    if not exchange:
        monkeypatch.setattr(destination, "_exchange", lambda a, b: False)
    outcomes = set()
    for at in range(200):
        for when in ("before", "after"):
            case = tmp_path / f"{at}-{when}"
            path, new, expected_old, expected_new = prepare(case, old, user, name)
            target = destination.Target(path, overwrite)
            write_new(target, new)
            with monkeypatch.context() as patch:
                interrupter = Interrupter(patch, at, when)
                try:
                    target.commit()
                except KeyboardInterrupt:
                    target.discard()  # as `kmix.export` does on any exception
            now = files_under(path) if os.path.lexists(path) else None
            assert now in (expected_old, expected_new), (at, when, now)
            assert leftovers(os.path.dirname(path), path) == [], (at, when)
            if interrupter.fired and at == 0 and when == "before":
                assert now == expected_old  # nothing moved yet
            outcomes.add("old" if now == expected_old else "new")
            if not interrupter.fired:
                assert now == expected_new
                break
        if not interrupter.fired:
            break
    assert outcomes == {"old", "new"}


CHILD = r"""
import importlib.util, os, signal, sys, shutil
spec = importlib.util.spec_from_file_location("destination", sys.argv[1])
destination = importlib.util.module_from_spec(spec)
spec.loader.exec_module(destination)
path, overwrite, at, exchange = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5] == "1"
if not exchange:
    destination._exchange = lambda a, b: False
target = destination.Target(path, overwrite)
new = {"saved_model.pb": b"graph new", "fingerprint.pb": b"fp new", "variables/variables.index": b"index new",
       "variables/variables.data-00000-of-00001": b"data new"}
for rel, data in new.items():
    os.makedirs(os.path.dirname(os.path.join(target.partial, rel)) or target.partial, exist_ok=True)
    open(os.path.join(target.partial, rel), "wb").write(data)
os.makedirs(os.path.join(target.partial, "assets"))
calls = [0]
def wrap(real):
    def step(*args, **kwargs):
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        return real(*args, **kwargs)
    return step
for module, name in [(os, "replace"), (os, "rename"), (os, "link"), (os, "remove"), (os, "rmdir"),
                     (os, "makedirs"), (shutil, "rmtree"), (destination, "_exchange"), (destination, "_write_json")]:
    setattr(module, name, wrap(getattr(module, name)))
target.commit()
"""


@pytest.mark.parametrize("scenario,exchange", with_exchange(SCENARIOS[:5]))
def test_a_kill_at_any_step_is_undone_or_finished_by_the_next_export(tmp_path, scenario, exchange):
    """SIGKILL before each step: a swap leaves old or new at once; a merge's record lets the next export
    (any `Target` beside or at the path) undo it; the killed run's partial files are removed."""
    _, old, user, overwrite, name = scenario
    for at in range(200):
        path, _, expected_old, expected_new = prepare(tmp_path / str(at), old, user, name)
        child = subprocess.run([sys.executable, "-S", "-c", CHILD, destination.__file__, path,  # -S: stdlib alone
                                "1" if overwrite else "0", str(at), "1" if exchange else "0"], capture_output=True)
        killed = child.returncode == -signal.SIGKILL
        assert killed or child.returncode == 0, child.stderr.decode()[-2000:]
        if os.path.isdir(path) and not leftovers(path):  # no merge record inside: the path is whole already
            assert files_under(path) in (expected_old or {}, expected_new)
        destination.clean_leftovers(os.path.dirname(path))  # what the next export does first
        destination.clean_leftovers(path)
        now = files_under(path) if os.path.lexists(path) else None
        assert now in (expected_old, expected_new), (at, now)
        assert leftovers(os.path.dirname(path), path) == [], at
        if not killed:
            assert now == expected_new
            break


def test_a_non_empty_directory_is_refused_and_with_overwrite_its_files_stay(tmp_path):
    path = str(tmp_path / "project")
    write(path, USER_FILES, dirs=())
    with pytest.raises(ValueError, match=r"`filepath` names a directory that is not empty.*'src', 'train.py'.*"
                                         r"Received: filepath=.*overwrite=False.*overwrite=True"):
        destination.Target(path, False)
    target = destination.Target(path, True)
    write_new(target, saved_model(b"new"))
    target.commit()
    assert files_under(path) == {**USER_FILES, **saved_model(b"new")}
    assert os.path.isdir(os.path.join(path, "assets"))
    # Again, over its own artifact: the user's files are still kept, the artifact replaced.
    target = destination.Target(path, True)
    write_new(target, saved_model(b"newer"))
    target.commit()
    assert files_under(path) == {**USER_FILES, **saved_model(b"newer")}


def test_refusals_name_the_argument_and_what_is_there(tmp_path, monkeypatch):
    open(tmp_path / "file", "w").write("mine")
    for overwrite in (False, True):  # a file is never replaced by a directory
        with pytest.raises(ValueError, match=r"`filepath` names an existing file: a SavedModel is a directory"):
            destination.Target(str(tmp_path / "file"), overwrite)
    os.makedirs(tmp_path / "m.keras" / "inside")
    for overwrite in (False, True):  # nor a directory by a file
        with pytest.raises(ValueError, match=r"ends in '.keras' but names a directory"):
            destination.Target(str(tmp_path / "m.keras"), overwrite)
    open(tmp_path / "old.keras", "w").write("zip")
    with pytest.raises(ValueError, match=r"`filepath` names an existing file\. Received: .*overwrite=False"):
        destination.Target(str(tmp_path / "old.keras"), False)
    write(str(tmp_path / "sm"), saved_model(b"old"))
    with pytest.raises(ValueError, match="not empty"):
        destination.Target(str(tmp_path / "sm"), False)
    write(str(tmp_path / "odd"), {"saved_model.pb/x": b"a directory named as the graph"}, dirs=())
    with pytest.raises(ValueError, match=r"holds 'saved_model.pb', which is a directory"):
        destination.Target(str(tmp_path / "odd"), True)
    work = tmp_path / "work"
    os.makedirs(work)
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match=r"names the working directory"):
        destination.Target(".", False)  # even empty
    assert destination.Target(".", True).partial.startswith(str(work) + os.sep)  # written inside, never replaced
    assert sorted(os.listdir(tmp_path)) == ["file", "m.keras", "odd", "old.keras", "sm", "work"]
    assert open(tmp_path / "file").read() == "mine" and os.listdir(tmp_path / "m.keras") == ["inside"]


def dead_pid():
    child = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_of_dead_exports_are_removed_and_running_ones_named(tmp_path):
    out = str(tmp_path)
    pid = dead_pid()
    stale = os.path.join(out, f".kmix-partial-{pid}-served")  # the form before process ids had a token
    write(stale, saved_model(b"stale"))
    aside = os.path.join(out, f".kmix-replaced-{pid}-0123abcd-kept")  # an old artifact moved aside, nothing back
    write(aside, saved_model(b"kept"))
    running = os.path.join(out, f".kmix-partial-{os.getppid()}-0123abcd-other")
    write(running, saved_model(b"running"))
    user = os.path.join(out, ".kmix-notes")  # not a leftover's name: never touched
    open(user, "w").write("mine")
    with pytest.warns(UserWarning, match=r"left by processes that are still running: \[.*other'\]"):
        destination.Target(os.path.join(out, "served"), False)
    assert sorted(os.listdir(out)) == sorted([".kmix-notes", os.path.basename(running), "kept"])
    assert files_under(os.path.join(out, "kept")) == saved_model(b"kept")  # put back where it was


def test_a_killed_merge_is_undone_from_its_record(tmp_path, monkeypatch):
    """A record left by a killed export (its process gone): the next export puts the user's files back."""
    path = str(tmp_path / "project")
    write(path, {**USER_FILES, **saved_model(b"old")})
    partial = os.path.join(path, f".kmix-partial-{dead_pid()}-0123abcd-project")
    write(partial, saved_model(b"new"))
    files = sorted(saved_model(b"new"), key=lambda f: f == "saved_model.pb")
    with open(os.path.join(partial, destination._JOURNAL), "w") as f:
        json.dump({"target": path, "files": files, "replaced": files, "created": []}, f)
    os.makedirs(os.path.join(partial, destination._REPLACED, "variables"))
    for rel in files[:2]:  # two files moved in before the kill
        os.link(os.path.join(path, rel), os.path.join(partial, destination._REPLACED, rel))
        os.replace(os.path.join(partial, rel), os.path.join(path, rel))
    assert files_under(path) != {**USER_FILES, **saved_model(b"old")}
    with monkeypatch.context() as patch:  # the undo itself interrupted after putting one file back
        Interrupter(patch, at=0, when="after")
        with pytest.raises(KeyboardInterrupt):
            destination.clean_leftovers(path)
    destination.Target(path, True)  # the next export finishes it
    assert files_under(path) == {**USER_FILES, **saved_model(b"old")}

