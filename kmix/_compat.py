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


def sublayers(layer):
    """The layers `layer` holds directly (attributes, lists, dicts), in tracking order.

    Keras tracks the sub-layers of every layer, but only a `keras.Model`
    exposes them publicly (`model.layers`), and only its own; a custom layer's
    sub-layers (the `Dense`s inside an attention block, a keras-hub decoder's
    attention) have no public accessor. Keras walks them with this private
    method itself (for `weights`, `summary` and saving).
    """
    return layer._flatten_layers(include_self=False, recursive=False)


def recast_variable(variable, dtype):
    """Gives a Keras variable new storage of `dtype`, holding its value cast: the same object.

    `kmix.autocast` under a half-parameter policy (O2, O3) changes the dtype
    of the user's own variables in place, so that every reference to them (a
    layer's attribute, a user's handle, LoRA's) stays valid. Keras variables
    have no public way to change their dtype; on TensorFlow a Keras variable
    keeps its dtype in `_dtype` and its storage in a `tf.Variable` made by
    `_initialize`.
    """
    import keras

    value = tf.cast(variable._value, dtype)
    variable._dtype = keras.backend.standardize_dtype(dtype)
    variable._initialize(value)


def built_input_shapes(layer):
    """The input shapes a subclassed model or layer was built with (`{"x_shape": (2, 4)}`), or None.

    Keras records them when a layer is built by its first call, for
    `get_build_config`, in the private `_build_shapes_dict`; a subclassed
    model has no public `inputs` to trace it on otherwise.
    """
    return getattr(layer, "_build_shapes_dict", None)


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


def is_functional(model):
    """Whether `model` is a functional model: `keras.Model(inputs, outputs)` or a subclass of one.

    keras-hub backbones and tasks subclass Keras's `Functional` class, which is
    not exported (`keras.Model(inputs, outputs)` returns one, but the class has
    no public name), and no public predicate tells a graph model from a
    subclassed one.
    """
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def producer(tensor):
    """`(operation, node_index)` that produced the symbolic `tensor`, or `(None, 0)`.

    Walking a functional graph back from its outputs (through `keras.ops`
    nodes such as `GetItem` or `Mean` to the layers behind them) needs each
    KerasTensor's history; Keras keeps it in the private `_keras_history`
    and has no public accessor for it.
    """
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None, 0
    return history.operation, history.node_index


def node_inputs(operation, node_index):
    """The symbolic input tensors of call number `node_index` of `operation`.

    `operation.input` (public) only gives the first call's inputs, which is
    wrong for shared layers and operations; the nodes are private.
    """
    return list(operation._inbound_nodes[node_index].input_tensors)
# ------------------------------------------------------------------------------------------
# `model.fit` under `MultiWorkerMirroredStrategy` (keras-team/keras#20585), used only by
# kmix/distribute/multi_worker_fit.py. Two functions of Keras's TensorFlow trainer fail
# under that strategy and are not reachable through any public name: the method
# `TensorFlowTrainer._maybe_symbolic_build` and the module function `reduce_per_replica`
# (looked up as a module global each time a step function is traced). kmix replaces
# them while the user opts in, and puts Keras's own functions back on `disable`.

def _keras_tf_trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


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
    result = {}
    try:
        symbolic_build(fake_model, iterator=[(0, 0, iter([(Batch(), Batch())]))])
        result["symbolic_build"] = False if not recorder.values else None
    except _ProbeDone:
        result["symbolic_build"] = any(isinstance(v, (tuple, list, dict)) for v in recorder.values)
    except Exception:  # noqa: BLE001 - any other failure means the code changed shape
        result["symbolic_build"] = None

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
    try:
        reduce_per_replica({"loss": Scalar()}, strategy, "auto")
        if not strategy.axes:
            result["reduce_per_replica"] = None
        else:
            result["reduce_per_replica"] = any(rank == 0 and axis == 0 for rank, axis in strategy.axes)
    except Exception:  # noqa: BLE001
        result["reduce_per_replica"] = None
    return result


