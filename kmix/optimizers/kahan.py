"""`master_weights="kahan"`: half parameters that train like float32 ones, for 2 bytes a parameter.

Instead of a float32 copy of each half parameter (4 bytes), a 2-byte buffer
keeps what rounding took from each update, as optimi and torchao do for
bfloat16. The inner optimizer's arithmetic runs in float32, as it would on
float32 parameters: its slots are float32, and its `update_step` sees a
float32 view of the half parameter; the update it writes (AdamW's decoupled
weight decay included) is then added to the parameter with compensation:

    y = update + c * unit(p)                  (float32)
    new = half(p + y)
    c = float16((y - (new - p)) / unit(new))  (what `new` could not hold)

`unit(x)` is the power of two of x's binade times the half dtype's epsilon
(its spacing there), so `c` is the rounding remainder in units of the
parameter's own spacing, |c| <= 1, kept to 11 bits whatever the parameter's
magnitude. A bfloat16 buffer of the remainder itself (optimi's) keeps 8 bits
of it and loses a systematic part of each update smaller than those bits:
a weight at 1.0 taking 5000 steps of 1e-5 ends 1.8 bfloat16 spacings from
float32's, where this buffer ends 0.2 away.

Per parameter: the half parameter, the buffer (2 bytes) and the inner
optimizer's slots in float32 (Adam: 8 bytes), against a float32 copy's 4.
"""

import contextlib

import keras
import tensorflow as tf

from kmix._compat import key_as, leave_weight_decay_of, optimizer_variable_key, weight_decay_applies
from kmix.optimizers.sgd import SGD as _KmixSGD

HALF = ("float16", "bfloat16")
BUFFER_DTYPE = "float16"
# Optimizers whose update, run on a float32 view, is what they do on float32 variables:
# every state is a slot made from the variable, every write to the variable goes through
# `assign` / `assign_add` / `assign_sub` (tests/optimizers/test_kahan.py runs each).
SUPPORTED = (keras.optimizers.SGD, _KmixSGD, keras.optimizers.Adam, keras.optimizers.AdamW,
             keras.optimizers.RMSprop, keras.optimizers.Adagrad, keras.optimizers.Adamax,
             keras.optimizers.Lion, keras.optimizers.Lamb, keras.optimizers.Adadelta)
_EPSILON_EXPONENT = {"bfloat16": -7, "float16": -10}
_FLOOR = {"bfloat16": 2.0**-126, "float16": 2.0**-24}  # spacing of the smallest values (float32-normal)


def check_inner(inner):
    """Refuses an inner optimizer `"kahan"` cannot run in float32 on half parameters, naming it."""
    if type(inner) in SUPPORTED:
        if getattr(inner, "use_ema", False):
            raise ValueError(
                "master_weights='kahan' does not support use_ema=True (the averages would be "
                f"taken of the half parameters). Received: {type(inner).__name__}(use_ema=True). "
                "Use master_weights=True."
            )
        return
    names = ", ".join(sorted({c.__name__ for c in SUPPORTED}))
    raise ValueError(
        f"master_weights='kahan' cannot run {type(inner).__module__}.{type(inner).__name__} in "
        "float32 on half parameters: it supports only Keras's optimizers whose whole state is "
        f"per-variable slots ({names}; kmix.optimizers.SGD too), not subclasses. Received: "
        f"inner_optimizer={inner!r}. Use master_weights=True (float32 copies), which runs any optimizer."
    )


def create_buffers(optimizer, var_list):
    """Creates a zero compensation buffer (float16) for each half variable in `var_list`.

    Returns:
        `{index in var_list: buffer}`.
    """
    buffers = {}
    for i, v in enumerate(var_list):
        if keras.backend.standardize_dtype(v.dtype) not in HALF:
            continue
        name = (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_")
        buffers[i] = optimizer.add_variable(
            shape=tuple(v.shape), dtype=BUFFER_DTYPE, initializer="zeros", aggregation="none", name=f"kahan_{name}"
        )
    return buffers


@contextlib.contextmanager
def float32_slots(inner):
    """While building `inner`, makes every half variable it adds (its slots) float32."""

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none", layout=None, name=None):
        if dtype is not None and keras.backend.standardize_dtype(dtype) in HALF:
            dtype = "float32"
        return type(inner).add_variable(inner, shape, initializer=initializer, dtype=dtype,
                                        aggregation=aggregation, layout=layout, name=name)

    inner.add_variable = add_variable
    try:
        yield
    finally:
        del inner.add_variable


def unit(x, dtype):
    """The spacing of the half `dtype` around the float32 values `x` (a power of two)."""
    exponent = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), 0x7F800000), tf.float32)
    return tf.maximum(exponent * 2.0 ** _EPSILON_EXPONENT[dtype], _FLOOR[dtype])


