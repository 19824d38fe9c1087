"""What a layer computes inside: constants beyond the half range, and whether they reach a softmax.

A layer whose inputs are finite and output is not, in half precision, is
traced again (never run) and its graph read for a constant that is inf in
the half dtype (a Python `-1e9` mask) or a float32 one beyond its range cast
to it, and whether a path from it reaches a `Softmax`.
"""

import numpy as np
import tensorflow as tf

TRACE_LIMIT = 32  # layers whose half-precision graph is inspected


def trace_nonfinite(calls, first_args, half, limit):
    """`{node: (values, feeds_softmax)}`: the constants beyond `limit` inside the layers that turn non-finite in `half`.

    `calls` are the half run's `[(node, inputs_finite, outputs_finite)]` per
    batch, `first_args` each node's first non-finite call; innermost layers only.
    """
    found = {}
    order = [node for batch in calls for node, _, ok in batch if not ok]
    for node in list(dict.fromkeys(order))[:TRACE_LIMIT]:
        if any(inner is not node and node in set(inner.ancestors()) for inner in found):
            continue
        args, kwargs = first_args[node]
        try:
            fn = tf.function(lambda a, k, layer=node.layer: layer(*a, **k), autograph=False)
            graph = fn.get_concrete_function(args, kwargs).graph
        except (TypeError, ValueError, AttributeError, NotImplementedError, tf.errors.OpError):
            continue  # a layer that cannot be traced (Python on tensors, numpy calls) is not inspected
        values, softmax = big_constants(graph, half, limit)
        if values:
            found[node] = (values, softmax)
    return found


def big_constants(graph, half, limit):
    """The constants beyond the half range in `graph`, and whether any reaches a softmax."""
    half = tf.as_dtype(half)
    sources, values = [], []
    for op in graph.get_operations():
        if op.type == "Const" and op.get_attr("dtype") == half:
            value = tf.make_ndarray(op.get_attr("value")).astype(np.float32)
            if not np.isfinite(value).all():
                sources.append(op)
                values.append(float(value[~np.isfinite(value)].flat[0]))
        elif op.type == "Cast" and op.outputs[0].dtype == half and op.inputs[0].op.type == "Const":
            value = tf.make_ndarray(op.inputs[0].op.get_attr("value")).astype(np.float64)
            if (np.abs(value) > limit).any():
                sources.append(op)
                values.append(float(value[np.abs(value) > limit].flat[0]))
    seen, frontier = set(), list(sources)
    while frontier:
        op = frontier.pop()
        if op.type in ("Softmax", "LogSoftmax"):
            return values, True
        for out in op.outputs:
            for consumer in out.consumers():
                if consumer.name not in seen:
                    seen.add(consumer.name)
                    frontier.append(consumer)
    return values, False
