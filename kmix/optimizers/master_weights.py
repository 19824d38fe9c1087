"""Float32 master copies of float16 / bfloat16 trainable variables.

float16 keeps 11 significant bits and bfloat16 8: an update smaller than
|w| * 2^-11 (float16) or |w| * 2^-8 (bfloat16) rounds away and the weight never
moves. With master weights the inner optimizer updates a float32 copy, and the
model variable receives the copy rounded to its dtype after every step.
"""

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

_HALF = ("float16", "bfloat16")
_NP_HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


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


def create_for(optimizer, request, var_list):
    """The master copies or compensation buffers that `master_weights=request` asks for `var_list`.

    Returns:
        `(masters, compensation)`: `{index in var_list: variable}` each, one of them empty.
    """
    if request == "kahan":
        check_kahan_inner(optimizer.inner_optimizer, var_list)
        return {}, create_compensation(optimizer, var_list)
    if not request or not any(keras.backend.standardize_dtype(v.dtype) in _HALF for v in var_list):
        return {}, {}
    if optimizer.inner_optimizer.built:
        raise ValueError(
            "Master weights need an inner optimizer that is not built yet, so that it "
            "builds its slots on the float32 copies; received a built "
            f"{type(optimizer.inner_optimizer).__name__}. Wrap a fresh optimizer, or pass "
            "master_weights=False."
        )
    return create_masters(optimizer, var_list), {}


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
        # `build` can run while `model.fit` traces its first train step; an assign
        # traced there lands in TensorFlow's variable-creation trace, which is
        # never run, and the copy would start at zero. init_scope runs it now.
        with tf.init_scope():
            copy.assign(tf.cast(tf.convert_to_tensor(v), tf.float32))
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


def copy_to_model(masters, model_variables, indices):
    """Writes the float32 copies at `indices` back into the model's half variables."""
    for i in indices:
        if i in masters:
            v = model_variables[i]
            v.assign(tf.cast(tf.convert_to_tensor(masters[i]), v.dtype))


# --------------------------------------------------------------------- Kahan
# `master_weights="kahan"`: instead of a float32 copy (4 bytes a parameter), a
# half-precision buffer per half variable keeps what rounding took from each
# update (2 bytes a parameter), as optimi and torchao do for bfloat16:
#
#     y = update + c          (float32)
#     new = half(p + y)
#     c = half(y - (new - p)) (the part of y that `new` could not hold)
#
# The inner optimizer updates the half variables themselves (its slots take
# their dtype); its writes to them go through `compensated_add`.


def check_kahan_inner(inner, var_list):
    """Refuses an inner optimizer whose `beta_2` is 1.0 in a half parameter's dtype.

    Under `"kahan"` the inner optimizer computes in the parameters' dtype;
    Adam's bias correction `1 - beta_2**t` is then 0 for `beta_2=0.999`
    (1.0 in bfloat16) and the weights never move.
    """
    beta_2 = getattr(inner, "beta_2", None)
    if not isinstance(beta_2, float):
        return
    for v in var_list:
        dtype = keras.backend.standardize_dtype(v.dtype)
        # NumPy, not TensorFlow: `build` may run while `fit` traces its step.
        if dtype in _HALF and float(np.asarray(beta_2, np.float32).astype(_NP_HALF[dtype])) == 1.0:
            raise ValueError(
                f"master_weights='kahan' runs {type(inner).__name__} in the parameters' dtype, where "
                f"beta_2={beta_2!r} rounds to 1.0 ({dtype}): its bias correction would be 0 and no "
                "weight would move. Pass beta_2=0.99 or lower, use master_weights=True, or an "
                "optimizer without beta_2 (kmix.optimizers.SGD)."
            )


def create_compensation(optimizer, var_list):
    """Creates a zero compensation buffer, of the variable's dtype, for each half variable.

    Returns:
        `{index in var_list: compensation variable}`.
    """
    buffers = {}
    for i, v in enumerate(var_list):
        dtype = keras.backend.standardize_dtype(v.dtype)
        if dtype not in _HALF:
            continue
        name = (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_")
        buffers[i] = optimizer.add_variable(
            shape=tuple(v.shape), dtype=dtype, initializer="zeros", aggregation="none", name=f"kahan_{name}"
        )
    return buffers


def compensated_add(variable, compensation, update):
    """Adds `update` to the half `variable`, carrying its rounding error in `compensation`."""
    if isinstance(update, tf.IndexedSlices):
        update = tf.convert_to_tensor(update)
    old = tf.cast(tf.convert_to_tensor(variable), tf.float32)
    y = tf.cast(update, tf.float32) + tf.cast(tf.convert_to_tensor(compensation), tf.float32)
    new = tf.cast(old + y, variable.dtype)
    # new - old is exact in float32 (two half values), so the error is y's remainder.
    compensation.assign(tf.cast(y - (tf.cast(new, tf.float32) - old), compensation.dtype))
    variable.assign(new)


def install_kahan_hooks(optimizer, buffers):
    """Routes `optimizer`'s writes to the variables in `buffers` through `compensated_add`.

    `optimizer.assign_add(v, x)`, `assign_sub(v, x)` and `assign(v, x)`
    (Keras's hooks, which every built-in `update_step` uses to write a
    variable) become compensated updates for the half variables that have a
    buffer; writes to anything else (slots) go to Keras's methods. The hooks
    are installed once, when the loss-scale optimizer is built, and never
    removed: `MirroredStrategy` runs the replicas' updates in threads at once.

    Args:
        optimizer: the inner Keras optimizer, built.
        buffers: `{variable key: (variable, compensation)}` with keys from
            `kmix._compat.optimizer_variable_key`.
    """
    from kmix._compat import optimizer_variable_key

    originals = {name: getattr(optimizer, name) for name in ("assign", "assign_add", "assign_sub")}

    def lookup(variable):
        try:
            return buffers.get(optimizer_variable_key(optimizer, variable))
        except (AttributeError, TypeError):
            return None

    def make(name):
        def hook(variable, value):
            found = lookup(variable)
            if found is None:
                return originals[name](variable, value)
            if isinstance(value, tf.IndexedSlices):
                value = tf.convert_to_tensor(value)
            if name == "assign":
                value = tf.cast(value, tf.float32) - tf.cast(tf.convert_to_tensor(variable), tf.float32)
            elif name == "assign_sub":
                value = -tf.cast(value, tf.float32)
            # `variable` may be a per-replica component under tf.distribute: write that one.
            compensated_add(variable, found[1], value)

        return hook

    for name in originals:
        setattr(optimizer, name, make(name))


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
