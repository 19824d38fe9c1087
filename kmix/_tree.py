"""The layer tree of a Keras model, walked the one way every part of kmix reads it.

`walk` visits each layer inside a model once, nested models, layers a custom layer or a keras-hub block creates in
`build` included; `own_weights` are a layer's variables that none of its sublayers hold; `resolved_policy` is the policy
a layer computes under (a `DTypePolicyMap` looked up by its path); `digest` fingerprints a variable's value, to tell
later whether it moved.
"""

import re
import zlib

import keras
import numpy as np

from kmix import _compat


def walk(root):
    """`(path, layer, parent)` for every layer inside `root`, depth first, each layer once.

    `path` joins the names from `root` down (`"encoder/attention/query"`).
    Layers that a custom layer or a keras-hub block creates in `build` are
    found too. Input layers are left out.
    """
    seen = {id(root)}

    def visit(layer, prefix):
        for child in _children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{child.name}"
            if not isinstance(child, keras.layers.InputLayer):
                yield path, child, layer
            yield from visit(child, path + "/")

    yield from visit(root, "")


def own_weights(layer):
    """The variables `layer` holds itself, not through the layers inside it."""
    inherited = {id(w) for child in _children(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in inherited]


def digest(variable):
    """A fingerprint of `variable`'s value (dtype, shape, two checksums of its bytes): equal while it is unchanged.

    Two 32-bit checksums (CRC-32 and Adler-32, several GB/s) rather than a
    cryptographic hash: it tells a value that moved from one that did not,
    one variable's bytes at a time, at the size of a large model's weights.
    """
    value = np.ascontiguousarray(variable.numpy() if hasattr(variable, "numpy") else variable)
    data = value.reshape(-1).view(np.uint8)
    return value.dtype.str, value.shape, zlib.crc32(data), zlib.adler32(data)


def _children(layer):
    """The layers directly inside `layer`: a graph model's layers, else those it tracks."""
    if is_graph_model(layer):
        return list(layer.layers)  # not the hidden functional model a Sequential keeps
    return _compat.sublayers(layer)


def resolved_policy(layer):
    """The `keras.DTypePolicy` `layer` computes under (a `DTypePolicyMap` looked up by path)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def is_graph_model(model):
    """A Sequential or functional model (a keras-hub backbone included): its graph is known."""
    return isinstance(model, keras.Sequential) or _compat.is_functional(model)


def is_auto_named(layer):
    """Whether Keras named `layer` by its counter (made without `name=`): `t5_layer_norm_4`."""
    if layer is None:
        return False
    return re.fullmatch(re.escape(snake_case(type(layer).__name__)) + r"(_\d+)?", layer.name) is not None


def snake_case(class_name):
    """The name Keras gives an unnamed layer of `class_name` before its counter (`T5LayerNorm` -> `t5_layer_norm`)."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def pair(root, twin, by_path=False):
    """`[(path, layer, parent, its twin or None)]` for `root` and each layer inside it, `root` first.

    A twin is a model built from `root`'s config: its layers pair with `root`'s by position in `walk` when both have
    as many; where they do not, by path relative to each root with `by_path` (the roots pair), else none pairs.
    `root`'s row has its name as path.
    """
    ours = [(root.name, root, None)] + list(walk(root))
    theirs = [(twin.name, twin, None)] + list(walk(twin)) if twin is not None else []
    if len(ours) == len(theirs):
        return [(path, layer, parent, other[1]) for (path, layer, parent), other in zip(ours, theirs)]
    if not by_path:
        return [(path, layer, parent, None) for path, layer, parent in ours]
    found = {_relative(layer, path, twin): layer for path, layer, _ in theirs[1:]}
    return [ours[0] + (twin,)] + [(path, layer, parent, found.get(_relative(layer, path, root)))
                                  for path, layer, parent in ours[1:]]


def _relative(layer, path, root):
    """`layer`'s path below `root`: Keras's without the root's name, else `walk`'s `path` (relative already)."""
    prefix = f"{root.name}/"
    return layer.path[len(prefix):] if layer.path and layer.path.startswith(prefix) else (layer.path or path)
