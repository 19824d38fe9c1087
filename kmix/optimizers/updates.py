"""How the inner optimizer's update reaches the model's variables: master copies, Kahan, fused Adam, SGD."""

import functools

import keras
import tensorflow as tf
from keras import ops

from kmix import _compat

HALF = ("float16", "bfloat16")
BUFFER_DTYPE = "float16"
_EPSILON_EXPONENT = {"bfloat16": -7, "float16": -10}
_FLOOR = {"bfloat16": 2.0**-126, "float16": 2.0**-24}  # the spacing of the smallest normal values


@keras.saving.register_keras_serializable(package="kmix")
class SGD(keras.optimizers.SGD):
    """SGD whose momentum is a sum of gradients (torch's form), so `lr * g` never underflows in float16 slots.

    `h = momentum * h + g;  w -= lr * (g + momentum * h) if nesterov else lr * h`, in float32; Keras's
    `m = momentum * m - lr * g` underflows once `lr * g` < 2^-24 (O3). Same arguments as `keras.optimizers.SGD`.

    Example:
    >>> kmix.set_policy("O3")
    >>> model.compile(optimizer=kmix.wrap(kmix.optimizers.SGD(1e-3, momentum=0.9)), loss="mse")
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        """One step on one variable, in float32, stored in the variable's dtype."""
        lr, g = ops.cast(learning_rate, "float32"), ops.cast(gradient, "float32")
        if self.momentum == 0:
            self.assign_sub(variable, ops.multiply(g, lr))
            return
        h_var = self.momentums[self._get_variable_index(variable)]
        momentum = ops.cast(self.momentum, "float32")
        h = ops.add(ops.multiply(ops.cast(h_var, "float32"), momentum), g)
        self.assign(h_var, h)
        self.assign_sub(variable, ops.multiply(ops.add(g, ops.multiply(h, momentum)) if self.nesterov else h, lr))


KAHAN_OPTIMIZERS = (keras.optimizers.SGD, SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
                    keras.optimizers.RMSprop, keras.optimizers.Adagrad, keras.optimizers.Adamax,
                    keras.optimizers.Lion, keras.optimizers.Lamb, keras.optimizers.Adadelta)


def check_kahan(inner):
    """Refuses an inner optimizer `"kahan"` cannot run in float32 on half parameters, naming it."""
    if type(inner) in KAHAN_OPTIMIZERS:
        if getattr(inner, "use_ema", False):
            raise ValueError("master_weights='kahan' does not support use_ema=True (the averages would be taken "
                             f"of the half parameters). Received: {type(inner).__name__}(use_ema=True). Use "
                             "master_weights=True.")
        return
    names = ", ".join(sorted({c.__name__ for c in KAHAN_OPTIMIZERS}))
    raise ValueError(
        f"master_weights='kahan' cannot run {type(inner).__module__}.{type(inner).__name__} in float32 on half "
        f"parameters: it supports only Keras's optimizers whose whole state is per-variable slots ({names}; "
        f"kmix.optimizers.SGD too), not subclasses. Received: inner_optimizer={inner!r}. Use "
        "master_weights=True (float32 copies), which runs any optimizer.")


class ByIndex(dict):
    """`{index in the model's variable list: variable}` (a subclass: TF's tracking wraps plain dicts)."""


