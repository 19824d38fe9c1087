"""One save-and-restore of a model's state, for kmix's calls that must leave the model as they found it.

`Preserved(model, saved, storage, undo)` holds each layer's class and
attributes (with its graph's nodes and operations and its dtype policies),
optionally each variable's storage, the values of the variables `saved`
names (written to a temporary directory, one variable at a time) and what
autocast recorded about the model's variables. `kmix.recommend`,
`kmix.diagnose` and `kmix.export` put everything back on exit;
`kmix.autocast` (`undo="on_error"`) only when an exception, KeyboardInterrupt
included, ends it.

    >>> with Preserved(model, saved="none", storage=True, undo="on_error") as kept:
    ...     place(model)
    ...     kept.commit()               # all or nothing: from here on the placement stays
"""

import os
import shutil
import signal
import tempfile
import threading
import warnings

import numpy as np

from kmix import _compat
from kmix._tree import digest, walk
from kmix import _state


class Preserved:
    """A context that puts `model`'s layers, variables and kmix's records back as they were on entry.

    Args:
        model: the `keras.Model` to put back.
        saved: the variables (metrics' included) whose values are kept to restore: `"all"`, `"non-trainable"`
            (every variable's digest is still checked on exit: one that changed without a copy is an error naming
            it) or `"none"` (values neither read nor checked).
        storage: also put back each variable's own storage and dtype (O2 / O3 give half storage; the float32 held).
        undo: `"always"`, or `"on_error"` (an exception puts everything back; `commit()` keeps what was done).

    Example:

    >>> with Preserved(model, saved="all") as kept:
    ...     model.fit(x, y)
    ...     kept.restore_variables()   # back to the weights on entry, and on exit again
    """

    SAVED = ("all", "non-trainable", "none")

    def __init__(self, model, saved="all", storage=False, undo="always"):
        if saved not in self.SAVED:
            raise ValueError(f"`saved` must be one of {self.SAVED}. Received: saved={saved!r}")
        self.model, self._saved, self._storage, self._undo = model, saved, storage, undo
        self._objects, self._variables, self._digests, self._files, self._records = [], [], [], {}, None
        self._dir = None

    def commit(self):
        """Keeps what was done: with `undo="on_error"`, the exit from here on puts nothing back."""
        self._undo = "never"

    def __enter__(self):
        variables = list(self.model.variables)
        objects = _objects(self.model) + (variables if self._storage else [])
        self._objects = [(obj, _compat.object_state(obj)) for obj in objects]
        if self._saved != "none":
            self._variables = variables + list(getattr(self.model, "metrics_variables", []))
        self._records = _state.snapshot(variables)
        trainable = {id(v) for v in self.model.trainable_variables}
        self._dir = tempfile.mkdtemp(prefix="kmix-preserved-")
        self._signals = _ExitGuard()  # a Ctrl-C landing in __exit__ waits until the model is back
        entered = False
        try:
            for i, variable in enumerate(self._variables):
                value = np.asarray(variable.numpy())
                self._digests.append(digest(value))
                if self._saved == "all" or id(variable) not in trainable:
                    self._files[i] = os.path.join(self._dir, f"{i}.npy")
                    np.save(self._files[i], value)
            entered = True
        finally:
            if not entered:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._signals.close()
        return self

    def restore_layers(self):
        """Gives every layer, graph node and operation its class and attributes back."""
        for obj, state in self._objects:
            _compat.restore_object_state(obj, state)

    def restore_variables(self):
        """Puts back the saved variables whose value changed; returns the paths of changed ones without a copy."""
        lost = []
        for i, (variable, before) in enumerate(zip(self._variables, self._digests)):
            if digest(variable) == before:
                continue
            if i in self._files:
                variable.assign(np.load(self._files[i]))
            else:
                lost.append(variable.path)
        return lost

    def _put_back(self):
        self.restore_layers()
        lost = self.restore_variables()
        _state.restore_records(self._records)
        return lost

    def __exit__(self, *exc):
        self._signals.holding = True  # from here a Ctrl-C waits (on this line too: the handler reads the code run)
        if self._undo == "never" or (self._undo == "on_error" and exc[0] is None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._signals.close()
            return False
        try:
            try:
                lost = self._put_back()
            except BaseException:  # raised while putting back: every step is idempotent, so a second pass
                self._put_back()   # finishes it (a failure that repeats propagates), then the first error goes on
                raise
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._signals.close()  # raises a Ctrl-C deferred while the model was put back
        if lost:
            message = (f"{len(lost)} variables of model {self.model.name!r} changed where kmix kept no copy of "
                       f"them (it kept {self._saved!r}): {lost[:8]}. This is a kmix bug: please report it with "
                       "the model.")
            if exc[0] is None:
                raise RuntimeError(message)
            warnings.warn(message, stacklevel=2)  # the error in flight stays the one raised
        return False


class _ExitGuard:
    """From `Preserved.__enter__` to the end of its `__exit__`: a Ctrl-C (SIGINT) that lands while the model is
    being put back waits, and is raised as KeyboardInterrupt by `close`; elsewhere it interrupts as before.

    Only in the main thread (where Python delivers signals); elsewhere it does nothing.
    """

    def __init__(self):
        self.received, self.previous, self.holding = [], None, False
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.holding or (frame is not None and frame.f_code is _EXIT):  # `holding` is set by __exit__'s first line
            self.received.append(signum)
            return
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def close(self):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
        if self.received:
            self.received = []
            raise KeyboardInterrupt("deferred while kmix put the model back")


def _objects(model):
    """The model, every layer inside it, their dtype policies, and each functional graph's nodes and operations."""
    found, seen = [], set()

    def add(obj):
        if id(obj) not in seen:
            seen.add(id(obj))
            found.append(obj)

    for layer in [model] + [row[1] for row in walk(model)]:
        add(layer)
        add(layer.dtype_policy)  # a DTypePolicyMap is shared by a backbone's layers and changed in place
        if _compat.is_functional(layer):
            for node in _compat.graph_nodes(layer):
                add(node)
                add(_compat.node_call(node)[0])
    return found


# Only the exit's putting back: `restore_layers` / `restore_variables` called by a kmix call on its way (recommend
# between routes) stay interruptible, or a Ctrl-C there would wait for the whole call.
_EXIT = Preserved.__exit__.__code__
