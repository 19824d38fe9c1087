"""How steps reach a `kmix.LossScaleOptimizer`, and what a skipped step must leave alone.

A mixin of `kmix.LossScaleOptimizer`:

- `scale_loss` (and tf.keras's `get_scaled_loss` / `get_unscaled_gradients`):
  the loss times the scale, and a mark that this step's loss was scaled;
- `apply_gradients`: Keras's trainer and keras.io's custom `train_step`s call
  it. Whether the gradients come from a loss this optimizer scaled is known
  at trace time (`kmix.optimizers.scaled_check`): if not, they are applied as
  they are (divided by 1, non-finite steps still skipped) and a warning
  says, once, to call `self.optimizer.scale_loss(loss)`.
- `track(model)`: the model's non-trainable variables (batch-norm statistics,
  seed states) are restored by a skipped step (`kmix.optimizers.nontrainable`);
  `fit` tracks its model by itself.
- `master_weights`: once built, what really keeps the updates' low bits.
"""

import weakref

import keras
import tensorflow as tf

from kmix.optimizers import master_weights as mw
from kmix.optimizers import nontrainable, scaled_check


class StepRoutes:
    """`scale_loss`, `apply_gradients`, `track` and the truthful `master_weights` of a loss-scale optimizer."""

    @property
    def master_weights(self):
        """What keeps the updates' low bits: True (float32 copies), `"kahan"` or False.

        Once built, the truth: True only where float32 copies exist (some
        trainable variable is half: O2), `"kahan"` only where compensation
        buffers do, False otherwise (under O1 every variable is float32, so
        there is nothing to copy). Before the build, the request it will act
        on (the constructor's `master_weights`, `"auto"` resolved), which is
        also what `get_config` saves, so a reloaded optimizer decides afresh.
        """
        if not self.built:
            return self._master_weights_request
        return mw.in_force(self._masters, self._kahan)

    def scale_loss(self, loss):
        """Multiplies `loss` by the current scale (what Keras's trainer calls).

        Before the optimizer is built this uses `initial_scale`; a `tf.function`
        that builds the optimizer on its first call is traced again by
        TensorFlow once the variables exist, so the graph reads the variable.
        It also records, for this step, that the loss was scaled: see `apply_gradients`.
        """
        scaled_check.mark_scaled(self)
        return super().scale_loss(loss)

    def get_scaled_loss(self, loss):
        """tf.keras's name for `scale_loss`: `loss * loss_scale`, for custom loops."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """tf.keras's name: divides each gradient by the current scale, in float32.

        `apply` unscales by itself: pass it these (after clipping, say) with
        `scaled=False`, or pass it the scaled gradients as they are. Passing
        these without `scaled=False` would divide by the scale twice.
        """
        scale = self.loss_scale
        return [None if g is None else unscale(g, scale) for g in grads]

    def apply_gradients(self, grads_and_vars, scaled=None):
        """Applies `(gradient, variable)` pairs, unscaled or not as the step's loss was.

        Keras's trainer (`fit`) calls `scale_loss` and then this. A custom
        `train_step` that calls it on the gradients of a loss that never went
        through this optimizer's `scale_loss` in the same step (keras.io's
        GAN / VAE pattern) gets them applied as they are, not divided by the
        scale (non-finite steps are still skipped), and a warning, once, that
        names `self.optimizer.scale_loss(loss)`.

        Args:
            grads_and_vars: pairs `(gradient or None, variable)`.
            scaled: None (the default) decides as above; True or False as for `apply`.

        Returns:
            The optimizer's `iterations`.
        """
        grads, variables = zip(*grads_and_vars)
        took_scaled_loss = scaled_check.consume_mark(self)
        if scaled is None:
            scaled = took_scaled_loss
            if not scaled and self._scale_matters(variables):
                scaled_check.warn_unscaled_once(self, "apply_gradients")
        return self._apply_checked(grads, variables, scaled)

    def _scale_matters(self, variables):
        """False for a fixed scale of 1 (scaled or not is the same); builds the optimizer first."""
        if not self.built and variables is not None:
            self.build(variables)
        return self.dynamic or self.initial_scale != 1.0

    def track(self, model):
        """Guards `model`'s non-trainable variables: a skipped step restores them.

        `model.fit` does this by itself when it builds the optimizer. A custom
        loop, or a `train_step` whose optimizers are not `model.optimizer`
        (a GAN's two), calls it once, before the first step, with the model
        (or the sub-model) whose forward pass runs in the steps this
        optimizer decides. Calling it again takes the variables' current
        values as the committed state (after `set_weights`, say). A no-op
        with `restore_on_skip=False`.

        Args:
            model: a `keras.Model` or layer (its `non_trainable_variables`),
                or a list of variables.

        Returns:
            The optimizer.

        Example:
            >>> opt = kmix.wrap(keras.optimizers.Adam(1e-3)).track(model)
        """
        variables = nontrainable.state_of(model)
        if not self.restore_on_skip:
            return self
        if isinstance(model, keras.Model):
            # A weak reference: saving walks the optimizer's attributes, and the model holds the optimizer.
            self._tracked_model = weakref.ref(model)
        known = self._state_guard.variables if self._state_guard is not None else []
        if self._state_guard is not None and {id(v) for v in variables} <= {id(v) for v in known}:
            self._state_guard.sync()
            return self
        self._state_guard = nontrainable.StateGuard(known + variables, nontrainable.strategy_of(model))
        return self

    def _settle_state(self, applied, skipped):
        if self._state_guard:
            self._state_guard.settle(applied, skipped)


def unscale(g, scale):
    """`g / scale`, in float32 for half gradients (IndexedSlices kept sparse); `scale=None`: no division."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(unscale(g.values, scale), g.indices, g.dense_shape)
    if g.dtype in (tf.float16, tf.bfloat16):
        g = tf.cast(g, tf.float32)
    return g if scale is None else g / tf.cast(scale, g.dtype)