def slug(v):
    """`v`'s path as part of a variable name: `/` and `:` as `_`."""
    return (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_")


def kind_for(request, var_list):
    """What `master_weights=request` keeps for `var_list`: `"masters"`, `"kahan"` or `"none"`."""
    if not request or not any(keras.backend.standardize_dtype(v.dtype) in HALF for v in var_list):
        return "none"
    return "kahan" if request == "kahan" else "masters"


class MasterWeights:
    """The float32 copies or Kahan buffers of `var_list`'s half variables, made by `optimizer` in its `build`.

    `request` is `master_weights` with `"auto"` resolved.
    """

    def __init__(self, optimizer, request, var_list):
        self.kind = kind_for(request, var_list)
        self.variables = list(var_list)
        self.index = {id(v): i for i, v in enumerate(var_list)}
        self.copies, self.remainders = ByIndex(), ByIndex()
        if self.kind != "none" and optimizer.inner_optimizer.built:
            raise ValueError(f"master_weights={request!r} needs an inner optimizer that is not built yet, so that "
                             f"it builds float32 slots; received a built {type(optimizer.inner_optimizer).__name__}."
                             " Wrap a fresh optimizer, or pass master_weights=False.")
        table = self.copies if self.kind == "masters" else self.remainders
        for i, v in enumerate(var_list):
            if self.kind == "none" or keras.backend.standardize_dtype(v.dtype) not in HALF:
                continue
            dtype, prefix = (BUFFER_DTYPE, "kahan") if self.kind == "kahan" else ("float32", "master")
            table[i] = copy = optimizer.add_variable(tuple(v.shape), dtype=dtype, initializer="zeros",
                                                     aggregation="none", name=f"{prefix}_{slug(v)}")
            if self.kind == "kahan":
                continue
            # `build` may run inside fit's first trace, whose assigns never run: init_scope runs it now. A copy
            # a checkpoint restored before the build (not zero) is kept.
            with tf.init_scope():
                value, current = tf.cast(tf.convert_to_tensor(v), tf.float32), tf.convert_to_tensor(copy)
                copy.assign(tf.where(tf.equal(current, 0.0), value, current) if current.shape == value.shape else value)

    @property
    def in_force(self):
        """`True` where float32 copies exist, `"kahan"` where remainders do, else False."""
        return True if self.copies else ("kahan" if self.remainders else False)

    def state(self):
        """The copies and remainders, for saving."""
        return list(self.copies.values()) + list(self.remainders.values())

    def targets(self):
        """What the inner optimizer is built on: the float32 copies where there are some."""
        return [self.copies.get(i, v) for i, v in enumerate(self.variables)]

    def install_kahan(self, inner):
        """Makes the built `inner` update the half variables in float32, adding with compensation."""
        if self.remainders:
            _install_kahan(inner, {_compat.optimizer_variable_key(inner, self.variables[i]): (self.variables[i], c)
                                   for i, c in self.remainders.items()})

    def apply(self, inner, grads, variables):
        """`inner.apply(grads, ...)` on the copies where there are some, then copied back to the model."""
        if not self.copies:
            inner.apply(grads, variables)
            return
        for i, m in self._copies_of(variables):  # values written behind the optimizer's back (set_weights) win
            v = self.variables[i]
            current = tf.convert_to_tensor(v)
            m.assign(tf.where(tf.cast(m, v.dtype) == current, m, tf.cast(current, tf.float32)))
        inner.apply(grads, [self.copies.get(self.index[id(v)], v) for v in variables])
        self._copy_back(variables)

    def finalize(self, inner, var_list):
        """The inner optimizer's `finalize_variable_values` (EMA) on the copies, copied back."""
        inner.finalize_variable_values([self.copies.get(self.index[id(v)], v) for v in var_list])
        self._copy_back(var_list)

    def _copies_of(self, variables):
        return [(i, self.copies[i]) for i in (self.index[id(v)] for v in variables) if i in self.copies]

    def _copy_back(self, variables):
        for i, m in self._copies_of(variables):
            self.variables[i].assign(tf.cast(tf.convert_to_tensor(m), self.variables[i].dtype))

    def take_from_model(self):
        """Copies made from the model's values (weights loaded without any), remainders zeroed."""
        for i, m in self.copies.items():
            m.assign(tf.cast(tf.convert_to_tensor(self.variables[i]), tf.float32))
        for c in self.remainders.values():
            c.assign(tf.zeros(c.shape, c.dtype))


def unit(x, dtype):
    """The spacing of the half `dtype` around the float32 values `x` (a power of two)."""
    exponent = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), 0x7F800000), tf.float32)
    return tf.maximum(exponent * 2.0 ** _EPSILON_EXPONENT[dtype], _FLOOR[dtype])


def compensated_add(variable, buffer, update):
    """Adds the float32 `update` to the half `variable`, carrying its rounding remainder in `buffer`.

    `y = update + c * unit(p); new = half(p + y); c = float16((y - (new - p)) / unit(new))` (optimi, torchao).
    """
    dtype = keras.backend.standardize_dtype(variable.dtype)
    old = tf.cast(tf.convert_to_tensor(variable), tf.float32)
    y = tf.cast(update, tf.float32) + tf.cast(tf.convert_to_tensor(buffer), tf.float32) * unit(old, dtype)
    new = tf.cast(old + y, variable.dtype)
    new32 = tf.cast(new, tf.float32)
    buffer.assign(tf.cast((y - (new32 - old)) / unit(new32, dtype), BUFFER_DTYPE))  # new - old is exact
    variable.assign(new)


