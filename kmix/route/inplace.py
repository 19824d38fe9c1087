"""The user's own model timed on each route, and put back exactly as it was.

`kmix.recommend` times every route over the user's variables: no copy of
the weights, one optimizer state. Under O1 the routes differ in compute
dtype only; their variables are the same float32 variables. For each route
it places the model itself with `kmix.autocast`, traces the training step
of a `Shared` model (a model that calls the user's, compiled on its own),
and puts every layer back before placing the next route. A traced step
keeps the placement it was traced under, so the routes' steps then run
interleaved over the same variables.

`Preserved(model, saved)` holds what it takes to put the model back:

- each layer's class and attributes, and those of its graph's nodes and
  operations (autocast sets policies, swaps classes and replaces constants
  by assignment): restored by `restore_layers()`;
- unless `saved` is `"none"`, each variable's digest, and the values of
  the variables `saved` names, written to a temporary directory one
  variable at a time: `"all"`, or `"non-trainable"` (batch-norm
  statistics, seed states: what a training step moves when the optimizer
  cannot, at learning rate 0). On exit the saved variables whose digest
  changed are read back from there; an unsaved one that changed is an
  error naming it;
- what autocast recorded for `kmix.wrap` about the model's variables.

    >>> with Preserved(model, saved="non-trainable") as kept:
    ...     kmix.autocast(model, "O1-bfloat16"); step = shared_step(model, ...); step()
    ...     kept.restore_layers()       # the model as it was; `step` still runs in bfloat16
"""

import os
import shutil
import tempfile
import warnings

import numpy as np

from kmix import _compat
from kmix._tree import digest, walk
from kmix.policy import advice


class Preserved:
    """A context that puts `model`'s layers, variables and kmix's records back as they were on entry (see the module).

    `saved`: the variables whose values are kept to restore: `"all"`,
    `"non-trainable"` (for a caller whose optimizer leaves the trainable ones
    still: `kmix.recommend`; every variable's digest is checked on exit) or
    `"none"` (for a caller that changes no variable, `kmix.export`: the
    variables are neither read nor checked).
    """

    SAVED = ("all", "non-trainable", "none")

    def __init__(self, model, saved="all"):
        if saved not in self.SAVED:
            raise ValueError(f"`saved` must be one of {self.SAVED}. Received: saved={saved!r}")
        self.model, self._saved = model, saved
        self._objects, self._variables, self._digests, self._files, self._records = [], [], [], {}, None
        self._dir = None

    def __enter__(self):
        self._objects = [(obj, _compat.object_state(obj)) for obj in _objects(self.model)]
        self._variables = list(self.model.variables) if self._saved != "none" else []
        self._records = advice.snapshot(self.model.variables)
        trainable = {id(v) for v in self.model.trainable_variables}
        self._dir = tempfile.mkdtemp(prefix="kmix-preserved-")
        try:
            for i, variable in enumerate(self._variables):
                value = np.asarray(variable.numpy())
                self._digests.append(digest(value))
                if self._saved == "all" or (self._saved == "non-trainable" and id(variable) not in trainable):
                    self._files[i] = os.path.join(self._dir, f"{i}.npy")
                    np.save(self._files[i], value)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        return self

    def restore_layers(self):
        """Gives every layer, graph node and operation its class and attributes back."""
        for obj, state in self._objects:
            _compat.restore_object_state(obj, state)

    def changed_variables(self):
        """The variables whose value differs from the one on entry."""
        return [v for v, d in zip(self._variables, self._digests) if digest(v) != d]

    def __exit__(self, *exc):
        lost = []
        try:
            self.restore_layers()
            for i, (variable, before) in enumerate(zip(self._variables, self._digests)):
                if digest(variable) == before:
                    continue
                if i in self._files:
                    variable.assign(np.load(self._files[i]))
                else:
                    lost.append(variable.path)
            advice.restore(self._records)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        if lost:
            message = (f"{len(lost)} variables of model {self.model.name!r} changed where kmix kept no copy of "
                       f"them (it kept {self._saved!r}): {lost[:8]}. This is a kmix bug: please report it with "
                       "the model.")
            if exc[0] is None:
                raise RuntimeError(message)
            warnings.warn(message, stacklevel=2)  # the error in flight stays the one raised
        return False


def _objects(model):
    """The model, every layer inside it, and each functional graph's nodes and operations."""
    found, seen = [], set()

    def add(obj):
        if id(obj) not in seen and hasattr(obj, "__dict__"):
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


def shared_model(model):
    """A `keras.Model` that calls `model`: its own compile and train step, `model`'s variables.

    It casts nothing on the way in (`autocast=False`): the user's model takes
    its inputs as it takes them from `fit`.
    """
    import keras

    class Shared(keras.Model):
        def __init__(self, inner):
            super().__init__(name=f"kmix_timing_{inner.name}", autocast=False)
            self.inner = inner

        def call(self, inputs, training=None):
            return self.inner(inputs, training=training)

    return Shared(model)
