"""The opt level an optimizer's saved state was written at, and reading it at another level (docs/guide.md)."""

import dataclasses
import json
from collections import Counter

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat, _state
from kmix.optimizers.updates import HALF

RECORD_NAME = "kmix_layout"  # the key in a weights store, the dependency in a checkpoint
_STATE_WORDS = {"masters": "float32 master copies", "kahan": "Kahan remainders (master_weights='kahan')",
                "none": "no master copies"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """What an optimizer's saved state holds.

    Attributes:
        level: the opt level its variables were placed at (`"O2-float16"`), else the one they look like.
        state: `"masters"`, `"kahan"` or `"none"`.
        params: `((dtype, count), ...)` of the trainable variables.
        scaled: whether the loss is scaled (a dynamic scale, or a fixed one other than 1).
    """

    level: str
    state: str
    params: tuple
    scaled: bool

    @classmethod
    def of(cls, var_list, state, scaled):
        """The layout of an optimizer built for `var_list` keeping `state`."""
        dtypes = Counter(keras.backend.standardize_dtype(v.dtype) for v in var_list)
        level = " + ".join(sorted({p.level for p in _state.placed(var_list)}))
        if not level:
            half = max(HALF, key=lambda d: dtypes[d]) if any(dtypes[d] for d in HALF) else None
            level = "float32 or O1" if half is None else f"{'O3' if state == 'none' else 'O2'}-{half}"
        return cls(level, state, tuple(sorted(dtypes.items())), bool(scaled))

    def differences(self, other):
        """What a value restored as saved would get wrong: `[]` where the layouts match."""
        return [word for word, same in (("parameter dtypes", self.params == other.params),
                                        ("what keeps the updates' low bits", self.state == other.state),
                                        ("loss scaling", self.scaled == other.scaled)) if not same]

    def describe(self):
        """`"O2-float16 (4 float16 and 2 float32 parameters, float32 master copies, loss scaling)"`."""
        params = " and ".join(f"{n} {dtype}" for dtype, n in self.params) or "no"
        scaling = "loss scaling" if self.scaled else "no loss scaling"
        return f"{self.level} ({params} parameters, {_STATE_WORDS.get(self.state, self.state)}, {scaling})"

    def encode(self, **extra):
        """The layout as JSON text (a weights file adds where its remainders are)."""
        fields = {"level": self.level, "state": self.state, "params": dict(self.params), "scaled": self.scaled}
        return json.dumps({**fields, **extra}, sort_keys=True)

    @classmethod
    def decode(cls, text):
        """`(layout, fields)` from `encode`'s text, or `(None, {})`."""
        try:
            fields = json.loads(text)
            return cls(str(fields["level"]), str(fields["state"]), tuple(sorted(fields["params"].items())),
                       bool(fields["scaled"])), fields
        except (ValueError, TypeError, KeyError, AttributeError):
            return None, {}


class SavedLevel:
    """An optimizer's layout, its checkpoint record, and the one loader of its state.

    Made by the `kmix.LossScaleOptimizer` in its `build` before its variables; `weights`: its `MasterWeights`.
    """

    def __init__(self, optimizer, layout, weights):
        self.optimizer, self.layout, self.weights = optimizer, layout, weights
        attaching = [True]

        def check(saved_text):
            saved, _ = Layout.decode(saved_text)
            if saved is not None and saved.differences(self.layout):
                done = ("The model's variables were read with the checkpoint; none of the optimizer's state was."
                        if attaching[0] else "Nothing was restored.")
                raise ValueError(
                    f"This tf.train.Checkpoint was written at {saved.describe()}; this optimizer is at "
                    f"{self.layout.describe()}. A checkpoint restores each value as saved into the object in its "
                    f"place, and these differ in {' and '.join(saved.differences(self.layout))}. {done} To convert "
                    f"it, restore it into the model placed at {saved.level} with its optimizer, write "
                    "model.save_weights('converted.weights.h5'), and load_weights that file here: weights files "
                    "convert between opt levels.")

        label = (f"kmix's record of the opt level ({RECORD_NAME}): checkpoints written before kmix recorded it "
                 "lack it; read those with .expect_partial()")
        _compat.attach_record(optimizer, RECORD_NAME, _compat.NamedRecord(lambda: self.layout.encode(), check, label))
        attaching[0] = False
        _compat.loads_nothing(optimizer.inner_optimizer)

    def _aux(self):
        aux = {id(v) for v in self.weights.state()}
        return [i for i, v in enumerate(self.optimizer.variables) if id(v) in aux]

    def write(self, store):
        """Adds the layout to the store Keras's `save_own_variables` filled."""
        store[RECORD_NAME] = np.frombuffer(self.layout.encode(aux=self._aux()).encode("utf-8"), dtype=np.uint8)

    def load(self, store, keras_load, scale_state):
        """Loads `store` (Keras's or kmix's), converting from another level; `ValueError` naming both levels."""
        view = without_record(store)
        if RECORD_NAME not in store:
            self._load_unrecorded(view, keras_load)
            return
        saved, fields = Layout.decode(bytes(np.asarray(store[RECORD_NAME], dtype=np.uint8)).decode("utf-8"))
        if saved is None:
            raise ValueError(f"The optimizer state's {RECORD_NAME!r} entry is not a layout kmix wrote.")
        if not saved.differences(self.layout):
            keras_load(view)  # by position, bit for bit
            return
        self._load_converted(view, saved, [int(i) for i in fields.get("aux", [])], scale_state)

    def _message(self, saved, why):
        return (f"Cannot load this optimizer state: it was written at {saved.describe()}, and this optimizer is at "
                f"{self.layout.describe()}. {why} Nothing of the optimizer was loaded; Keras goes on to load the "
                f"model's weights all the same. Load it into an optimizer at {saved.level} with master_weights as "
                "saved, or pass skip_mismatch=True to load_weights to load the weights alone.")

    def _load_converted(self, store, saved, saved_aux, scale_state):
        current, variables, here_aux = self.layout, list(self.optimizer.variables), self._aux()
        count = len(store.keys())
        if {saved.state, current.state} == {"masters", "kahan"}:
            raise ValueError(self._message(saved, "Master copies and Kahan remainders hold different quantities; "
                                                  "neither is made from the other."))
        rest_saved = [i for i in range(count) if i not in set(saved_aux)]
        rest_here = [j for j in range(len(variables)) if j not in set(here_aux)]
        same_state = saved.state == current.state
        if len(rest_saved) != len(rest_here) or (same_state and len(saved_aux) != len(here_aux)):
            raise ValueError(self._message(saved, f"It holds {count} variables, {len(saved_aux)} of them "
                                                  f"{saved.state}; this optimizer has {len(variables)}, "
                                                  f"{len(here_aux)} of them: the state of another model or optimizer."))
        kept = set() if saved.scaled == current.scaled else {id(v) for v in scale_state}
        pairs = [(i, j) for i, j in zip(rest_saved, rest_here) if id(variables[j]) not in kept]
        pairs += list(zip(saved_aux, here_aux)) if same_state else []
        values = [(variables[j], store[str(i)]) for i, j in pairs]
        _check(values, lambda v, value: self._message(
            saved, f"Saved {tuple(value.shape)} for {v.path} of shape {tuple(v.shape)}."))
        for variable, value in values:
            same = keras.backend.standardize_dtype(np.asarray(value).dtype) == keras.backend.standardize_dtype(
                variable.dtype)
            variable.assign(value if same else tf.cast(tf.convert_to_tensor(value), variable.dtype))
        if saved.state == "none":
            self.weights.take_from_model()

    def _load_unrecorded(self, store, keras_load):
        """A store from before kmix recorded layouts (or Keras's class): by position, where every value fits."""
        variables = list(self.optimizer.variables)
        if len(store.keys()) == len(variables):
            _check([(v, store[str(i)]) for i, v in enumerate(variables)], lambda v, value: (
                f"The optimizer state does not record the opt level it was written at, and its value for {v.path} "
                f"({value.dtype}{list(value.shape)}) is not what this optimizer at {self.layout.describe()} holds "
                f"there ({keras.backend.standardize_dtype(v.dtype)}{list(v.shape)}): written at another opt level. "
                "Nothing of the optimizer was loaded. Load it at the level it was written at and save it again "
                "(kmix now records the level, and converts on load), or pass skip_mismatch=True to load_weights "
                "to load the weights alone."), dtypes=True)
        keras_load(store)  # a count that differs: Keras's warning, nothing loaded


def _check(values, message, dtypes=False):
    for variable, value in values:
        value = np.asarray(value)
        same_dtype = keras.backend.standardize_dtype(value.dtype) == keras.backend.standardize_dtype(variable.dtype)
        if tuple(value.shape) != tuple(variable.shape) or (dtypes and not same_dtype):
            raise ValueError(message(variable, value))


def without_record(store):
    """`store` as Keras reads it: without kmix's layout entry."""
    return _Without(store)


class _Without:
    """A store as Keras reads it, without kmix's layout entry."""

    def __init__(self, store):
        self._store = store

    def keys(self):
        return [k for k in self._store.keys() if k != RECORD_NAME]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key != RECORD_NAME and key in self._store

    def __getitem__(self, key):
        return self._store[key]
