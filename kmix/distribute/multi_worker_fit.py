"""`model.fit`, `evaluate` and `predict` under `tf.distribute.MultiWorkerMirroredStrategy`.

Keras 3.15's TensorFlow trainer fails under that strategy (keras-team/keras#20585):

1. Before the first step, `_maybe_symbolic_build` reduces one whole distributed
   batch with `strategy.reduce("MEAN", (x, y), axis=None)` to learn its shapes.
   `MultiWorkerMirroredStrategy.reduce` does not map over nested structures:
   "Attempt to convert a value (PerReplica...) ... to a Tensor".
2. After each train or test step, `reduce_per_replica` reduces the scalar loss
   and metrics with `strategy.reduce("MEAN", v, axis=0)`: "Invalid reduction
   dimension 0 for input with 0 dimensions".

The replacements do what is needed and nothing more: the build takes each
value's local component (shapes only, no collective), and a step's results
are averaged over replicas elementwise (`axis=None`, one all-reduce each),
which is what Keras computes under `MirroredStrategy`. Everything else
(`predict`'s gather, other strategies, no strategy) goes to Keras's own code.
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
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v,
                batch,
            )
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

    Keras 3.15's TensorFlow trainer fails under that strategy before the first
    step (keras-team/keras#20585). This replaces the two trainer functions at
    fault, for every model, with versions that differ only under
    `tf.distribute.MultiWorkerMirroredStrategy`: the first batch's shapes are
    read from the local replica, and the loss and metrics of a step are
    averaged over all replicas, as under `MirroredStrategy`. It also makes
    Keras's own `keras.optimizers.LossScaleOptimizer` (and subclasses that
    keep its `apply`) skip a step when *any* replica overflowed: Keras decides
    on the first local replica's gradients, so under several workers one
    worker skipped while the other waited in the gradient all-reduce.
    kmix's own optimizer needs nothing. Under any strategy,
    `MirroredStrategy` included, it also lets `compile(steps_per_execution=n)`
    with n > 1 run (keras-team/keras#19246): Keras runs each step of an
    execution inside a `tf.cond`, where a collective all-reduce fails; kmix's
    loop runs the same steps without one. Call it once per worker process,
    before `fit`, in any order with creating the strategy; calling it again
    does nothing.

    Before replacing anything it runs Keras's two trainer functions on
    stand-ins (no cluster, no tensor); the multi-step loop is probed the same
    way the first time a model under a strategy asks for one (tracing needs
    TensorFlow's runtime). Where the installed Keras no longer has a bug,
    Keras's own function stays and a log line (logger `"kmix"`, WARNING)
    says so.

    Returns:
        True once kmix's replacements are installed (this call or an earlier one).

    Example:

    >>> import kmix, keras, tensorflow as tf
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
    """Puts Keras's own trainer functions (the multi-step loop too) and `LossScaleOptimizer.apply` back.

    Undoes `enable_multi_worker_fit`.

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
