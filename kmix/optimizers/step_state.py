"""A skipped step changes nothing: what the step's forward pass wrote is put back.

The forward pass runs before the optimizer decides whether the step is
applied, and it writes variables: batch-norm moving statistics, dropout
seed states, any variable a layer assigns in `call`. An overflowing step
can write inf into the statistics and break the model for good, though its
gradients are dropped. `apply` finds those writes in the step it is traced
in (the graph holds the forward pass's ops) and, for each variable, the
value the step read before its first write: the state the step started
from. On a skipped step each is put back, in-graph and branch-free:

```
written = the variables the traced step wrote before `apply`, except
          the ones this optimizer trains,
          writes computed from the loss (metrics: Keras's loss tracker),
          writes computed from gradients (another optimizer's update),
          writes that share nothing with the loss (another optimizer's counter),
          and, after `track(model)`, variables that are not `model`'s
variable = where(skipped, value read before the first write, variable)
```

Nothing is copied between steps, so nothing goes stale: values loaded
between steps (`load_weights`, a checkpoint, BackupAndRestore, `set_weights`)
are what a later skipped step goes back to, and a frozen base model (LoRA),
which no forward pass writes, costs nothing. Under gradient accumulation the
decision is taken at the window's end: the value read in the window's first
micro-batch is kept in a variable (one per written variable) and a skipped
window goes back to it. An eager step (`run_eagerly=True`) has no graph to
read: a skipped eager step restores nothing, and says so once.
"""

import warnings

import tensorflow as tf

from kmix import _compat

# Ops that take a variable's handle without writing it.
_READS = {"ReadVariableOp", "VarIsInitializedOp", "VariableShape", "ResourceGather", "ResourceGatherNd"}


class Written:
    """The variables a traced step wrote before the optimizer's `apply`, and what they held before.

    Args:
        trained: the variables the optimizer trains (never restored here).
        loss: the loss the step scaled (a graph tensor), or None.
        only: None, or the variables `track(model)` named: nothing else is restored.
    """

    def __init__(self, trained, loss=None, only=None):
        self._empty()  # `unreadable`: written where no earlier read shows their value (a nested function)
        if not tf.inside_function():
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
            if not writes:
                continue
            first = writes[0]
            if not _forward_write(first, loss, loss_ancestors):
                continue
            reads = [op for op in users if op.type == "ReadVariableOp" and order[op] < order[first]]
            if not reads:
                self.unreadable.append(internal.name)
                continue
            self.handles.append(internal)
            self.before.append(reads[0].outputs[0])
        if self.unreadable:  # once per trace: said, never silently left as the skipped step wrote them
            warnings.warn(
                f"{len(self.unreadable)} variables are written by this step's forward pass where kmix cannot see "
                f"the value they held before (inside a nested function or a cond): {self.unreadable[:5]}. A "
                "skipped step leaves them as it wrote them.", stacklevel=4)

    @classmethod
    def nothing(cls):
        """An empty set of writes (`restore_on_skip=False`)."""
        return cls.__new__(cls)._empty()

    def _empty(self):
        self.handles, self.before, self.unreadable = [], [], []
        return self

    def __len__(self):
        return len(self.handles)

    def restore(self, skipped, before=None):
        """Puts back each variable's value from before the step (or `before`) where `skipped`."""
        for handle, old in zip(self.handles, before or self.before):
            current = tf.raw_ops.ReadVariableOp(resource=handle, dtype=old.dtype)
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.where(skipped, old, current))


def _ancestors(ops):
    """Every op the given ops are computed from (data inputs, not control edges)."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return seen


def _forward_write(write, loss, loss_ancestors):
    """Whether `write` is the forward pass's: not computed from the loss or a gradient, sharing ops with the loss."""
    values = _ancestors([t.op for t in write.inputs[1:]])
    if any(op.name.startswith("gradient_tape") or "/gradient_tape/" in op.name for op in values):
        return False
    if loss is None:
        return True
    return loss.op not in values and not values.isdisjoint(loss_ancestors)


class WindowStart:
    """Under accumulation: the written variables' values from the window's first micro-batch.

    Created inside the traced step (the variables exist from its first trace),
    one float or integer variable per written variable, owned by the optimizer.
    """

    def __init__(self, written):
        strategy = tf.distribute.get_strategy()
        with tf.init_scope(), strategy.scope():
            self.values = [
                tf.Variable(tf.zeros(old.shape, old.dtype), trainable=False, name="kmix_window_start",
                            synchronization=tf.VariableSynchronization.ON_WRITE,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                for old in written.before
            ]

    def take(self, written, first):
        """The window-start values: this step's where `first`, else the kept ones (which it updates)."""
        start = [tf.where(first, old, tf.convert_to_tensor(kept)) for old, kept in zip(written.before, self.values)]
        for kept, value in zip(self.values, start):
            kept.assign(value)
        return start


def variables_of(model_or_variables):
    """The variables of a model or layer, or a given list of variables.

    Raises:
        TypeError: for anything else, naming what was received.
    """
    import keras

    if isinstance(model_or_variables, keras.layers.Layer):
        return list(model_or_variables.variables)
    if isinstance(model_or_variables, (list, tuple)) and all(
        isinstance(v, (keras.Variable, tf.Variable)) for v in model_or_variables
    ):
        return list(model_or_variables)
    raise TypeError(
        "`track` takes a keras.Model (or layer) or a list of variables. Received: "
        f"{model_or_variables!r} (of type {type(model_or_variables).__name__})."
    )


def warn_eager_skip(optimizer, skipped):
    """Eagerly, a skipped step's forward writes cannot be found: says so once."""
    if tf.inside_function() or not optimizer.restore_on_skip or not bool(skipped):
        return
    warnings.warn(  # Python's default filter shows it once per optimizer name: no flag set on the optimizer
        f"{type(optimizer).__name__} {optimizer.name!r} skipped a step run eagerly: variables its forward "
        "pass wrote (batch-norm statistics, seed states) keep what the skipped step wrote. Trace the step "
        "(`tf.function`, or `compile` without `run_eagerly=True`) for kmix to put them back.",
        stacklevel=3,
    )
