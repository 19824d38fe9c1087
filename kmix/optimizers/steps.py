"""One optimizer step, read from the traced step itself: scaled or not, what its forward pass wrote, float16 or not."""

import threading
import types
import warnings
import weakref

import tensorflow as tf

from kmix import _compat
from kmix.optimizers import allreduce

SCALED, UNSCALED, UNMARKED, UNTRACEABLE = "scaled", "unscaled", "unmarked", "untraceable"
_READS = {"ReadVariableOp", "VarIsInitializedOp", "VariableShape", "ResourceGather", "ResourceGatherNd"}
_EAGER = "eager"


class StepMarks:
    """What each step being traced (or run eagerly) did so far, per thread: scaled a loss, unscaled which tensors."""

    def __init__(self):
        self._steps = {}  # (id(graph) or _EAGER, thread id) -> what that step did
        self._graphs = weakref.WeakValueDictionary()  # id -> graph: a dead graph's id is no key
        self.warned = set()

    def _key(self):
        if not tf.inside_function():
            return _EAGER, threading.get_ident()
        graph = tf.compat.v1.get_default_graph()
        while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
            graph = graph.outer_graph
        if self._graphs.get(id(graph)) is not graph:
            self._graphs[id(graph)] = graph
            for stale in [k for k in self._steps if k[0] == id(graph)]:
                del self._steps[stale]
        return id(graph), threading.get_ident()

    def _marks(self):
        marks = types.SimpleNamespace(scaled_loss=False, loss=None, unscaled={}, scaled={})
        return self._steps.setdefault(self._key(), marks)

    def scaled(self, loss):
        """`scale_loss(loss)` ran in this step (and, traced, on this loss)."""
        marks = self._marks()
        marks.scaled_loss = True
        if tf.inside_function() and isinstance(loss, tf.Tensor) and not isinstance(loss, tf.Variable):
            marks.loss = weakref.ref(loss)

    def unscaled(self, scaled_grads, unscaled_grads):
        """`get_unscaled_gradients` received `scaled_grads` and returned `unscaled_grads` in this step."""
        marks = self._marks()
        for table, grads in ((marks.scaled, scaled_grads), (marks.unscaled, unscaled_grads)):
            table.update((id(t), weakref.ref(t)) for t in _tensors(grads))

    def loss(self):
        """The loss this traced step scaled, or None."""
        marks = self._steps.get(self._key())
        return None if marks is None or marks.loss is None else marks.loss()

    def consume(self, grads):
        """`SCALED`, `UNSCALED`, `UNMARKED` or `UNTRACEABLE` for `grads`; clears the step's marks."""
        marks = self._steps.pop(self._key(), None)
        if marks is None:
            return UNMARKED
        tensors = _tensors(grads)
        if marks.unscaled and tensors:
            found = [_computed_from(t, marks.unscaled, marks.scaled) for t in tensors]
            if all(found):
                return UNSCALED
            if any(f is True for f in found):
                raise ValueError(
                    "Some of the gradients received were computed from what get_unscaled_gradients() returned "
                    "and others were not: part of them would be divided by the loss scale and part not. Pass "
                    "all of them through get_unscaled_gradients() (then apply(..., scaled=False)), or none.")
            if None in found:
                return UNTRACEABLE
        return SCALED if marks.scaled_loss else UNMARKED


def _tensors(grads):
    return [allreduce.values_of(g) for g in grads if g is not None]


def _is(table, t):
    ref = table.get(id(t))
    return ref is not None and ref() is t


def _computed_from(tensor, unscaled, scaled):
    """True if `tensor` is, or is computed from, one of `unscaled` (not past `scaled`); None eagerly if unknown."""
    if not (_is(unscaled, tensor) or _is(scaled, tensor)) and (not hasattr(tensor, "graph") or tf.executing_eagerly()):
        return None
    seen, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if _is(unscaled, t):
            return True
        if not _is(scaled, t) and id(t.op) not in seen:
            seen.add(id(t.op))
            stack.extend(t.op.inputs)
    return False


def decide(optimizer, marks, grads, variables, scaled, route):
    """Whether `route` (`"apply"` / `"apply_gradients"`) divides `grads` by the scale; consumes the marks."""
    kind = marks.consume(grads)
    if scaled is not None:
        if not isinstance(scaled, bool):
            raise TypeError(f"`scaled` must be True, False or None. Received: scaled={scaled!r}")
        return scaled
    if kind in (UNMARKED, UNTRACEABLE):
        if not optimizer.built and variables is not None:
            optimizer.build(variables)
        if (optimizer.dynamic or optimizer.initial_scale != 1.0) and kind not in marks.warned:
            marks.warned.add(kind)
            warnings.warn(_unscaled_message(optimizer, route, kind), stacklevel=4)
    return kind == SCALED


