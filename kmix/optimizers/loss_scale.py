"""`kmix.LossScaleOptimizer`: dynamic loss scaling with bounds, hysteresis and counters."""

import keras
import tensorflow as tf

from kmix._compat import (
    model_building,
    no_automatic_dependency_tracking,
    optimizer_variable_key,
    take_gradients_as_reduced,
)
from kmix.optimizers import accumulation, allreduce, arguments, counters, follow_model, fused_adam, replicas
from kmix.optimizers import master_weights as mw
from kmix.optimizers import scale_rule, scaled_check, step_routes
from kmix.optimizers.step_routes import unscale

_HALF = ("float16", "bfloat16")


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(
    counters.LossScaleCounters, step_routes.StepRoutes, keras.optimizers.LossScaleOptimizer
):
    """A `keras.optimizers.LossScaleOptimizer` with bounds, hysteresis and counters.

    The loss is multiplied by `loss_scale` before the backward pass so that
    small float16 gradients do not flush to zero; the gradients are divided by
    it again (in float32) before the inner optimizer sees them. On every
    `apply(grads)`:

    ```
    grads = all-reduce(grads)                # by kmix in `allreduce_dtype`, or by the inner optimizer
    finite = all gradients finite            # decided on the sums over all replicas
    if finite: apply inner optimizer to grads / scale (unscaled in float32)
    else: skip (no weight, slot, EMA or iteration changes); skipped_steps += 1
    scale, good_steps, hysteresis_left = ScaleRule(...).adjust(state, finite)
    ```

    The scale rule (growth, back-off, hysteresis, bounds) is spelled out in
    `kmix.optimizers.scale_rule.ScaleRule`. With `hysteresis=1` and the bounds
    out of reach it is `torch.amp.GradScaler`'s trajectory; with
    `hysteresis=2` it is Megatron-LM's.

    It is a subclass of Keras's class, so `model.compile` does not wrap it
    again and Keras's trainer calls its `scale_loss`. Keras's variables
    `dynamic_scale` (the scale) and `step_counter` (`good_steps`) are kept.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        initial_scale: the first loss scale, > 0 and within the bounds.
        growth_interval: finite steps between two growths, an int >= 1.
            `dynamic_growth_steps`, Keras's name, is accepted as an alias.
        growth_factor: what the scale is multiplied by on growth, > 1.
        backoff_factor: what the scale is multiplied by on overflow, in (0, 1).
        hysteresis: overflows tolerated before the scale backs off, int >= 1.
        min_scale: the floor of the scale, > 0.
        max_scale: the cap of the scale, >= `min_scale`.
        dynamic: `False` keeps the scale at `initial_scale`; non-finite steps
            are still skipped.
        master_weights: `True` keeps float32 copies of float16/bfloat16
            trainable variables and lets the inner optimizer update those;
            `False` updates the variables directly; `"auto"` (the default)
            is `True` unless the active policy has half parameters and asks
            for none (kmix's `"O3"`, Keras's `"float16"` / `"bfloat16"`).
            `"kahan"` keeps, instead of a float32 copy (4 bytes a parameter),
            a half-precision buffer with the rounding error of each update (2
            bytes): the inner optimizer updates the half variables directly
            (its slots take their dtype) and every write to them is a
            compensated sum. Meant for bfloat16 parameters; Adam-like
            optimizers need `beta_2 <= 0.99` (0.999 is 1.0 in bfloat16), and
            AdamW's decoupled weight decay, which Keras writes directly, is
            not compensated.
        accumulation_steps: micro-batches per optimizer step, an int >= 1. Their
            unscaled float32 gradients are summed and their mean applied once;
            one overflow discards the whole step (see `flush` for the
            remainder at the end of training).
        allreduce_dtype: None (the default): the inner optimizer all-reduces
            the unscaled gradients in their own dtype, as Keras does.
            `"float16"` or `"bfloat16"`: under a strategy with more than one
            replica (`MirroredStrategy`, `MultiWorkerMirroredStrategy`) kmix
            sums the *scaled* gradients over the replicas in that dtype (half
            the bytes), checks the sums for overflow (an inf on one replica,
            or one that appears only in the sum, skips the step everywhere)
            and unscales and applies in float32; float16 wants a dynamic
            scale (`kmix.wrap` gives one), bfloat16 a fixed one. No strategy
            or one replica: nothing to reduce, no effect. See
            `kmix.optimizers.allreduce`.
        restore_on_skip: True (the default): a skipped step also leaves the
            model's non-trainable variables (batch-norm statistics, seed
            states, anything a layer assigns in its forward pass) as the last
            applied step left them; see `track`. False: they keep what the
            skipped step's forward pass wrote (Keras's and torch's behaviour).
        fused_update: True (the default): when `inner_optimizer` is exactly
            `keras.optimizers.Adam` or `AdamW` without `amsgrad`, its dense
            float32 updates run on TensorFlow's fused `ResourceApplyAdam`
            kernel (the same arithmetic in one pass instead of a dozen; see
            `kmix.optimizers.fused_adam`). False: Keras's own update.
        name: the optimizer's name.

    Example:

    >>> opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3), hysteresis=2)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> model.fit(x, y)
    >>> float(opt.loss_scale), int(opt.skipped_steps), opt.overflow_report()[:3]
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        hysteresis=1,
        min_scale=1.0,
        max_scale=2.0**24,
        dynamic=True,
        name=None,
        master_weights="auto",
        accumulation_steps=1,
        dynamic_growth_steps=None,
        allreduce_dtype=None,
        restore_on_skip=True,
        fused_update=True,
        **kwargs,
    ):
        (initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale, max_scale,
         dynamic, master_weights, accumulation_steps, allreduce_dtype) = arguments.check(
            inner_optimizer, initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis,
            min_scale, max_scale, dynamic, master_weights, accumulation_steps, dynamic_growth_steps,
            allreduce_dtype,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=growth_interval,
            name=name,
            **kwargs,
        )
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.dynamic = dynamic
        self._master_weights_request = master_weights  # as resolved here: what get_config saves
        self.accumulation_steps = accumulation_steps
        self.allreduce_dtype = allreduce_dtype
        if not isinstance(restore_on_skip, bool):
            raise TypeError(
                f"`restore_on_skip` must be True or False. Received: restore_on_skip={restore_on_skip!r}"
            )
        self.restore_on_skip = restore_on_skip
        if not isinstance(fused_update, bool):
            raise TypeError(f"`fused_update` must be True or False. Received: fused_update={fused_update!r}")
        self.fused_update = fused_update
        if fused_update:
            fused_adam.install(inner_optimizer)
        else:
            fused_adam.remove(inner_optimizer)
        self._state_guard = None
        self._tracked_model = None

    # ------------------------------------------------------------------ state
    @no_automatic_dependency_tracking
    def build(self, var_list):
        """Creates the scale, the counters, master weights and the inner optimizer's slots."""
        if self.built:
            return
        var_list = list(var_list)
        model = (self._tracked_model() if self._tracked_model else None) or model_building(self)
        follow_model.follow(self, var_list, model)
        if model is not None and self._state_guard is None:
            self.track(model)
        self._variable_paths = [_variable_path(v) for v in var_list]
        self._model_variables = var_list
        self._masters = {}
        self._kahan = {}
        if self._master_weights_request == "kahan":
            mw.check_kahan_inner(self.inner_optimizer, var_list)
            self._kahan = mw.create_compensation(self, var_list)
        elif self._master_weights_request and any(_dtype(v) in _HALF for v in var_list):
            if self.inner_optimizer.built:
                raise ValueError(
                    "Master weights need an inner optimizer that is not built yet, so that it "
                    "builds its slots on the float32 copies; received a built "
                    f"{type(self.inner_optimizer).__name__}. Wrap a fresh optimizer, or pass "
                    "master_weights=False."
                )
            self._masters = mw.create_masters(self, var_list)
        inner_vars = [self._masters.get(i, v) for i, v in enumerate(var_list)]
        # Keras's build creates `step_counter` and `dynamic_scale` and builds the inner
        # optimizer on the list it is given: the float32 copies where there are some.
        super().build(inner_vars)
        if self.allreduce_dtype is not None:
            take_gradients_as_reduced(self.inner_optimizer)  # `apply` hands it the sums
        if self._kahan:
            buffers = {
                optimizer_variable_key(self.inner_optimizer, var_list[i]): (var_list[i], c)
                for i, c in self._kahan.items()
            }
            mw.install_kahan_hooks(self.inner_optimizer, buffers)
        self._create_counters(len(var_list))
        self._index = {id(v): i for i, v in enumerate(var_list)}
        if self.accumulation_steps > 1:
            accumulation.create_state(self, var_list)

    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor."""
        if not self.built:
            return tf.constant(self.initial_scale, tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

    # ----------------------------------------------------------------- apply
    def apply(self, grads, trainable_variables=None, scaled=None):
        """Applies scaled `grads` once, or skips the step if any is non-finite.

        With `accumulation_steps=k`, each call is one micro-batch: its
        unscaled float32 gradients are summed, and every k-th call applies
        their mean, or skips the whole step if any of the k overflowed.

        Args:
            grads: one gradient (or None) per variable.
            trainable_variables: the variables; those it was built with by default.
            scaled: True when `grads` are the gradients of the scaled loss:
                they are divided by the scale here. None (the default) is
                True, with a warning (once) when this optimizer's
                `scale_loss` did not run in the same step. False when
                they are already unscaled, e.g. by `get_unscaled_gradients`
                and then clipped (torch's `unscale_`, `clip_grad_norm_`,
                `step`): they are used as given (half ones in float32), with
                the same non-finite check, skip, scale update and counters.

        Returns:
            The optimizer's `iterations`.

        Example:
            >>> grads = opt.get_unscaled_gradients(tape.gradient(opt.scale_loss(loss), variables))
            >>> grads, _ = tf.clip_by_global_norm(grads, 1.0)  # clip the true gradients
            >>> opt.apply(grads, variables, scaled=False)
        """
        took_scaled_loss = scaled_check.consume_mark(self)
        if scaled is None:
            scaled = True
            if not took_scaled_loss and self._scale_matters(trainable_variables):
                scaled_check.warn_unscaled_once(self, "apply")
        return self._apply_checked(grads, trainable_variables, scaled)

    def _apply_checked(self, grads, trainable_variables, scaled):
        """Reduce, check, unscale and apply (or skip), update the scale: the body of `apply`."""
        if not isinstance(scaled, bool):
            raise TypeError(f"`scaled` must be True, False or None. Received: scaled={scaled!r}")
        grads = list(grads)
        if not self.built:
            # No outer name scope (Keras's class opens one here): each optimizer scopes
            # its own variables, so slot paths are the same however the build happens.
            self.build(trainable_variables)
        variables = self._resolve_variables(grads, trainable_variables)
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise ValueError(
                "apply() must be called in a replica context (inside `strategy.run`), "
                "not in the cross-replica context."
            )
        scale = tf.convert_to_tensor(self.dynamic_scale)
        reduce_here = allreduce.reduces_here(self.allreduce_dtype, ctx)
        if reduce_here and self.accumulation_steps == 1:
            # Scaled half sums, the same on every replica (accumulation reduces once per window).
            grads = allreduce.all_reduce(grads, variables, self.allreduce_dtype, None if scaled else scale)
            scaled = True
        nonfinite = self._nonfinite_per_variable(grads, variables)
        if ctx.num_replicas_in_sync > 1 and not reduce_here:
            # Every replica sees every replica's overflow, so all skip together.
            nonfinite = ctx.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        finite = tf.equal(tf.reduce_sum(nonfinite), 0.0)
        # Unscaled gradients, or a fixed scale of 1 (bfloat16, float32): nothing to divide by, which
        # saves a pass over every gradient (half gradients still go to float32).
        divisor = scale if scaled and (self.dynamic or self.initial_scale != 1.0) else None
        unscaled = [
            g if g is None or getattr(v, "overwrite_with_gradient", False) else unscale(g, divisor)
            for g, v in zip(grads, variables)
        ]
        if self.accumulation_steps == 1:
            self._apply_if(finite, unscaled, variables)
            self._settle_state(finite, tf.logical_not(finite))
            self._update_state(finite, nonfinite, scale)
        else:
            accumulation.add_micro_batch(self, finite, nonfinite, unscaled, variables, scale)
        return self.iterations

    def flush(self):
        """Applies a partial accumulation (fewer than `accumulation_steps` micro-batches).

        Divides by the number of micro-batches actually summed, as MMCV's
        `GradientCumulativeOptimizerHook` does for its remainder. `model.fit`
        calls it at the end of training (through `finalize_variable_values`);
        call it yourself at the end of a custom loop. A no-op without
        accumulation or with nothing pending.
        """
        if self.accumulation_steps == 1 or not self.built:
            return
        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(self.flush)
            return
        accumulation.flush(self)

    def _apply_if(self, finite, unscaled, variables):
        """Runs the inner optimizer on already unscaled gradients where `finite` holds."""
        replicas.run_if(finite, self._apply_inner, unscaled, variables)

    def _apply_inner(self, unscaled, variables):
        if not self._masters:
            self.inner_optimizer.apply(unscaled, variables)
            return
        indices = [self._index[id(v)] for v in variables]
        masters = [self._masters.get(i, v) for i, v in zip(indices, variables)]
        mw.sync_from_model(self._masters, self._model_variables, indices)
        self.inner_optimizer.apply(unscaled, masters)
        mw.copy_to_model(self._masters, self._model_variables, indices)

    def _update_state(self, finite, nonfinite, scale, active=None):
        """One step of `scale_rule.ScaleRule` and the counters; nothing changes where `active` is False."""
        rule = scale_rule.ScaleRule(self._growth_interval_var, self.growth_factor, self.backoff_factor,
                                    self.hysteresis, self.min_scale, self.max_scale, self.dynamic)
        before = scale_rule.ScaleState(
            scale, tf.convert_to_tensor(self.step_counter), tf.convert_to_tensor(self._hysteresis_left)
        )
        after = rule.adjust(before, finite)
        zero = tf.constant(0, tf.int64)
        skipped = tf.where(finite, zero, 1)
        at_floor = tf.where(scale <= self.min_scale, skipped, zero)
        overflowed = tf.cast(nonfinite > 0, tf.int64)
        if active is not None:
            after = scale_rule.ScaleState(*(tf.where(active, a, b) for a, b in zip(after, before)))
            skipped, at_floor = (tf.where(active, t, zero) for t in (skipped, at_floor))
            overflowed = tf.where(active, overflowed, tf.zeros_like(overflowed))
        self.dynamic_scale.assign(after.scale)
        self.step_counter.assign(tf.cast(after.good_steps, self.step_counter.dtype))
        self._hysteresis_left.assign(after.hysteresis_left)
        self._skipped_steps.assign_add(skipped)
        self._overflow_counts.assign_add(overflowed)
        self._min_scale_overflows.assign_add(at_floor)

    def _resolve_variables(self, grads, trainable_variables):
        if trainable_variables is None:
            variables = self._model_variables
        else:
            variables = list(trainable_variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} variables; "
                "expected one gradient (or None) per variable."
            )
        unknown = [_variable_path(v) for v in variables if id(v) not in self._index]
        if unknown:
            raise ValueError(
                f"{type(self).__name__} was built for other variables; received variables it "
                f"does not know: {unknown[:5]}. Build it with every variable it will update."
            )
        return variables

    def finalize_variable_values(self, var_list):
        """Applies a pending partial accumulation, then lets the inner optimizer finalize (EMA)."""
        self.flush()
        if not self._masters_for(var_list):
            return super().finalize_variable_values(var_list)
        indices = [self._index[id(v)] for v in var_list]
        self.inner_optimizer.finalize_variable_values(
            [self._masters.get(i, v) for i, v in zip(indices, var_list)]
        )
        mw.copy_to_model(self._masters, self._model_variables, indices)

    def _masters_for(self, var_list):
        return bool(getattr(self, "_masters", None)) and all(id(v) in self._index for v in var_list)

    # ----------------------------------------------------------------- config
    def get_config(self):
        """Every constructor argument, so `from_config` rebuilds the same optimizer."""
        config = super().get_config()
        config.pop("dynamic_growth_steps")
        config.update(
            growth_interval=self.growth_interval,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            master_weights=self._master_weights_request,
            accumulation_steps=self.accumulation_steps,
            allreduce_dtype=self.allreduce_dtype,
            restore_on_skip=self.restore_on_skip,
            fused_update=self.fused_update,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Re-creates the optimizer; also accepts configs of Keras's own class."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def _dtype(v):
    return keras.backend.standardize_dtype(v.dtype)


def _variable_path(v):
    return getattr(v, "path", None) or v.name
