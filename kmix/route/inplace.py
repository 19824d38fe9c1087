"""The user's own model timed on each route, and put back exactly as it was.

`kmix.recommend` times every route over the user's variables: no copy of
the weights, one optimizer state. Under O1 the routes differ in compute
dtype only; their variables are the same float32 variables. For each route
it places the model itself with `kmix.autocast`, traces the training step
of a `Shared` model (a model that calls the user's, compiled on its own),
and puts every layer back before placing the next route. A traced step
keeps the placement it was traced under, so the routes' steps then run
interleaved over the same variables.

`Preserved(model)` holds what it takes to put the model back:

- each layer's class and attributes, and those of its graph's nodes and
  operations (autocast sets policies, swaps classes and replaces constants
  by assignment): restored by `restore_layers()`;
- each variable's value, written to a temporary directory one variable at
  a time, with its digest; on exit the variables whose digest changed
  (batch-norm statistics, seed states; the trainable ones stay, the
  optimizer's learning rate being 0) are read back from there;
- what autocast recorded for `kmix.wrap` about the model's variables.

    >>> with Preserved(model) as kept:
    ...     kmix.autocast(model, "O1-bfloat16"); step = shared_step(model, ...); step()
    ...     kept.restore_layers()       # the model as it was; `step` still runs in bfloat16
"""

import hashlib
import os
import shutil
import tempfile

import numpy as np

from kmix import _compat
from kmix._tree import walk
from kmix.policy import advice


class Preserved:
    """A context that puts `model`'s layers, variables and kmix's records back as they were on entry.

    `variables=False` leaves the variables out (for a caller that changes none: `kmix.export`).
    """

    def __init__(self, model, variables=True):
        self.model, self._save_variables = model, variables
        self._objects, self._variables, self._digests, self._records, self._dir = [], [], [], None, None

    def __enter__(self):
        self._objects = [(obj, type(obj), dict(vars(obj))) for obj in _objects(self.model)]
        self._variables = list(self.model.variables) if self._save_variables else []
        self._records = advice.snapshot(self.model.variables)
        self._dir = tempfile.mkdtemp(prefix="kmix-preserved-")
        try:
            for i, variable in enumerate(self._variables):
                value = np.asarray(variable.numpy())
                np.save(os.path.join(self._dir, f"{i}.npy"), value)
                self._digests.append(_digest(value))
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        return self

    def restore_layers(self):
        """Gives every layer, graph node and operation its class and attributes back."""
        for obj, cls, attrs in self._objects:
            if type(obj) is not cls:
                obj.__class__ = cls
            state = vars(obj)
            if state != attrs:
                state.clear()
                state.update(attrs)

    def changed_variables(self):
        """The variables whose value differs from the one saved on entry."""
        return [v for v, d in zip(self._variables, self._digests) if _digest(np.asarray(v.numpy())) != d]

    def __exit__(self, *exc):
        try:
            self.restore_layers()
            for i, (variable, digest) in enumerate(zip(self._variables, self._digests)):
                if _digest(np.asarray(variable.numpy())) != digest:
                    variable.assign(np.load(os.path.join(self._dir, f"{i}.npy")))
            advice.restore(self._records)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
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
        if _compat.is_functional(layer):
            for node in _compat.graph_nodes(layer):
                add(node)
                add(_compat.node_call(node)[0])
    return found


def _digest(value):
    return value.dtype.str, value.shape, hashlib.blake2b(np.ascontiguousarray(value).reshape(-1).view(np.uint8)).digest()


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