def _unscaled_message(optimizer, route, kind):
    name = f"{type(optimizer).__name__} {optimizer.name!r}"
    if kind == UNTRACEABLE:
        return (f"{name}: {route}() received gradients that get_unscaled_gradients() did not return, in a step "
                "where it ran, outside a tf.function, where kmix cannot tell what they were computed from. They "
                "are taken as unscaled and applied as they are. Pass `scaled=False` to say so (or `scaled=True` "
                "if they are gradients of the scaled loss), or run the step in a tf.function. See 'Custom "
                "training loops' in docs/guide.md.")
    return (f"{name}: {route}() received gradients of a loss that did not go through this optimizer's scale_loss "
            "in the same step. They are applied as they are, not divided by the loss scale, so training runs without "
            "loss scaling: small float16 gradients flush to zero. Scale the loss inside the tape, `loss = "
            "self.optimizer.scale_loss(loss)`, and take the gradients of that; or pass `scaled=True`. See 'Custom "
            "training loops' in docs/guide.md.")


def unscale(g, scale):
    """`g / scale` in float32 for half gradients (IndexedSlices kept sparse); `scale=None`: no division."""
    if isinstance(g, tf.IndexedSlices):
        return allreduce.map_values(g, lambda x: unscale(x, scale))
    if g.dtype in (tf.float16, tf.bfloat16):
        g = tf.cast(g, tf.float32)
    return g if scale is None else g / tf.cast(scale, g.dtype)


def computes_in_float16(grads):
    """Whether the traced step computed `grads` through a float16 operation (False eagerly)."""
    ops = _ancestors([t.op for t in _tensors(grads) if hasattr(t, "op")])
    return any(t.dtype == tf.float16 for op in ops for t in op.outputs)


class Written:
    """What the traced step's forward pass wrote before `apply`, and each variable's value before its first write.

    Not: the trained variables, writes computed from the loss (metrics) or gradients (another optimizer) or
    sharing nothing with the loss, variables outside `only`. Eagerly: nothing.
    """

    def __init__(self, trained=(), loss=None, only=None, enabled=True):
        self.handles, self.before, self.unreadable = [], [], []
        if not enabled or not tf.inside_function():
            return
        graph = tf.compat.v1.get_default_graph()
        skip = {id(v.handle) for v in trained}
        allowed = None if only is None else {id(v.handle) for v in only}
        order = {op: i for i, op in enumerate(graph.get_operations())}
        loss_ancestors = _ancestors([loss.op]) if loss is not None else None
        for external, internal in _compat.captured_handles(graph):
            if id(external) in skip or (allowed is not None and id(external) not in allowed):
                continue
            users = sorted(internal.consumers(), key=lambda op: order.get(op, -1))
            writes = [op for op in users if op.type not in _READS]
            if not writes or not _forward_write(writes[0], loss, loss_ancestors):
                continue
            reads = [op for op in users if op.type == "ReadVariableOp" and order[op] < order[writes[0]]]
            if not reads:
                self.unreadable.append(internal.name)
                continue
            self.handles.append(internal)
            self.before.append(reads[0].outputs[0])
        if self.unreadable:
            warnings.warn(
                f"{len(self.unreadable)} variables are written by this step's forward pass where kmix cannot see "
                f"the value they held before (inside a nested function or a cond): {self.unreadable[:5]}. A "
                "skipped step leaves them as it wrote them.", stacklevel=4)

    def __len__(self):
        return len(self.handles)

    def restore(self, skipped, before=None):
        """Puts back each variable's value from before the step (or `before`) where `skipped`."""
        for handle, old in zip(self.handles, before or self.before):
            current = tf.raw_ops.ReadVariableOp(resource=handle, dtype=old.dtype)
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.where(skipped, old, current))


def _ancestors(ops):
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(t.op for t in op.inputs)
    return seen


def _forward_write(write, loss, loss_ancestors):
    values = _ancestors([t.op for t in write.inputs[1:]])
    if any(op.name.startswith("gradient_tape") or "/gradient_tape/" in op.name for op in values):
        return False
    return loss is None or (loss.op not in values and not values.isdisjoint(loss_ancestors))


