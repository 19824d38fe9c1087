"""The opt level an optimizer's saved state was written at, and reading it at another level.

The model's variables are saved in their opt level's parameter dtype, and a
`kmix.LossScaleOptimizer`'s state in that level's layout: float32 master
copies (O2), Kahan remainders (`master_weights="kahan"`) or neither (float32,
O1, O3). kmix saves the layout with the state and compares it on a read:

- `.weights.h5` / `.keras` (key `kmix_layout`): a file from another level is
  converted. Keras casts the weights to each layer's dtype; the scale,
  counters and slots load by position, cast (the loss scale only between runs
  that both scale the loss, or both not); master copies the file lacks are
  made from the loaded weights (as `kmix.autocast` makes them), Kahan
  remainders it lacks start at zero, and copies or remainders this optimizer
  has no place for are left out. Master copies and Kahan remainders are not
  one another: reading one into the other raises a `ValueError` naming both
  levels, and nothing of the optimizer is assigned.
- `tf.train.Checkpoint` (the dependency `kmix_layout`): a checkpoint restores
  by the objects' layout, which differs between levels, so a read at another
  layout raises a `ValueError` naming both levels before any value is read;
  into an optimizer not built yet, when `build` attaches the record (the
  model's own variables are read first: where their dtypes differ,
  TensorFlow's dtype check refuses the read before kmix can name the levels).

Weights files from before kmix saved the layout load by position only where
every value has its variable's dtype and shape; such checkpoints are not checked.

Example:

>>> o1_model.save_weights("o1.weights.h5")  # placed at O1, compiled with kmix.wrap(...)
>>> o2_model.load_weights("o1.weights.h5")  # at O2: float16 weights, master copies made from them
"""

import dataclasses
import json
from collections import Counter

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix.optimizers import master_weights as mw
from kmix.policy import advice

