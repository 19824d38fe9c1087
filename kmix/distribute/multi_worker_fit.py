"""`model.fit`, `evaluate` and `predict` under `tf.distribute.MultiWorkerMirroredStrategy` (keras-team/keras#20585).

Keras 3.15's trainer reduces a whole distributed batch to learn its shapes before the first step, and
reduces each step's scalar logs with `axis=0`; both fail under that strategy. The replacements read the
shapes from the local replica and average a step's results over replicas elementwise (`axis=None`), as
Keras does under `MirroredStrategy`; everything else goes to Keras's own code.
"""

import logging

import tensorflow as tf

from kmix import _compat
from kmix.distribute import keras_loss_scale, multi_step

_log = logging.getLogger("kmix")
_state = {"enabled": False, "keras": None}


def _is_multi_worker(strategy):
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _make_symbolic_build(keras_symbolic_build):
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = _compat.model_distribute_strategy(self)
        if iterator is None or not _is_multi_worker(strategy):
            return keras_symbolic_build(self, iterator=iterator, data_batch=data_batch)
        # Every worker pulls one batch (the iterator's get_next is collective); only
        # the shapes matter, so this replica's own component is enough.
        for _, _, it in iterator:
            batch = next(it)
            local = lambda v: strategy.experimental_local_results(v)[0]  # noqa: E731
            data_batch = tf.nest.map_structure(
                lambda v: local(v) if isinstance(v, tf.distribute.DistributedValues) else v, batch)
            break
        return keras_symbolic_build(self, iterator=None, data_batch=data_batch)

    _maybe_symbolic_build.kmix_replaces = keras_symbolic_build
    return _maybe_symbolic_build


def _make_reduce_per_replica(keras_reduce_per_replica):
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _is_multi_worker(strategy):
            return keras_reduce_per_replica(values, strategy, reduction)

        def mean(v):
            if not isinstance(v, tf.distribute.DistributedValues):
                return v  # already one value for all replicas
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None)

        return tf.nest.map_structure(mean, values)

    reduce_per_replica.kmix_replaces = keras_reduce_per_replica
    return reduce_per_replica


def enable_multi_worker_fit():
    """Lets `model.fit`, `evaluate` and `predict` run under `MultiWorkerMirroredStrategy`.

    Replaces, for every model, the two Keras trainer functions that fail under that strategy
    (keras-team/keras#20585), the multi-step loop that fails under any strategy with
    `steps_per_execution > 1` (keras-team/keras#19246), and makes Keras's own `LossScaleOptimizer` skip a
    step when any replica overflowed. Each is first checked against the installed Keras: where the bug is
    gone, Keras's code stays and a WARNING (logger `"kmix"`) says so. Call it once per worker, before
    `fit`; calling it again does nothing.

    Returns:
        True once kmix's replacements are installed (this call or an earlier one).

    Example:

    >>> kmix.distribute.enable_multi_worker_fit()
    >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()   # TF_CONFIG names the workers
    >>> with strategy.scope():
    ...     model = build_model()
    ...     model.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss="mse")
    >>> model.fit(dataset, epochs=3)
    """
    if _state["keras"] is not None:
        return _state["enabled"]
    keras_build = _compat.keras_symbolic_build()
    keras_reduce = _compat.keras_reduce_per_replica()
    keras_make_function = _compat.keras_make_function()
    bugs = _compat.keras_multi_worker_bugs(keras_build, keras_reduce)
    _state["keras"] = (keras_build, keras_reduce, keras_make_function)
    if bugs["symbolic_build"]:
        _compat.set_keras_symbolic_build(_make_symbolic_build(keras_build))
    if bugs["reduce_per_replica"]:
        _compat.set_keras_reduce_per_replica(_make_reduce_per_replica(keras_reduce))
    # steps_per_execution > 1 under a strategy: whether Keras still has that bug can only be
    # probed with TensorFlow running, so the replacement probes on its first multi-step use.
    _compat.set_keras_make_function(multi_step.make_function_replacement(keras_make_function))
    # Keras's own LossScaleOptimizer decides on one replica's gradients: always wrapped
    # (a flag all-reduced over replicas is right whether or not Keras fixes that).
    keras_loss_scale.install()
    _state["enabled"] = True
    for part, bug in bugs.items():
        multi_step.log_if_keras_fixed(part, bug, "keras-team/keras#20585")
    return _state["enabled"]


def disable_multi_worker_fit():
    """Undoes `enable_multi_worker_fit`: Keras's own trainer functions and `LossScaleOptimizer.apply` back.

    Returns:
        True if something was put back, False if nothing was installed.

    Example:

    >>> kmix.distribute.enable_multi_worker_fit()
    >>> kmix.distribute.disable_multi_worker_fit()
    True
    """
    if _state["keras"] is None:
        return False
    keras_build, keras_reduce, keras_make_function = _state["keras"]
    _compat.set_keras_symbolic_build(keras_build)
    _compat.set_keras_reduce_per_replica(keras_reduce)
    _compat.set_keras_make_function(keras_make_function)
    keras_loss_scale.uninstall()
    restored = _state["enabled"]
    _state.update(enabled=False, keras=None)
    return restored


def multi_worker_fit_enabled():
    """Whether kmix's replacements for keras-team/keras#20585 are installed now.

    Returns:
        True between `enable_multi_worker_fit()` and `disable_multi_worker_fit()`.

    Example:

    >>> kmix.distribute.enable_multi_worker_fit()
    >>> kmix.distribute.multi_worker_fit_enabled()
    True
    """
    return _state["enabled"]
