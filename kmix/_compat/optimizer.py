"""Keras optimizers' private names: loss scaling, master weights, fused Adam, replicas."""

import contextlib

import keras
import tensorflow as tf

from kmix._compat import keras_src


def strategy_supports_no_merge_call():
    """Whether the current `tf.distribute` strategy runs updates without `merge_call`.

    Keras's own optimizers branch on exactly this (through the same
    `tf.__internal__` name): under `MirroredStrategy` on CPUs, or without XLA,
    an optimizer update must go through `ReplicaContext.merge_call`, and a
    `tf.cond` in replica context may not contain one. Under XLA on GPUs there
    is no merge call, and calling one fails. There is no public predicate.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def no_automatic_dependency_tracking(fn):
    """Keras's decorator that stops attribute assignment from tracking variables.

    An optimizer's `build` keeps a list of the *model's* variables; assigned
    to an attribute normally, Keras's tracker would adopt them as optimizer
    variables (saved twice, counted as slots). Keras's own optimizers wrap
    `build` in this private decorator; there is no public equivalent.
    """
    return keras_src.tracking().no_automatic_dependency_tracking(fn)


def learning_rate_object(optimizer):
    """The learning-rate object a Keras optimizer holds: a variable, a schedule or a callable.

    Keras has no public accessor for it: `optimizer.learning_rate` evaluates a
    schedule, and `get_config()` returns a serialized copy (which fails for an
    unregistered schedule). kmix's callbacks need the object itself to wrap a
    schedule (warm-up, NaNGuard's rate cut), so this reads the private
    `_learning_rate`; the public setter `optimizer.learning_rate = ...`
    changes it.
    """
    return optimizer._learning_rate


def optimizer_variable_key(optimizer, variable):
    """The key a Keras optimizer files `variable` under (its slots are looked up by it).

    `master_weights="kahan"` must recognise the model variables among the
    writes of the inner optimizer's `update_step`; under `tf.distribute` those
    writes receive the strategy's per-replica variable, not the
    `keras.Variable`, and only Keras's private `_var_key` maps both to the same
    key. There is no public equivalent.
    """
    return optimizer._var_key(variable)


def take_gradients_as_reduced(optimizer):
    """Makes a Keras optimizer apply the gradients it is given without all-reducing them.

    `kmix.LossScaleOptimizer(..., allreduce_dtype=...)` sums the gradients over
    the replicas itself, in float16 or bfloat16, and checks the sums; the
    inner optimizer must not sum them a second time. Keras 3's TensorFlow
    optimizer all-reduces inside `_backend_update_step` through its private
    method `_all_reduce_sum_gradients` and has no public switch (tf.keras's
    `apply_gradients(..., skip_gradients_aggregation=True)` is gone). This
    replaces that method on this one instance (its class and other optimizers
    keep Keras's), for good: its owner reduces every gradient it hands over.
    Keras's TF optimizer filters None gradients before calling it.
    """
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


# Method replacements on one optimizer instance (its class and every other optimizer keep Keras's).
# Checked on Keras 3.10-3.15. Keras calls these through `self.<name>`, so an instance attribute is
# the only way to change them for one object; there is no public hook.


def replace_update_step(optimizer, fn):
    """Makes `optimizer` call `fn(gradient, variable, learning_rate)` per variable (fused Adam, Kahan)."""
    optimizer.update_step = fn


def replaced_update_step(optimizer):
    """The instance's own `update_step` set by `replace_update_step`, or None."""
    return vars(optimizer).get("update_step")


def restore_update_step(optimizer):
    """Gives `optimizer` back its class's `update_step`."""
    vars(optimizer).pop("update_step", None)


def route_assigns(optimizer, route):
    """Makes `optimizer.assign` / `assign_add` / `assign_sub` call `route(name, keras_method)(variable, value)`.

    `"kahan"` hands Keras's update a float32 view of a half variable; Keras
    writes the variable through these three methods, which must write the view.
    """
    for name in ("assign", "assign_add", "assign_sub"):
        setattr(optimizer, name, route(name, getattr(optimizer, name)))


@contextlib.contextmanager
def float32_slots(optimizer):
    """While building `optimizer`, every half variable it adds (its slots) is float32 (`"kahan"`).

    Keras creates slots in the variable's dtype through `add_variable`; no argument changes that.
    """

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none", layout=None, name=None):
        if dtype is not None and keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16"):
            dtype = "float32"
        return type(optimizer).add_variable(optimizer, shape, initializer=initializer, dtype=dtype,
                                            aggregation=aggregation, layout=layout, name=name)

    optimizer.add_variable = add_variable
    try:
        yield
    finally:
        del optimizer.add_variable


def loads_nothing(optimizer):
    """Makes a Keras optimizer's `load_own_variables` a no-op: its owner loads (and converts) its variables.

    Keras loads the inner optimizer's entry of a weights file after the
    outer's; kmix's outer optimizer reads them, converted between opt levels.
    """
    optimizer.load_own_variables = lambda store: None


def keras_loss_scale_apply():
    """`keras.optimizers.LossScaleOptimizer.apply` as it is installed now."""
    import keras

    return keras.optimizers.LossScaleOptimizer.apply


def set_keras_loss_scale_apply(fn):
    """Installs `fn` as `keras.optimizers.LossScaleOptimizer.apply` (Keras's class and its subclasses).

    Keras 3.15's class decides a step is finite from the first local replica only: under
    MirroredStrategy another replica's inf reaches the weights. No argument or subclass hook fixes
    it for optimizers Keras wraps itself (`compile` under mixed_float16). Checked on Keras 3.12-3.15.
    """
    import keras

    keras.optimizers.LossScaleOptimizer.apply = fn


def adam_slots(optimizer, variable):
    """`(momentum, velocity)`: a Keras `Adam` / `AdamW`'s two slot variables for `variable`.

    kmix's fused Adam update (kmix/optimizers/fused_adam.py) hands them to
    TensorFlow's `ResourceApplyAdam`. Keras keeps them in the private lists
    `_momentums` / `_velocities`, indexed by its private `_get_variable_index`,
    which its own `update_step` uses; no public name maps a variable to its slots.
    """
    index = optimizer._get_variable_index(variable)
    return optimizer._momentums[index], optimizer._velocities[index]


def key_as(holder, optimizer, variable):
    """Makes Keras's optimizer file `holder` under `variable`'s key (its slots, its weight decay).

    `master_weights="kahan"` hands the inner optimizer's `update_step` a
    float32 view of a half variable (kmix/optimizers/kahan.py), so that Keras's
    own arithmetic runs in float32; the update looks its slots up with the
    private `_get_variable_index`, which reads the key through the private
    `_var_key`: for an object that is no variable, its `_unique_id`.
    """
    holder._unique_id = optimizer._var_key(variable)


def weight_decay_applies(optimizer, variable):
    """Whether a Keras optimizer decays `variable` (`weight_decay` set, not excluded by name or id).

    Keras decides this in the private `_use_weight_decay` (its
    `exclude_from_weight_decay` lists); `"kahan"` applies the decay of its
    half variables itself, in float32 with the update.
    """
    return optimizer.weight_decay is not None and bool(optimizer._use_weight_decay(variable))


def leave_weight_decay_of(optimizer, keys):
    """Makes a Keras optimizer's own weight decay skip the variables whose keys are in `keys`.

    Keras's TensorFlow optimizer writes the decoupled decay (AdamW, `weight_decay=`)
    straight into each variable, in its dtype, from the private
    `_apply_weight_decay`: for a bfloat16 variable `lr * wd * w` rounds away.
    `"kahan"` adds the decay of those variables to their float32 update
    instead; this instance's `_apply_weight_decay` passes Keras the others.
    """
    original = optimizer._apply_weight_decay

    def apply_weight_decay(variables):
        return original([v for v in variables if optimizer._var_key(v) not in keys])

    optimizer._apply_weight_decay = apply_weight_decay


def captured_handles(graph):
    """`(outside tensor, inside placeholder)` pairs of the resource tensors a traced function captured.

    A skipped step puts back what the step's forward pass wrote
    (kmix/optimizers/step_state.py): the variables are found by their
    handles among the function graph's captures, which only `FuncGraph`
    (not a public type) lists. Checked on TensorFlow 2.16-2.21.
    """
    return [(outside, inside) for outside, inside in graph.captures if inside.dtype == tf.resource]
