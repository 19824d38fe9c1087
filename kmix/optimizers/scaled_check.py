"""Whether the gradients an optimizer receives come from a loss it scaled.

Keras's trainer calls `optimizer.scale_loss(loss)` before it takes the
gradients; a custom `train_step` written for float32 (keras.io's GANs, VAEs,
WGAN-GP) calls `self.optimizer.apply_gradients(zip(grads, vars))` on the
gradients of the plain loss. A loss-scale optimizer that divides those by the
scale shrinks every update by 2^15, silently. kmix knows which case it is in
when the step is traced:

```
scale_loss(loss):          mark (optimizer, this trace, this thread)
apply_gradients(g, v):     scaled = consume the mark
                           if not scaled: warn once; apply g as unscaled (divide by 1)
apply(g, v):               the same consume; `scaled=True` unless told otherwise,
                           with a warning once when no mark was there
```

"This trace" is the outermost `tf.function` graph being traced (a fresh one
on every retrace, so marks never leak into another trace; `tf.cond` or
while-loop bodies inside it count as the same step), or eager execution.
The thread is part of the key because `tf.distribute.MirroredStrategy`
traces each replica's step in its own thread, interleaved. Each optimizer has
its own marks: a GAN's two optimizers are checked apart. Everything happens
in Python at trace time: nothing is added to the graph.
"""

import threading
import warnings
import weakref

import tensorflow as tf

_EAGER = object()
_MARKS = weakref.WeakKeyDictionary()  # optimizer -> {(trace key, thread id)}; trace keys weak below
_TRACES = weakref.WeakValueDictionary()  # id(graph) -> graph, so that a dead graph's id is no key
_WARNED = weakref.WeakSet()  # optimizers that have warned


def _trace_key():
    if not tf.inside_function():
        return _EAGER
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph  # up to the outermost function graph being traced
    key = id(graph)
    if _TRACES.get(key) is not graph:
        _TRACES[key] = graph
        for marks in _MARKS.values():  # an earlier graph with this id is gone: drop its marks
            marks.difference_update({m for m in marks if m[0] == key})
    return key


def mark_scaled(optimizer):
    """Records that `optimizer.scale_loss` ran in this trace (or eagerly) on this thread."""
    _MARKS.setdefault(optimizer, set()).add((_trace_key(), threading.get_ident()))


def consume_mark(optimizer):
    """Whether `mark_scaled(optimizer)` ran since the last `consume_mark` here; clears it."""
    marks = _MARKS.get(optimizer)
    if not marks:
        return False
    key = (_trace_key(), threading.get_ident())
    if key in marks:
        marks.discard(key)
        return True
    return False


def warn_unscaled_once(optimizer, route):
    """Warns once per optimizer that a step's loss did not go through its `scale_loss`.

    Args:
        optimizer: the `kmix.LossScaleOptimizer`.
        route: `"apply_gradients"` (the gradients are applied as unscaled) or
            `"apply"` (they are divided by the scale, as `apply` documents).
    """
    if optimizer in _WARNED:
        return
    _WARNED.add(optimizer)
    name = f"{type(optimizer).__name__} {optimizer.name!r}"
    if route == "apply_gradients":
        what = (
            "They are applied as they are, not divided by the loss scale (non-finite steps are "
            "still skipped), so training runs without loss scaling: small float16 gradients "
            "flush to zero."
        )
    else:
        what = (
            "apply() takes them as gradients of the scaled loss and divides them by the loss "
            "scale; if they are not (no scale_loss, or get_unscaled_gradients was called), pass "
            "`scaled=False`, or `scaled=True` to say they are and silence this warning."
        )
    warnings.warn(
        f"{name}: {route}() received gradients of a loss that did not go through this "
        f"optimizer's scale_loss in the same step. {what} Scale the loss inside the tape, "
        "`loss = self.optimizer.scale_loss(loss)` (in a custom train_step; `opt.scale_loss(loss)` "
        "in a custom loop), and take the gradients of that: kmix unscales them and skips "
        "overflowing steps. See 'Custom train_step' in docs/guide.md.",
        stacklevel=3,
    )
