"""A skipped step changes nothing: the model's non-trainable state is restored too.

The forward pass of a step writes non-trainable variables before the
optimizer decides whether the step is applied: batch-norm moving mean and
variance, dropout seed states, any variable a layer assigns in `call`. An
overflowing step can write inf into the statistics and break the model for
good, though its gradients are dropped. The optimizer keeps a shadow copy of
each such variable, in-graph and branch-free:

```
at build / track:        shadow = variable
after each decided step: variable = where(skipped, shadow, variable)
                         shadow   = variable          (the committed state)
```

so a skipped step leaves every variable as the last applied step left it.
Under gradient accumulation the decision is taken at the window's end: a
skipped window restores the state from before its first micro-batch.

The shadows are plain variables outside the optimizer's saved state (they
equal the model's values after every step). One caveat follows from keeping
them between steps: a write to the state between two steps (`set_weights`,
loading weights) is undone by a later skipped step unless `track` is called
again; see `LossScaleOptimizer.track`.
"""

import weakref

import keras
import tensorflow as tf


class StateGuard:
    """The shadows of a set of non-trainable variables, and the in-graph commit/restore.

    Args:
        variables: the variables to guard (non-trainable, floating or integer).
        strategy: the `tf.distribute` strategy to create the shadows under.
    """

    def __init__(self, variables, strategy=None):
        self.variables = []
        self.shadows = []
        seen = set()
        strategy = strategy or tf.distribute.get_strategy()
        with tf.init_scope(), strategy.scope():
            for v in variables:
                if id(v) in seen:
                    continue
                seen.add(id(v))
                self.variables.append(v)
                # The current value: built outside any traced step, so the state before it.
                self.shadows.append(
                    tf.Variable(tf.convert_to_tensor(v), trainable=False, name="kmix_state_shadow",
                                synchronization=tf.VariableSynchronization.ON_WRITE,
                                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                )

    def __len__(self):
        return len(self.variables)

    def settle(self, applied, skipped):
        """Restores the shadows where `skipped`, then commits the state where `applied`.

        Args:
            applied: a boolean scalar tensor, True when the step was applied.
            skipped: a boolean scalar tensor, True when the step was decided
                and skipped. Both False (a micro-batch inside an accumulation
                window) leaves everything as it is.
        """
        for v, shadow in zip(self.variables, self.shadows):
            current = tf.convert_to_tensor(v)
            saved = tf.convert_to_tensor(shadow)
            restored = tf.where(skipped, saved, current)
            v.assign(restored)
            shadow.assign(tf.where(applied, restored, saved))

    def sync(self):
        """Takes the variables' current values as the committed state (eagerly)."""
        with tf.init_scope():
            for v, shadow in zip(self.variables, self.shadows):
                shadow.assign(tf.convert_to_tensor(v))


def state_of(model_or_variables):
    """The non-trainable variables of a model or layer, or a given list of variables.

    Raises:
        TypeError: for anything else, naming what was received.
    """
    if isinstance(model_or_variables, keras.layers.Layer):
        return list(model_or_variables.non_trainable_variables)
    if isinstance(model_or_variables, (list, tuple)) and all(
        isinstance(v, (keras.Variable, tf.Variable)) for v in model_or_variables
    ):
        return list(model_or_variables)
    raise TypeError(
        "`track` takes a keras.Model (or layer), whose non-trainable variables are guarded, or a "
        f"list of variables. Received: {model_or_variables!r} (of type "
        f"{type(model_or_variables).__name__})."
    )


def strategy_of(model_or_variables):
    """The strategy a model was created under, else the current one."""
    if isinstance(model_or_variables, keras.Model):
        return model_or_variables.distribute_strategy
    return tf.distribute.get_strategy()


def guard(opt, model):
    """What `LossScaleOptimizer.track(model)` does: guards `model`'s state, or re-syncs a guard that has it."""
    variables = state_of(model)
    if not opt.restore_on_skip:
        return
    if isinstance(model, keras.Model):
        # A weak reference: saving walks the optimizer's attributes, and the model holds the optimizer.
        opt._tracked_model = weakref.ref(model)
    known = opt._state_guard.variables if opt._state_guard is not None else []
    if opt._state_guard is not None and {id(v) for v in variables} <= {id(v) for v in known}:
        opt._state_guard.sync()
        return
    opt._state_guard = StateGuard(known + variables, strategy_of(model))