class Float32View:
    """A half variable as Keras's update sees it under `"kahan"`: float32, its writes collected in `delta`."""

    def __init__(self, optimizer, variable):
        _compat.key_as(self, optimizer, variable)
        self.base = tf.cast(tf.convert_to_tensor(variable), tf.float32)
        self.delta = tf.zeros_like(self.base)
        self.shape, self.dtype, self.name = self.base.shape, "float32", getattr(variable, "name", "kahan_view")

    @property
    def value(self):
        return self.base + self.delta

    def assign(self, value):
        self.delta = _dense(value) - self.base

    def assign_add(self, value):
        self.delta = self.delta + _dense(value)

    def assign_sub(self, value):
        self.delta = self.delta - _dense(value)


tf.register_tensor_conversion_function(Float32View, lambda view, dtype=None, name=None, as_ref=False: (
    view.value if dtype is None else tf.cast(view.value, dtype)))


def _dense(value):
    return tf.cast(tf.convert_to_tensor(value) if isinstance(value, tf.IndexedSlices) else value, tf.float32)


def _install_kahan(inner, buffers):
    previous = _compat.replaced_update_step(inner) or inner.update_step  # fused Adam for float32 variables
    _compat.leave_weight_decay_of(inner, set(buffers))

    def update_step(gradient, variable, learning_rate):
        try:
            found = buffers.get(_compat.optimizer_variable_key(inner, variable))
        except (AttributeError, TypeError):
            found = None
        if found is None:
            return previous(gradient, variable, learning_rate)
        view = Float32View(inner, variable)
        if _compat.weight_decay_applies(inner, found[0]):  # Keras's decoupled decay, in float32
            view.assign_sub(view.value * tf.cast(inner.weight_decay, tf.float32) * tf.cast(learning_rate, tf.float32))
        type(inner).update_step(inner, gradient, view, learning_rate)
        compensated_add(variable, found[1], view.delta)  # a per-replica component under tf.distribute

    def route(name, keras_method):
        return lambda variable, value: (getattr(variable, name)(value) if isinstance(variable, Float32View)
                                        else keras_method(variable, value))

    _compat.replace_update_step(inner, update_step)
    _compat.route_assigns(inner, route)


def can_fuse(optimizer):
    """Whether `use_fused_adam` would fuse `optimizer`: exactly Adam / AdamW, no amsgrad."""
    return type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW) and not optimizer.amsgrad


def fused(optimizer):
    """Whether `optimizer` updates on the fused kernel."""
    return isinstance(_compat.replaced_update_step(optimizer), functools.partial)


def use_fused_adam(optimizer, on=True):
    """Adam's dense float32 update on TensorFlow's one-pass `ResourceApplyAdam` kernel (on=False: Keras's).

    Returns whether the fused update is in force.
    """
    if not on or not can_fuse(optimizer):
        if fused(optimizer):
            _compat.restore_update_step(optimizer)
        return False
    if not fused(optimizer):
        _compat.replace_update_step(optimizer, functools.partial(_fused_update_step, optimizer))
    return True


def _fused_update_step(optimizer, gradient, variable, learning_rate):
    tf_variable = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(gradient, tf.IndexedSlices) or tf_variable.dtype not in (tf.float32, tf.float64):
        return type(optimizer).update_step(optimizer, gradient, variable, learning_rate)
    dtype = tf_variable.dtype
    momentum, velocity = (s.value if isinstance(s, keras.Variable) else s
                          for s in _compat.adam_slots(optimizer, variable))
    beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=tf_variable.handle, m=momentum.handle, v=velocity.handle, beta1_power=tf.pow(beta_1, local_step),
        beta2_power=tf.pow(beta_2, local_step), lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
        epsilon=tf.cast(optimizer.epsilon, dtype), grad=tf.cast(gradient, dtype), use_locking=False)
