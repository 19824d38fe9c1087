"""kmix's state beside Keras's: the active kmix policy, and what `autocast` recorded on a model's variables.

The optimizers read both and import nothing of `kmix.policy` or `kmix.placing`,
which import them. The active policy is kept per thread, as Keras keeps its
global dtype policy. A placement is recorded on each trainable variable itself,
as the attribute `kmix_placed`: the optimizer is handed the variables by `fit`
(its `build`), so it reads them there, with no registry beside the model.
"""

import dataclasses
import threading

import keras

_LOCAL = threading.local()
ATTRIBUTE = "kmix_placed"


def active_policy():
    """The `kmix.Policy` last set, or None (never set, or Keras's global policy changed since)."""
    policy = getattr(_LOCAL, "policy", None)
    if policy is None or keras.config.dtype_policy().name != getattr(_LOCAL, "keras_name", None):
        return None
    return policy


def set_active(policy, keras_name):
    """Records `policy` as kmix's policy and `keras_name` as the Keras policy it set."""
    _LOCAL.policy, _LOCAL.keras_name = policy, keras_name


def save():
    """A snapshot of the active policy, for `restore`."""
    return getattr(_LOCAL, "policy", None), getattr(_LOCAL, "keras_name", None)


def restore(saved):
    """Puts back a snapshot `save` took (Keras's own policy is not touched)."""
    _LOCAL.policy, _LOCAL.keras_name = saved


@dataclasses.dataclass(frozen=True)
class Placed:
    """What `kmix.autocast` recorded on a trainable variable.

    Attributes:
        compute_dtype: the compute dtype of the innermost layer that owns it.
        level: the name of the policy it was placed under (`"O2-float16"`).
        initial_scale: the initial loss scale the diagnosis advised (`sample=`), or None.
    """

    compute_dtype: str
    level: str
    initial_scale: float = None


def record_model(model, initial_scale=None, level=None):
    """Records a `Placed` on each trainable variable of `model`, from the innermost layer that owns it."""
    from kmix._tree import walk

    owners = {id(v): (v, model.compute_dtype) for v in model.trainable_variables}
    for _, layer, _ in walk(model):  # parents before children: the innermost owner is last
        for v in layer.trainable_variables:
            owners[id(v)] = (v, layer.compute_dtype)
    scale = None if initial_scale is None else float(initial_scale)
    for v, dtype in owners.values():
        setattr(v, ATTRIBUTE, Placed(str(dtype), str(level), scale))


def placed(variables):
    """The `Placed` records of `variables` (those that have one)."""
    return [p for p in (getattr(v, ATTRIBUTE, None) for v in variables) if p is not None]


def snapshot(variables):
    """The records of `variables`, for `restore_records`: `kmix.recommend` places a model only for a while."""
    return [(v, getattr(v, ATTRIBUTE, None)) for v in variables]


def restore_records(saved):
    """Puts back the records `snapshot` took."""
    for v, record in saved:
        if record is None:
            if hasattr(v, ATTRIBUTE):
                delattr(v, ATTRIBUTE)
        else:
            setattr(v, ATTRIBUTE, record)
