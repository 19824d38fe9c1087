"""Float32 master copies of float16 / bfloat16 trainable variables.

float16 keeps 11 significant bits and bfloat16 8: an update smaller than
|w| * 2^-11 (float16) or |w| * 2^-8 (bfloat16) rounds away and the weight never
moves. With master weights the inner optimizer updates a float32 copy, and the
model variable receives the copy rounded to its dtype after every step;
`"kahan"` keeps a 2-byte remainder instead (kmix/optimizers/kahan.py).
"""

import keras
import tensorflow as tf

from kmix.optimizers import kahan

_HALF = ("float16", "bfloat16")


class ByIndex(dict):
    """`{index in the model's variable list: variable}`: the float32 copies, or the Kahan buffers.

    A dict subclass because TensorFlow's checkpoint tracking wraps a plain
    dict assigned to a trackable's attribute and refuses its int keys
    (`tf.train.Checkpoint`, `model.export`); it leaves other types alone. The
    variables are saved once, as the optimizer's variables.
    """


def auto_master_weights():
    """What `master_weights="auto"` means under the active policy.

    Off only where the policy asks for half parameters without master weights
    (kmix's `"O3"`, Keras's pure `"float16"` / `"bfloat16"`); on otherwise,
    which covers O2 and half variables a user created by hand.
    """
    try:
        from kmix.policy import active_policy
    except ImportError:  # the policy package is optional for the optimizer
        active_policy = None
    policy = active_policy() if active_policy is not None else None
    if policy is not None:
        return bool(policy.needs_master_weights) or policy.params_dtype not in _HALF
    return keras.config.dtype_policy().variable_dtype not in _HALF


def in_force(masters, compensation):
    """`True` where float32 copies exist, `"kahan"` where compensation buffers do, else False."""
    if masters:
        return True
    return "kahan" if compensation else False


def kind_for(request, var_list):
    """What `master_weights=request` keeps for `var_list`: `"masters"`, `"kahan"` or `"none"` (no half variable).

    Args:
        request: the optimizer's `master_weights` request, `"auto"` resolved.
        var_list: the variables it is built for.

    Returns:
        One of the three words; `create_for` creates what it names.
    """
    if not request or not any(keras.backend.standardize_dtype(v.dtype) in _HALF for v in var_list):
        return "none"
    return "kahan" if request == "kahan" else "masters"


def create_for(optimizer, request, var_list):
    """The master copies or compensation buffers that `master_weights=request` asks for `var_list`.

    Returns:
        `(masters, compensation)`: `{index in var_list: variable}` each, one of them empty.
    """
    if kind_for(request, var_list) == "none":
        return ByIndex(), ByIndex()
    if optimizer.inner_optimizer.built:
        raise ValueError(
            f"master_weights={request!r} needs an inner optimizer that is not built yet, so that it "
            "builds float32 slots; received a built "
            f"{type(optimizer.inner_optimizer).__name__}. Wrap a fresh optimizer, or pass "
            "master_weights=False."
        )
    if request == "kahan":
        return ByIndex(), ByIndex(kahan.create_buffers(optimizer, var_list))
    return ByIndex(create_masters(optimizer, var_list)), ByIndex()


def create_masters(optimizer, var_list):
    """Creates a float32 optimizer variable for each half variable in `var_list`.

    Returns:
        `{index in var_list: float32 copy}`.
    """
    masters = {}
    for i, v in enumerate(var_list):
        if keras.backend.standardize_dtype(v.dtype) not in _HALF:
            continue
        name = (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_")
        copy = optimizer.add_variable(
            shape=tuple(v.shape),
            dtype="float32",
            initializer="zeros",
            aggregation="none",
            name=f"master_{name}",
        )
        # `build` can run while `model.fit` traces its first train step; an assign traced there
        # lands in TensorFlow's variable-creation trace, which is never run: init_scope runs it
        # now. Only where the copy is still zero: a checkpoint read before the optimizer was
        # built (`tf.train.Checkpoint(...).read`, then `fit`) restored it as Keras created it
        # (where the saved copy is 0, the model's value is 0 too).
        with tf.init_scope():
            value, current = tf.cast(tf.convert_to_tensor(v), tf.float32), tf.convert_to_tensor(copy)
            # (While Keras builds symbolically the new variable reads empty: nothing was restored.)
            copy.assign(tf.where(tf.equal(current, 0.0), value, current) if current.shape == value.shape else value)
        masters[i] = copy
    return masters


def sync_from_model(masters, model_variables, indices):
    """Adopts model values that were changed behind the optimizer's back.

    `set_weights`, loading weights or `EarlyStopping(restore_best_weights=True)`
    write the half variables directly; where a copy no longer rounds to its
    variable, the variable's value wins (elsewhere the copy keeps the low bits
    the half variable cannot hold).
    """
    for i in indices:
        if i in masters:
            v, m = model_variables[i], masters[i]
            current = tf.convert_to_tensor(v)
            m.assign(tf.where(tf.cast(m, v.dtype) == current, m, tf.cast(current, tf.float32)))


def take_from_model(masters, model_variables):
    """Sets every float32 copy to its model variable's value: copies for weights loaded without any.

    Keras loads a model's layers before its optimizer (`model.layers` comes
    first), so the variables hold the loaded weights when the optimizer loads.
    """
    for i, m in masters.items():
        m.assign(tf.cast(tf.convert_to_tensor(model_variables[i]), tf.float32))


def copy_to_model(masters, model_variables, indices):
    """Writes the float32 copies at `indices` back into the model's half variables."""
    for i in indices:
        if i in masters:
            v = model_variables[i]
            v.assign(tf.cast(tf.convert_to_tensor(masters[i]), v.dtype))


def apply_inner(opt, unscaled, variables):
    """`opt.inner_optimizer.apply(unscaled, ...)` on the float32 copies where there are some, copied back."""
    if not opt._masters:
        opt.inner_optimizer.apply(unscaled, variables)
        return
    indices = [opt._index[id(v)] for v in variables]
    sync_from_model(opt._masters, opt._model_variables, indices)
    opt.inner_optimizer.apply(unscaled, [opt._masters.get(i, v) for i, v in zip(indices, variables)])
    copy_to_model(opt._masters, opt._model_variables, indices)


def finalize(opt, var_list):
    """The inner optimizer's `finalize_variable_values` (EMA) on the copies, copied to the model."""
    indices = [opt._index[id(v)] for v in var_list]
    opt.inner_optimizer.finalize_variable_values([opt._masters.get(i, v) for i, v in zip(indices, var_list)])
    copy_to_model(opt._masters, opt._model_variables, indices)
