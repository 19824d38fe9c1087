"""Whether the gradients an optimizer receives are those of a loss it scaled, or already unscaled.

Three routes reach `apply` / `apply_gradients` of a loss-scale optimizer:

- Keras's trainer, kmix's README and a `train_step` that scales its loss call
  `scale_loss(loss)` in the tape: the gradients are scaled, divide them.
- TensorFlow's mixed-precision guide calls `get_scaled_loss(loss)` and then
  `get_unscaled_gradients(grads)` (and may clip them): they are unscaled,
  divide them by nothing.
- A `train_step` written for float32 (keras.io's custom `fit`, GANs, VAEs)
  never scales its loss: nothing to divide either (and no loss scaling, which
  a warning says once).

kmix tells them apart when the step is traced, in Python, adding nothing to
the graph:

```
scale_loss(loss):            mark the step: its loss was scaled
get_unscaled_gradients(g):   record g (scaled) and what it returns (unscaled) for the step
apply(grads) / apply_gradients(grads), scaled=None:
    computed from what get_unscaled_gradients returned -> unscaled (use as given)
    else the step's loss was scaled                     -> scaled (divide by the scale)
    else                                                -> as given, and a warning once
    (eager, after get_unscaled_gradients, on tensors it cannot trace back: as given, and a warning once)
the step's marks are consumed
```

"Computed from" is a walk up the traced graph from each gradient to the
tensors `get_unscaled_gradients` returned, not past the scaled gradients it
was given (so `tf.clip_by_global_norm` of the unscaled gradients counts as
unscaled, and the scaled gradients themselves never do). Eagerly there is no
graph: only the returned tensors themselves are recognised.

"The step" is the outermost `tf.function` graph being traced (a fresh one on
every retrace, so marks never leak into another trace; `tf.cond` or
while-loop bodies inside it count as the same step), or eager execution.
The thread is part of the key because `tf.distribute.MirroredStrategy`
traces each replica's step in its own thread, interleaved. Each optimizer
has its own marks: a GAN's two optimizers are checked apart.
"""

import threading
import warnings
import weakref

import tensorflow as tf

SCALED, UNSCALED, UNMARKED, UNTRACEABLE = "scaled", "unscaled", "unmarked", "untraceable"

_EAGER = object()
_STEPS = weakref.WeakKeyDictionary()  # optimizer -> {(trace key, thread id): _Marks}
_TRACES = weakref.WeakValueDictionary()  # id(graph) -> graph, so that a dead graph's id is no key
_WARNED = weakref.WeakKeyDictionary()  # optimizer -> the kinds of warning it has given


class _Marks:
    """What one step has done so far: scaled its loss, and unscaled which tensors."""

    def __init__(self):
        self.scaled_loss = False
        self.loss = None  # a weak reference to the loss `scale_loss` received, in a traced step
        self.unscaled = {}  # id(tensor) -> weak reference: what get_unscaled_gradients returned
        self.scaled = {}  # id(tensor) -> weak reference: what it was given


def _trace_key():
    if not tf.inside_function():
        return _EAGER
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph  # up to the outermost function graph being traced
    key = id(graph)
    if _TRACES.get(key) is not graph:
        _TRACES[key] = graph
        for steps in _STEPS.values():  # an earlier graph with this id is gone: drop its marks
            for stale in [k for k in steps if k[0] == key]:
                del steps[stale]
    return key


def _marks(optimizer):
    key = (_trace_key(), threading.get_ident())
    return _STEPS.setdefault(optimizer, {}).setdefault(key, _Marks())


def mark_scaled(optimizer, loss=None):
    """Records that `optimizer.scale_loss` ran in this step, and (traced) on which loss."""
    marks = _marks(optimizer)
    marks.scaled_loss = True
    if tf.inside_function() and isinstance(loss, tf.Tensor) and not isinstance(loss, tf.Variable):
        marks.loss = weakref.ref(loss)


def step_loss(optimizer):
    """The loss this traced step scaled, or None (eagerly, or when it scaled none)."""
    marks = _STEPS.get(optimizer, {}).get((_trace_key(), threading.get_ident()))
    return None if marks is None or marks.loss is None else marks.loss()


def mark_unscaled(optimizer, scaled_grads, unscaled_grads):
    """Records the gradients `get_unscaled_gradients` received and the ones it returned, for this step."""
    marks = _marks(optimizer)
    for table, grads in ((marks.scaled, scaled_grads), (marks.unscaled, unscaled_grads)):
        for t in _tensors(grads):
            table[id(t)] = weakref.ref(t)


