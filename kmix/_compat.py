"""The one place kmix touches TensorFlow or Keras names that are not public.

Each use says why no public name does the job. Nothing else in kmix may import
`keras.src` or `tf.__internal__`.
"""

import tensorflow as tf


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
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(fn)


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
