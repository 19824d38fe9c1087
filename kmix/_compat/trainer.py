"""Keras's TensorFlow trainer: the private functions kmix replaces for multi-worker fit and multi-step runs."""

import tensorflow as tf

from kmix._compat import keras_src


# ------------------------------------------------------------------------------------------
# `model.fit` under `MultiWorkerMirroredStrategy` (keras-team/keras#20585), used only by
# kmix/distribute/multi_worker_fit.py. Two functions of Keras's TensorFlow trainer fail
# under that strategy and are not reachable through any public name: the method
# `TensorFlowTrainer._maybe_symbolic_build` and the module function `reduce_per_replica`
# (looked up as a module global each time a step function is traced). kmix replaces
# them while the user opts in, and puts Keras's own functions back on `disable`.

def _keras_tf_trainer():
    return keras_src.tensorflow_trainer()


def keras_symbolic_build():
    """Keras's `TensorFlowTrainer._maybe_symbolic_build` as it is installed now."""
    return _keras_tf_trainer().TensorFlowTrainer._maybe_symbolic_build


def set_keras_symbolic_build(fn):
    """Installs `fn` as `TensorFlowTrainer._maybe_symbolic_build` (every Keras model)."""
    _keras_tf_trainer().TensorFlowTrainer._maybe_symbolic_build = fn


def keras_reduce_per_replica():
    """Keras's `reduce_per_replica(values, strategy, reduction)` as it is installed now."""
    return _keras_tf_trainer().reduce_per_replica


def set_keras_reduce_per_replica(fn):
    """Installs `fn` as the trainer module's `reduce_per_replica` (read at trace time)."""
    _keras_tf_trainer().reduce_per_replica = fn


def model_distribute_strategy(model):
    """The strategy a Keras model was created under, or None (Keras's `_distribute_strategy`).

    Keras's `_maybe_symbolic_build` acts only when this is set; the public
    `model.distribute_strategy` falls back to the current strategy, so it
    cannot tell a model created outside any scope from one created inside.
    """
    return getattr(model, "_distribute_strategy", None)


class _ProbeDone(Exception):
    pass


def keras_multi_worker_bugs(symbolic_build, reduce_per_replica):
    """Runs Keras's two functions on stand-ins and reports whether each still has its bug.

    No cluster and no tensor are needed (so this may run before a
    `MultiWorkerMirroredStrategy` is created, which must happen before
    TensorFlow's runtime starts): a stand-in strategy records what Keras asks of it.
    `symbolic_build` has the bug when it passes a whole nested batch to
    `strategy.reduce` (MultiWorkerMirroredStrategy's reduce does not map over
    structures); `reduce_per_replica` has it when it reduces a scalar with
    `axis=0` under a multi-worker strategy. The stand-in for the multi-worker
    strategy answers Keras's private `extended._in_multi_worker_mode()`.

    Returns:
        `{"symbolic_build": b, "reduce_per_replica": b}` with `b` True (bug
        present), False (fixed) or None (Keras's code changed so that the probe
        cannot tell).
    """
    import types

    class Batch(tf.distribute.DistributedValues):
        pass

    class Recorder:
        def __init__(self):
            self.values = []

        def reduce(self, reduce_op, value, axis=None):
            self.values.append(value)
            raise _ProbeDone

        def scope(self):
            import contextlib

            return contextlib.nullcontext()

        def experimental_local_results(self, value):
            raise _ProbeDone

    recorder = Recorder()
    fake_model = types.SimpleNamespace(
        _distribute_strategy=recorder,
        distribute_strategy=recorder,
        _symbolic_build=lambda data_batch=None: None,
    )
    def symbolic():
        try:
            symbolic_build(fake_model, iterator=[(0, 0, iter([(Batch(), Batch())]))])
            return False if not recorder.values else None
        except _ProbeDone:
            return any(isinstance(v, (tuple, list, dict)) for v in recorder.values)

    result = {"symbolic_build": _probe(symbolic)}

    class MultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
        extended = types.SimpleNamespace(_in_multi_worker_mode=lambda: True)

        def __init__(self):  # no cluster: only `reduce` is called
            self.axes = []

        def reduce(self, reduce_op, value, axis=None):
            self.axes.append((value.shape.rank, axis))
            return value

    class Scalar:  # stands for a scalar loss; no tensor, so TensorFlow's runtime stays
        shape = tf.TensorShape([])  # unstarted (MultiWorkerMirroredStrategy needs that)

    strategy = MultiWorker()

    def reduce():
        reduce_per_replica({"loss": Scalar()}, strategy, "auto")
        return any(rank == 0 and axis == 0 for rank, axis in strategy.axes) if strategy.axes else None

    result["reduce_per_replica"] = _probe(reduce)
    return result