def consume(optimizer, grads):
    """What `grads` are, from this step's marks (which it clears).

    Returns:
        `UNSCALED` when every gradient is, or was computed from, what
        `get_unscaled_gradients` returned; `SCALED` when none is and the
        step's loss went through `scale_loss`; `UNMARKED` when none is and
        it did not; `UNTRACEABLE` when, eagerly, `get_unscaled_gradients`
        ran but the gradients are neither what it returned nor what it was given.

    Raises:
        ValueError: some gradients come from `get_unscaled_gradients` and others do not.
    """
    marks = _STEPS.get(optimizer, {}).pop((_trace_key(), threading.get_ident()), None)
    if marks is None:
        return UNMARKED
    tensors = _tensors(grads)
    if marks.unscaled and tensors:
        found = _computed_from(tensors, marks.unscaled, marks.scaled)
        if all(found):
            return UNSCALED
        if any(f is True for f in found):
            raise ValueError(
                "Some of the gradients received were computed from what get_unscaled_gradients() "
                "returned and others were not: part of them would be divided by the loss scale and "
                "part not. Pass all of them through get_unscaled_gradients() (then apply(..., "
                "scaled=False)), or none (the gradients of the scaled loss, then apply(...))."
            )
        if None in found:
            return UNTRACEABLE
    return SCALED if marks.scaled_loss else UNMARKED


def _tensors(grads):
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        if g is not None:
            out.append(g)
    return out


def _is(table, t):
    ref = table.get(id(t))
    return ref is not None and ref() is t


def _computed_from(tensors, unscaled, scaled):
    """Per tensor: True if it is, or is computed from, a tensor of `unscaled`; False if not; None if unknown.

    The walk goes up the graph through each op's inputs and stops at the
    tensors of `scaled` (which everything unscaled is computed from). Eager
    tensors have no graph: they are known only by identity.
    """
    found, dead = [], set()  # `dead`: ops from which no unscaled tensor is reached
    for tensor in tensors:
        if _is(unscaled, tensor):
            found.append(True)
            continue
        if _is(scaled, tensor):
            found.append(False)
            continue
        if not hasattr(tensor, "graph") or tf.executing_eagerly():
            found.append(None)
            continue
        seen, stack, hit = set(), [tensor], False
        while stack and not hit:
            t = stack.pop()
            if _is(unscaled, t):
                hit = True
            elif not _is(scaled, t) and id(t.op) not in seen and id(t.op) not in dead:
                seen.add(id(t.op))
                stack.extend(t.op.inputs)
        if not hit:
            dead |= seen
        found.append(hit)
    return found


def warn_once(optimizer, route, kind):
    """Warns once per optimizer and kind that `route` received gradients it takes as they are.

    Args:
        optimizer: the `kmix.LossScaleOptimizer`.
        route: `"apply_gradients"` or `"apply"`.
        kind: `UNMARKED` (no `scale_loss` in the step) or `UNTRACEABLE`.
    """
    warned = _WARNED.setdefault(optimizer, set())
    if kind in warned:
        return
    warned.add(kind)
    name = f"{type(optimizer).__name__} {optimizer.name!r}"
    if kind == UNTRACEABLE:
        message = (
            f"{name}: {route}() received gradients that get_unscaled_gradients() did not return, "
            "in a step where it ran, outside a tf.function, where kmix cannot tell what they were "
            "computed from. They are taken as unscaled and applied as they are. Pass `scaled=False` "
            "to say so (or `scaled=True` if they are gradients of the scaled loss), or run the step "
            "in a tf.function. See 'Custom training loops' in docs/guide.md."
        )
    else:
        message = (
            f"{name}: {route}() received gradients of a loss that did not go through this "
            "optimizer's scale_loss in the same step. They are applied as they are, not divided by "
            "the loss scale (non-finite steps are still skipped), so training runs without loss "
            "scaling: small float16 gradients flush to zero. Scale the loss inside the tape, "
            "`loss = self.optimizer.scale_loss(loss)` (in a custom train_step; `opt.scale_loss(loss)` "
            "in a custom loop), and take the gradients of that: kmix unscales them and skips "
            "overflowing steps. Gradients of a loss you scaled yourself: pass `scaled=True`. See "
            "'Custom training loops' in docs/guide.md."
        )
    warnings.warn(message, stacklevel=4)


def unscale(g, scale):
    """`g / scale`, in float32 for half gradients (IndexedSlices kept sparse); `scale=None`: no division."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(unscale(g.values, scale), g.indices, g.dense_shape)
    if g.dtype in (tf.float16, tf.bfloat16):
        g = tf.cast(g, tf.float32)
    return g if scale is None else g / tf.cast(scale, g.dtype)


def decide(optimizer, grads, variables, scaled, route):
    """Whether `apply` / `apply_gradients` (`route`) divides `grads` by the scale; consumes the step's marks.

    `scaled` True or False is the caller's word; None decides from the marks
    (see the module's docstring), with a warning once where the gradients
    are taken as they are without knowing it, unless the scale is a fixed 1
    (dividing by it or not is the same).
    """
    kind = consume(optimizer, grads)  # always: the step's marks end here
    if scaled is not None:
        if not isinstance(scaled, bool):
            raise TypeError(f"`scaled` must be True, False or None. Received: scaled={scaled!r}")
        return scaled
    if kind in (UNMARKED, UNTRACEABLE):
        if not optimizer.built and variables is not None:
            optimizer.build(variables)
        if optimizer.dynamic or optimizer.initial_scale != 1.0:
            warn_once(optimizer, route, kind)
    return kind == SCALED