def compensated_add(variable, buffer, update):
    """Adds the float32 `update` to the half `variable`, carrying its rounding remainder in `buffer`."""
    dtype = keras.backend.standardize_dtype(variable.dtype)
    old = tf.cast(tf.convert_to_tensor(variable), tf.float32)
    y = tf.cast(update, tf.float32) + tf.cast(tf.convert_to_tensor(buffer), tf.float32) * unit(old, dtype)
    new = tf.cast(old + y, variable.dtype)
    new32 = tf.cast(new, tf.float32)
    # new - old is exact in float32 (two nearby half values), so this is y's remainder.
    buffer.assign(tf.cast((y - (new32 - old)) / unit(new32, dtype), BUFFER_DTYPE))
    variable.assign(new)


class Float32View:
    """What the inner optimizer's `update_step` updates in place of a half variable.

    It reads as the variable in float32 (`dtype` is `"float32"`, so Keras's
    arithmetic casts to float32), is filed under the variable's key (its
    slots), and collects the writes to it as one float32 `delta`.
    """

    def __init__(self, optimizer, variable):
        key_as(self, optimizer, variable)
        self.base = tf.cast(tf.convert_to_tensor(variable), tf.float32)
        self.delta = tf.zeros_like(self.base)
        self.shape = self.base.shape
        self.dtype = "float32"
        self.name = getattr(variable, "name", "kahan_view")

    @property
    def value(self):
        """The variable's value after the writes so far, float32."""
        return self.base + self.delta

    def assign(self, value):
        self.delta = _dense(value) - self.base

    def assign_add(self, value):
        self.delta = self.delta + _dense(value)

    def assign_sub(self, value):
        self.delta = self.delta - _dense(value)

    def __tf_tensor__(self, dtype=None, name=None):
        return self.value if dtype is None else tf.cast(self.value, dtype)


tf.register_tensor_conversion_function(
    Float32View, lambda view, dtype=None, name=None, as_ref=False: view.__tf_tensor__(dtype)
)


def _dense(value):
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    return tf.cast(value, tf.float32)


def install(inner, buffers):
    """Makes the built `inner` update the variables in `buffers` in float32, with compensation.

    Its `update_step` runs its class's update on a `Float32View` of each of
    those variables, its `assign` / `assign_add` / `assign_sub` write a view's
    `delta`, and the decay (`weight_decay`) of those variables joins their
    update; then `compensated_add` writes the update. Everything else (slots,
    other variables, the fused Adam update of float32 ones) is as before. The
    hooks stay for the optimizer's life: `MirroredStrategy` runs the replicas'
    updates in threads at once.

    Args:
        inner: the inner Keras optimizer, built.
        buffers: `{variable key: (variable, buffer)}`, keys from
            `kmix._compat.optimizer_variable_key`.
    """
    previous = inner.update_step  # Keras's, or kmix's fused Adam for float32 variables
    originals = {name: getattr(inner, name) for name in ("assign", "assign_add", "assign_sub")}
    leave_weight_decay_of(inner, set(buffers))

    def update_step(gradient, variable, learning_rate):
        try:
            found = buffers.get(optimizer_variable_key(inner, variable))
        except (AttributeError, TypeError):
            found = None
        if found is None:
            return previous(gradient, variable, learning_rate)
        view = Float32View(inner, variable)
        if weight_decay_applies(inner, found[0]):  # Keras's decoupled decay, before the update
            lr = tf.cast(learning_rate, tf.float32)
            view.assign_sub(view.value * tf.cast(inner.weight_decay, tf.float32) * lr)
        type(inner).update_step(inner, gradient, view, learning_rate)
        # `variable` may be a per-replica component under tf.distribute: write that one.
        compensated_add(variable, found[1], view.delta)

    def hook(name):
        def write(variable, value):
            if isinstance(variable, Float32View):
                return getattr(variable, name)(value)
            return originals[name](variable, value)

        return write

    inner.update_step = update_step
    for name in originals:
        setattr(inner, name, hook(name))
