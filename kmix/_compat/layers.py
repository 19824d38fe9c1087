"""Keras's layer tree and functional graphs: the private names autocast, export and the tests read."""

import contextlib

import tensorflow as tf

from kmix._compat import keras_src


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

    `kmix.autocast` under a half-parameter policy (O2, O3) changes the dtype of the user's own variables
    in place, so that every reference to them (a layer's attribute, a user's handle, LoRA's) stays valid.
    Keras variables have no public way to change their dtype; on TensorFlow a Keras variable keeps its
    dtype in `_dtype` and its storage in a `tf.Variable` made by `_initialize`.
    """
    import keras

    old = variable._value
    value = tf.cast(old, dtype)
    variable._dtype = keras.backend.standardize_dtype(dtype)
    # The new storage is watched by gradient tapes as the old one was: Keras makes it from the
    # variable's `trainable` at that moment, and a layer frozen while it is placed would
    # otherwise get storage no tape watches, which unfreezing it later does not change.
    frozen = variable._trainable
    variable._trainable = getattr(old, "trainable", frozen)
    try:
        variable._initialize(value)
    finally:
        variable._trainable = frozen


@contextlib.contextmanager
def storage_swapped(pairs):
    """Each Keras variable of `pairs` reads the `tf.Variable` paired with it, in that one's dtype, for a while.

    `kmix.export` serves the user's model on half copies of its weights
    without a float32 copy in between: while swapped, a half layer reads its
    half kernel as it would under O2 (its autocast to the compute dtype a
    no-op), and a function traced then captures the half variables. The
    same objects throughout; their own storage (`_value`) and dtype
    (`_dtype`) are put back on exit. `keras.StatelessScope(state_mapping=)`,
    the public way to serve other values, converts each value to the
    variable's own dtype first (float32: a transient copy of every weight).
    """
    import keras

    saved = [(variable, variable._dtype, variable._value) for variable, _ in pairs]
    try:
        for variable, storage in pairs:
            variable._dtype = keras.backend.standardize_dtype(storage.dtype)
            variable._value = storage
        yield
    finally:
        for variable, dtype, value in saved:
            variable._dtype, variable._value = dtype, value


def built_input_shapes(layer):
    """The input shapes a subclassed model or layer was built with (`{"x_shape": (2, 4)}`), or None.

    Keras records them when a layer is built by its first call, for
    `get_build_config`, in the private `_build_shapes_dict`; a subclassed
    model has no public `inputs` to trace it on otherwise.
    """
    return getattr(layer, "_build_shapes_dict", None)


def is_functional(model):
    """Whether `model` is a functional model: `keras.Model(inputs, outputs)` or a subclass of one.

    keras-hub backbones and tasks subclass Keras's `Functional` class, which is not exported
    (`keras.Model(inputs, outputs)` returns one, but the class has no public name), and no public
    predicate tells a graph model from a subclassed one.
    """
    return isinstance(model, keras_src.functional_class())


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
# A functional graph's nodes, for autocast's settle stage (`kmix.placing.twin` reads them,
# `kmix.placing.write` writes them): a keras-hub backbone builds its graph
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
    node.arguments = type(node.arguments)(*args, **kwargs)  # no public setter; checked on Keras 3.15


# ------------------------------------------------------------------------------------------
# What `kmix.autocast` reaches: its plan reads which configs list their layers (`kmix.placing.rules`),
# its one writer (`kmix.placing.write`) changes a layer's class, policy map and tensors, a graph's settings.

def lists_layers(model):
    """Whether `model`'s config lists its layers' configs: a Sequential, or a functional model with Keras's constructor.

    Keras's `Functional.get_config` lists the layers only where the class takes `Functional`'s
    constructor arguments (its private `functional_like_constructor`); others (keras-hub backbones)
    save their constructor's arguments. No public predicate says which. Checked on Keras 3.15.
    """
    import inspect

    import keras

    if isinstance(model, keras.Sequential):
        return True
    if not is_functional(model):
        return False
    spec = inspect.getfullargspec(type(model).__init__)
    base = inspect.getfullargspec(keras_src.functional_class().__init__)
    return spec.args[1:] == base.args[1:] or (spec.varargs is not None and spec.varkw is not None)


def set_class(layer, cls):
    """Makes `layer` an instance of `cls` (a subclass adding no state): the same object, weights and config."""
    layer.__class__ = cls  # no public way to change a live layer's class; checked on Keras 3.15


def replace_dtype_policy(layer, policy):
    """Gives `layer` `policy` as its own, even where it holds a `DTypePolicyMap` (the setter writes into that map)."""
    # The public setter writes into a held map, which other layers share; checked on Keras 3.15.
    layer._dtype_policy = policy


def set_layer_tensor(layer, name, value):
    """Replaces a tensor `layer` holds as an attribute (public or private), as a build under another policy makes it."""
    setattr(layer, name, value)  # it may be private (`_inv_freq`): no public setter; checked on Keras 3.15


def set_operation_setting(operation, name, value):
    """Sets a plain setting of a `keras.ops` operation in a functional graph (a `Cast`'s `dtype`)."""
    setattr(operation, name, value)  # graph operations have no public setters; checked on Keras 3.15