RECORD_NAME = "kmix_layout"  # the key in a weights store, the dependency in a checkpoint
_STATE_WORDS = {
    "masters": "float32 master copies",
    "kahan": "Kahan remainders (master_weights='kahan')",
    "none": "no master copies",
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """What an optimizer's saved state holds.

    Attributes:
        level: the opt level the model was placed at (`kmix.Policy.name`,
            `"O2-float16"`), else the policy `kmix.wrap` ran under, else
            the level its dtypes and state look like.
        state: `"masters"`, `"kahan"` or `"none"` (`master_weights.kind_for`).
        params: `((dtype, count), ...)` of the trainable variables, by dtype.
        scaled: whether the loss is scaled (a dynamic scale, or a fixed one
            other than 1): a scale means nothing to a run of the other kind.
    """

    level: str
    state: str
    params: tuple
    scaled: bool

    def differences(self, other):
        """What a value restored as it was saved would get wrong: `[]` where the layouts match."""
        found = []
        if self.params != other.params:
            found.append("parameter dtypes")
        if self.state != other.state:
            found.append("what keeps the updates' low bits")
        if self.scaled != other.scaled:
            found.append("loss scaling")
        return found

    def matches(self, other):
        """Whether state saved at one restores into the other as it is."""
        return not self.differences(other)

    def describe(self):
        """`"O2-float16 (4 float16 and 2 float32 parameters, float32 master copies, loss scaling)"`."""
        params = " and ".join(f"{n} {dtype}" for dtype, n in self.params) or "no"
        scaling = "loss scaling" if self.scaled else "no loss scaling"
        return f"{self.level} ({params} parameters, {_STATE_WORDS.get(self.state, self.state)}, {scaling})"

    def encode(self, **extra):
        """The layout as JSON text (with `extra` fields: a weights file adds where its remainders are)."""
        fields = {"level": self.level, "state": self.state, "params": dict(self.params), "scaled": self.scaled}
        return json.dumps({**fields, **extra}, sort_keys=True)

    @classmethod
    def decode(cls, text):
        """`(layout, fields)` from `encode`'s text, or `(None, {})` for text that is not one."""
        try:
            fields = json.loads(text)
            layout = cls(str(fields["level"]), str(fields["state"]), tuple(sorted(fields["params"].items())),
                         bool(fields["scaled"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None, {}
        return layout, fields


def layout_of(optimizer, var_list, state):
    """The `Layout` of `optimizer` built for `var_list`.

    Args:
        optimizer: a `kmix.LossScaleOptimizer` in its `build` (its loss scale settled).
        var_list: the variables it is built for.
        state: what it keeps for them, `master_weights.kind_for`'s word.

    Returns:
        A `Layout`.
    """
    dtypes = Counter(keras.backend.standardize_dtype(v.dtype) for v in var_list)
    names = advice.levels(var_list)
    level = " + ".join(sorted(names)) or getattr(optimizer, "_policy_name", None) or _inferred_level(dtypes, state)
    scaled = bool(optimizer.dynamic or optimizer.initial_scale != 1.0)
    return Layout(level, state, tuple(sorted(dtypes.items())), scaled)


def _inferred_level(dtypes, state):
    """The level a model kmix did not place (`load_model`'s, one built under a policy) looks like."""
    halves = [dtype for dtype in ("float16", "bfloat16") if dtypes[dtype]]
    if not halves:
        return "float32 or O1"
    half = max(halves, key=lambda dtype: dtypes[dtype])
    return f"O3-{half}" if state == "none" else f"O2-{half}"


def install(optimizer, layout):
    """Makes `optimizer`'s saved state carry `layout` and be read against it. Call before creating variables.

    Gives it its checkpoint record (a checkpoint read before `build` waits
    for it, so it is checked here, before the optimizer's variables exist to
    be restored by position), and makes it the one loader of its inner
    optimizer's variables from a weights store: they are in its own entry,
    where `load` converts them, and Keras's load of the inner optimizer's
    entry (which comes after) would load them again by position after a
    refusal.

    Args:
        optimizer: a `kmix.LossScaleOptimizer` in its `build`.
        layout: its `Layout` (`layout_of`).

    Returns:
        `layout`.
    """
    _attach_record(optimizer, layout)
    optimizer.inner_optimizer.load_own_variables = _loaded_by_owner
    return layout


def _loaded_by_owner(store):
    """The inner optimizer's `load_own_variables`: nothing, its owner loaded these variables."""
    del store


# ---------------------------------------------------------------- tf.train.Checkpoint
def _attach_record(optimizer, layout):
    attaching = [True]

    def check(saved_text):
        saved, _ = Layout.decode(saved_text)
        if saved is not None and not saved.matches(layout):
            raise ValueError(_checkpoint_message(saved, layout, before_build=attaching[0]))

    label = (f"kmix's record of the opt level ({RECORD_NAME}): checkpoints written before kmix recorded it "
             "lack it; read those with .expect_partial()")
    _compat.attach_record(optimizer, RECORD_NAME, _compat.NamedRecord(layout.encode, check, label))
    attaching[0] = False


def _checkpoint_message(saved, current, before_build):
    done = ("The model's variables were read with the checkpoint; none of the optimizer's state was."
            if before_build else "Nothing was restored.")
    return (
        f"This tf.train.Checkpoint was written at {saved.describe()}; this optimizer is at "
        f"{current.describe()}. A checkpoint restores each value as saved into the object in its place, and "
        f"these differ in {' and '.join(saved.differences(current))}. {done} To convert it, restore it "
        f"into the model placed at {saved.level} with its optimizer, write model.save_weights("
        "'converted.weights.h5'), and load_weights that file here: weights files convert between opt levels."
    )


# ---------------------------------------------------------------- .weights.h5 / .keras
def write(optimizer, store):
    """Adds the layout to the store Keras's `save_own_variables` filled (nothing before `build`)."""
    layout = getattr(optimizer, "_saved_layout", None)
    if layout is None or not optimizer.built:
        return
    text = layout.encode(aux=_aux_indices(optimizer))
    store[RECORD_NAME] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load(optimizer, store, keras_load):
    """Loads a store `write` (or Keras) filled into `optimizer`, converting from another opt level.

    Args:
        optimizer: a `kmix.LossScaleOptimizer`.
        store: the optimizer's entry of a Keras weights store.
        keras_load: Keras's `load_own_variables`, for stores without a layout.

    Raises:
        ValueError: master copies read into Kahan remainders or back, or a
            state of another model; naming both levels. Nothing is assigned.
    """
    view = _Without(store, RECORD_NAME)
    recorded = RECORD_NAME in store
    if not optimizer.built or getattr(optimizer, "_saved_layout", None) is None:
        keras_load(view)  # Keras's warning: nothing built to load into
        return
    if not recorded:
        _load_unrecorded(optimizer, view, keras_load)
        return
    saved, fields = Layout.decode(bytes(np.asarray(store[RECORD_NAME], dtype=np.uint8)).decode("utf-8"))
    if saved is None:
        raise ValueError(f"The optimizer state's {RECORD_NAME!r} entry is not a layout kmix wrote.")
    if saved.matches(optimizer._saved_layout):
        keras_load(view)  # the same layout: as Keras loads it, by position, bit for bit
        return
    _load_converted(optimizer, view, saved, [int(i) for i in fields.get("aux", [])])


def _load_converted(optimizer, store, saved, saved_aux):
    current = optimizer._saved_layout
    variables = list(optimizer.variables)
    here_aux = _aux_indices(optimizer)
    count = len(store.keys())
    if {saved.state, current.state} == {"masters", "kahan"}:
        raise ValueError(_weights_message(saved, current, "Master copies and Kahan remainders hold different "
                                          "quantities; neither is made from the other."))
    rest_saved = [i for i in range(count) if i not in set(saved_aux)]
    rest_here = [j for j in range(len(variables)) if j not in set(here_aux)]
    # A loss scale of the other kind (scaled / not) means nothing here: this optimizer keeps its own.
    kept = set() if saved.scaled == current.scaled else {id(v) for v in _scale_state(optimizer)}
    pairs = [(i, j) for i, j in zip(rest_saved, rest_here) if id(variables[j]) not in kept]
    if saved.state == current.state:
        pairs += list(zip(saved_aux, here_aux))
    if len(rest_saved) != len(rest_here) or (saved.state == current.state and len(saved_aux) != len(here_aux)):
        raise ValueError(_weights_message(saved, current, f"It holds {count} variables, {len(saved_aux)} of them "
                                          f"{saved.state}; this optimizer has {len(variables)}, {len(here_aux)} of "
                                          "them: the state of another model or optimizer."))
    values = [(variables[j], store[str(i)]) for i, j in pairs]
    _check_shapes(values, lambda v, value: _weights_message(
        saved, current, f"Saved {tuple(value.shape)} for {v.path} of shape {tuple(v.shape)}."))
    for variable, value in values:
        _assign(variable, value)
    if saved.state == "none" and current.state == "masters":
        mw.take_from_model(optimizer._masters, optimizer._model_variables)
    elif saved.state == "none" and current.state == "kahan":
        for buffer in optimizer._kahan.values():
            buffer.assign(tf.zeros(buffer.shape, buffer.dtype))


def _load_unrecorded(optimizer, store, keras_load):
    """A store from before kmix recorded layouts (or Keras's class): by position, where every value fits."""
    variables = list(optimizer.variables)
    if len(store.keys()) != len(variables):
        keras_load(store)  # Keras's warning: another optimizer's state, nothing loaded
        return
    values = [(v, store[str(i)]) for i, v in enumerate(variables)]
    current = optimizer._saved_layout
    _check_shapes(values, lambda v, value: (
        f"The optimizer state does not record the opt level it was written at, and its value for {v.path} "
        f"({value.dtype}{list(value.shape)}) is not what this optimizer at {current.describe()} holds there "
        f"({keras.backend.standardize_dtype(v.dtype)}{list(v.shape)}): written at another opt level. Nothing of "
        "the optimizer was loaded. Load it at the level it was written at and save it again (kmix now records "
        "the level, and converts on load), or pass skip_mismatch=True to load_weights to load the weights "
        "alone."), dtypes=True)
    keras_load(store)


def _check_shapes(values, message, dtypes=False):
    for variable, value in values:
        value = np.asarray(value)
        same_dtype = keras.backend.standardize_dtype(value.dtype) == keras.backend.standardize_dtype(variable.dtype)
        if tuple(value.shape) != tuple(variable.shape) or (dtypes and not same_dtype):
            raise ValueError(message(variable, value))


def _assign(variable, value):
    if keras.backend.standardize_dtype(np.asarray(value).dtype) == keras.backend.standardize_dtype(variable.dtype):
        variable.assign(value)  # as Keras assigns: bit for bit
    else:
        variable.assign(tf.cast(tf.convert_to_tensor(value), variable.dtype))


def _weights_message(saved, current, why):
    return (
        f"Cannot load this optimizer state: it was written at {saved.describe()}, and this optimizer is at "
        f"{current.describe()}. {why} Nothing of the optimizer was loaded; Keras goes on to load the model's "
        "weights all the same. Load it into an optimizer at "
        f"{saved.level} with master_weights as saved, or pass skip_mismatch=True to load_weights to load "
        "the weights alone."
    )


def _scale_state(optimizer):
    """The variables of the loss scale's trajectory: the scale, good steps, hysteresis, growth interval."""
    return [optimizer.dynamic_scale, optimizer.step_counter, optimizer._hysteresis_left,
            optimizer._growth_interval_var]


def _aux_indices(optimizer):
    """Where the master copies or Kahan remainders are in `optimizer.variables`."""
    aux = {id(v) for v in list(optimizer._masters.values()) + list(optimizer._kahan.values())}
    return [i for i, v in enumerate(optimizer.variables) if id(v) in aux]


class _Without:
    """A store as Keras reads it, without one key."""

    def __init__(self, store, key):
        self._store, self._key = store, key

    def keys(self):
        return [k for k in self._store.keys() if k != self._key]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key != self._key and key in self._store

    def __getitem__(self, key):
        return self._store[key]