class WindowStart:
    """Under accumulation: the written variables' values from the window's first micro-batch."""

    def __init__(self, written):
        with tf.init_scope(), tf.distribute.get_strategy().scope():
            self.values = [
                tf.Variable(tf.zeros(old.shape, old.dtype), trainable=False, name="kmix_window_start",
                            synchronization=tf.VariableSynchronization.ON_WRITE,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                for old in written.before]

    def take(self, written, first):
        """The window-start values: this step's where `first`, else the kept ones (which it updates)."""
        start = [tf.where(first, old, tf.convert_to_tensor(kept)) for old, kept in zip(written.before, self.values)]
        for kept, value in zip(self.values, start):
            kept.assign(value)
        return start


class Accumulation:
    """`kmix.LossScaleOptimizer`'s steps under `accumulation_steps > 1` (its own methods, kept here by topic)."""

    def _add_micro_batch(self, finite, nonfinite, unscaled, variables, scale, written):
        """Sums one micro-batch; on the k-th applies the mean, or skips the window if any overflowed."""
        received = [False] * len(self._weights.variables)
        for g, v in zip(unscaled, variables):
            if g is not None:
                i = self._weights.index[id(v)]
                received[i] = True
                g = tf.cast(tf.convert_to_tensor(g), tf.float32)
                self._accumulators[i].assign_add(tf.where(finite, g, tf.zeros_like(g)))
        self._accumulated = received
        window = tf.convert_to_tensor(self._window_nonfinite) + nonfinite
        count = tf.convert_to_tensor(self._micro_step) + 1
        start = []
        if len(written):
            key = tuple((tuple(old.shape), old.dtype.name) for old in written.before)
            if key not in self._window_starts:
                self._window_starts[key] = WindowStart(written)
            start = self._window_starts[key].take(written, tf.equal(count, 1))
        self._finish(count >= self.accumulation_steps, window, count, scale,
                     lambda skipped: written.restore(skipped, start))

    def _finish(self, end, window, count, scale, restore):
        divisor = tf.cast(tf.maximum(count, 1), tf.float32)
        if allreduce.reduces_here(self.allreduce_dtype, tf.distribute.get_replica_context()):
            run_if(end, self._reduce_and_apply, window, divisor, scale, restore)  # one half all-reduce
        else:
            clean = tf.equal(tf.reduce_sum(window), 0.0)
            means = [acc / divisor if on else None for acc, on in zip(self._accumulators, self._accumulated)]
            self._apply_if(tf.logical_and(end, clean), means, self._weights.variables)
            self._record_step(clean, window, scale, active=end)
            restore(tf.logical_and(end, tf.logical_not(clean)))
        for acc in self._accumulators:
            acc.assign(tf.where(end, tf.zeros_like(acc), acc))
        self._micro_step.assign(tf.where(end, tf.zeros_like(count), count))
        self._window_nonfinite.assign(tf.where(end, tf.zeros_like(window), window))

    def _reduce_and_apply(self, window, divisor, scale, restore):
        """The window's scaled means summed in `allreduce_dtype`; a replica that overflowed sends NaN."""
        means = [acc * (scale / divisor) if on else None for acc, on in zip(self._accumulators, self._accumulated)]
        sums = allreduce.all_reduce(means, self._weights.variables, self.allreduce_dtype,
                                    poison=[window[i] > 0 for i in range(len(means))])
        nonfinite = self._nonfinite(sums, self._weights.variables)
        finite = tf.equal(tf.reduce_sum(nonfinite), 0.0)
        self._apply_if(finite, [None if s is None else s / scale for s in sums], self._weights.variables)
        restore(tf.logical_not(finite))
        self._record_step(finite, nonfinite, scale)


def warn_eager_skip(optimizer, skipped):
    """Eagerly, a skipped step's forward writes cannot be found: says so (Python's filter: once per optimizer)."""
    if tf.inside_function() or not optimizer.restore_on_skip or not bool(skipped):
        return
    warnings.warn(
        f"{type(optimizer).__name__} {optimizer.name!r} skipped a step run eagerly: variables its forward pass "
        "wrote (batch-norm statistics, seed states) keep what the skipped step wrote. Trace the step "
        "(`tf.function`, or `compile` without `run_eagerly=True`) for kmix to put them back.", stacklevel=3)


def run_if(pred, fn, *args):
    """Calls `fn(*args)` on every replica where `pred` (the same on every replica) holds.

    A merge call (`MirroredStrategy` on CPUs) may not sit in a replica-context `tf.cond`: it is taken cross-replica.
    """
    if _compat.strategy_supports_no_merge_call():
        tf.cond(pred, lambda: _nothing(fn(*args)), lambda: None)
        return

    def cross_replica(distribution, pred, args):
        pred = distribution.experimental_local_results(pred)[0]
        tf.cond(pred, lambda: _nothing(distribution.extended.call_for_each_replica(fn, args=args)), lambda: None)

    # `fn` stays in the closure: as an argument, each replica's bound method would be regrouped.
    tf.distribute.get_replica_context().merge_call(cross_replica, args=(pred, args))


def _nothing(_):
    return None