def optimizer_variable_key(optimizer, variable):
    """The key a Keras optimizer files `variable` under (its slots are looked up by it).

    `master_weights="kahan"` must recognise the model variables among the
    writes of the inner optimizer's `update_step`; under `tf.distribute` those
    writes receive the strategy's per-replica variable, not the
    `keras.Variable`, and only Keras's private `_var_key` maps both to the same
    key. There is no public equivalent.
    """
    return optimizer._var_key(variable)


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
    try:
        make_function(model, lambda data: data)(iter(tf.data.Dataset.range(4)))
    except _ProbeDone:
        pass
    except Exception:  # noqa: BLE001 - any other failure means the code changed shape
        return None
    return any(seen) if seen else None


def onednn_enabled():
    """Whether TensorFlow runs its CPU kernels and CPU allocator through oneDNN in this process.

    `python -m kmix bench memory` reads the CPU allocator's statistics, which
    TensorFlow's default CPU allocator keeps only when oneDNN is on (by default
    only on CPUs with AVX-512 and the like); otherwise the benchmark switches to
    the BFC allocator before TensorFlow's runtime starts. TensorFlow decides
    this from the CPU and `TF_ENABLE_ONEDNN_OPTS` and exposes the answer only
    through this private module.
    """
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def xplane_proto():
    """The protobuf module of TensorFlow profiler traces (`*.xplane.pb`).

    `python -m kmix bench profile` reads the per-op times of a
    `tf.profiler.experimental` trace. TensorFlow ships the message type only
    under this internal path; the alternative, the tensorboard-plugin-profile
    package, would be a dependency for one parser.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2


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


def model_building(optimizer, depth=8):
    """The `keras.Model` whose trainer is building `optimizer` right now, or None.

    `model.fit` builds the optimizer from `model.trainable_variables` alone (in
    Keras's private `Trainer._symbolic_build`, or in the first traced
    `train_step`) and hands it nothing else, while a loss-scale optimizer that
    undoes a skipped step needs the model's non-trainable variables too. No
    public name links an optimizer to the model compiled with it, so this
    looks up the calling frames for a method of a `keras.Model` whose
    `optimizer` is `optimizer`. Custom loops pass the model explicitly
    (`LossScaleOptimizer.track(model)`).
    """
    import sys

    import keras

    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model) and getattr(owner, "optimizer", None) is optimizer:
            return owner
    return None


def adam_slots(optimizer, variable):
    """`(momentum, velocity)`: a Keras `Adam` / `AdamW`'s two slot variables for `variable`.

    kmix's fused Adam update (kmix/optimizers/fused_adam.py) hands them to
    TensorFlow's `ResourceApplyAdam`. Keras keeps them in the private lists
    `_momentums` / `_velocities`, indexed by its private `_get_variable_index`,
    which its own `update_step` uses; no public name maps a variable to its slots.
    """
    index = optimizer._get_variable_index(variable)
    return optimizer._momentums[index], optimizer._velocities[index]


# ------------------------------------------------------------------------------------------
# A functional graph's nodes, for `kmix.placing.settle`: a keras-hub backbone builds its graph
# in its constructor, and the `keras.ops` nodes there record what they saw (a constant cast to
# the embedding's dtype, a `Cast` to `x.dtype`). `load_model` re-runs the constructor under the
# placed policies; making the model in memory compute the same means reading and replacing
# those nodes' operations and constant arguments, which Keras keeps in private attributes
# (`Functional._nodes_by_depth`, `Node.arguments`) with no public accessor.

def graph_nodes(model):
    """The nodes of functional `model`'s graph, deepest first, in Keras's own order within a depth."""
    by_depth = model._nodes_by_depth
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]]


def node_call(node):
    """`(operation, args, kwargs)` of one node: what the graph calls, symbolic tensors included."""
    return node.operation, node.arguments.args, node.arguments.kwargs


def set_node_arguments(node, args, kwargs):
    """Gives `node` new call arguments (the same symbolic tensors, other constants)."""
    node.arguments = type(node.arguments)(*args, **kwargs)
