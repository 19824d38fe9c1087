"""Float32 master copies of float16 / bfloat16 trainable variables.

float16 keeps 11 significant bits and bfloat16 8: an update smaller than
|w| * 2^-11 (float16) or |w| * 2^-8 (bfloat16) rounds away and the weight never
moves. With master weights the inner optimizer updates a float32 copy, and the
model variable receives the copy rounded to its dtype after every step.
"""

import keras
import tensorflow as tf

_HALF = ("float16", "bfloat16")


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