def _probe(run):
    """`run()`, or None (unknown) where Keras's private code no longer has the shape a probe expects."""
    try:
        return run()
    except Exception:  # noqa: BLE001  any error from Keras's changed code: the probe cannot tell
        return None


# ------------------------------------------------------------------------------------------
# `steps_per_execution > 1` under any `tf.distribute` strategy (keras-team/keras#19246), used
# only by kmix/distribute/multi_step.py. Keras's `TensorFlowTrainer._make_function` runs
# each step of a multi-step execution inside a `tf.cond` (to stop at the end of the data);
# a collective all-reduce there fails ("You must feed a value for placeholder tensor
# '.../while/cond/Placeholder'"). The method, the optional-to-None wrapper it applies to
# steps, and the spec an empty `tf.experimental.Optional` is created with are private.

def keras_make_function():
    """Keras's `TensorFlowTrainer._make_function` as it is installed now."""
    return _keras_tf_trainer().TensorFlowTrainer._make_function


def set_keras_make_function(fn):
    """Installs `fn` as `TensorFlowTrainer._make_function` (every Keras model)."""
    _keras_tf_trainer().TensorFlowTrainer._make_function = fn


def autoconvert_optionals(model, step):
    """Keras's wrapper that turns `tf.experimental.Optional` leaves of a batch into None."""
    return model._autoconvert_optionals(step)


def set_optional_spec(optional, element_spec):
    """Gives an `Optional.empty(None)` the spec it will hold, as Keras's own loop does.

    A `tf.while_loop` over an optional of the step's outputs needs the initial
    (empty) optional to carry the outputs' spec, which is known only once the
    loop body has been traced; `tf.experimental.Optional` has no public setter.
    """
    optional._element_spec = element_spec


def _in_cond_branch():
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        # The class of a `tf.cond` branch's graph (control-flow v2); no public predicate.
        if type(graph).__name__ == "CondBranchFuncGraph":
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def keras_steps_in_cond(make_function):
    """Whether `make_function` (Keras's `_make_function`) traces a multi-step step inside a `tf.cond`.

    Traces the function for `steps_per_execution=2` on a stand-in model whose
    strategy records where its `run` is called and stops the trace there, so
    nothing executes. It needs TensorFlow's runtime (a small dataset), so it
    runs only once a strategy exists.

    Returns:
        True (the bug of keras-team/keras#19246), False (the step runs outside
        any `tf.cond`) or None (Keras's code changed so that the probe cannot tell).
    """
    import types

    seen = []

    class Strategy:
        def run(self, fn, args=(), kwargs=None):
            seen.append(_in_cond_branch())
            raise _ProbeDone

    model = types.SimpleNamespace(
        distribute_strategy=Strategy(),
        steps_per_execution=2,
        unrolled_steps_per_execution=1,
        run_eagerly=False,
        jit_compile=False,
        _autoconvert_optionals=lambda fn: fn,
    )
    def run():
        try:
            make_function(model, lambda data: data)(iter(tf.data.Dataset.range(4)))
        except _ProbeDone:
            pass
        return any(seen) if seen else None

    return _probe(run)
