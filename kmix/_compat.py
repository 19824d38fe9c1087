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
