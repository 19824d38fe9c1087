"""`kmix.LossScaleOptimizer`: dynamic loss scaling with bounds, hysteresis and counters."""

import weakref

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix._compat import (
    model_building,
    no_automatic_dependency_tracking,
    optimizer_variable_key,
    strategy_supports_no_merge_call,
)
from kmix.optimizers import accumulation, follow_model, nontrainable, scale_rule
from kmix.optimizers.counters import Counters
from kmix.optimizers import master_weights as mw
from kmix.optimizers import scaled_check

_HALF = ("float16", "bfloat16")


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(Counters, keras.optimizers.LossScaleOptimizer):
    """A `keras.optimizers.LossScaleOptimizer` with bounds, hysteresis and counters.

    The loss is multiplied by `loss_scale` before the backward pass so that
    small float16 gradients do not flush to zero; the gradients are divided by
    it again (in float32) before the inner optimizer sees them. On every
    `apply(grads)`:

    ```
    finite = all gradients finite            # decided on the gradients as summed over all replicas
    if not finite:                           # skip: no weight, slot, EMA or iteration changes
        skipped_steps += 1; good_steps = 0; hysteresis_left -= 1
        if dynamic and hysteresis_left <= 0: scale = max(scale * backoff_factor, min_scale)
    else:
        apply inner optimizer to grads / scale (unscaled in float32)
        good_steps += 1
        if dynamic and good_steps == growth_interval:
            good_steps = 0; hysteresis_left = hysteresis; scale = min(scale * growth_factor, max_scale)
    ```

    With `hysteresis=1` and the bounds out of reach this is
    `torch.amp.GradScaler`'s trajectory; with `hysteresis=2` it is Megatron-LM's.
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
        restore_on_skip: True (the default): a skipped step also leaves the
            model's non-trainable variables (batch-norm statistics, seed
            states, anything a layer assigns in its forward pass) as the last
            applied step left them; see `track`. False: they keep what the
            skipped step's forward pass wrote (Keras's and torch's behaviour).
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
        restore_on_skip=True,
        **kwargs,
    ):
        if dynamic_growth_steps is not None:
            if growth_interval not in (2000, dynamic_growth_steps):
                raise ValueError(
                    "`dynamic_growth_steps` is Keras's name for `growth_interval`; pass only "
                    f"one. Received: growth_interval={growth_interval!r}, "
                    f"dynamic_growth_steps={dynamic_growth_steps!r}"
                )
            growth_interval = dynamic_growth_steps
        _check_inner(inner_optimizer)
        initial_scale = checks.real("initial_scale", initial_scale, low=0.0, low_open=True)
        growth_interval = checks.integer("growth_interval", growth_interval)
        growth_factor = checks.real("growth_factor", growth_factor, low=1.0, low_open=True)
        backoff_factor = checks.real(
            "backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True
        )
        hysteresis = checks.integer("hysteresis", hysteresis)
        min_scale = checks.real("min_scale", min_scale, low=0.0, low_open=True)
        max_scale = checks.real("max_scale", max_scale, low=0.0, low_open=True, allow_inf=True)
        if min_scale > max_scale:
            raise ValueError(
                "`min_scale` must be <= `max_scale`. "
                f"Received: min_scale={min_scale!r}, max_scale={max_scale!r}"
            )
        if not isinstance(dynamic, bool):
            raise TypeError(f"`dynamic` must be True or False. Received: dynamic={dynamic!r}")
        if dynamic and not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                "`initial_scale` must lie within [min_scale, max_scale]. Received: "
                f"initial_scale={initial_scale!r}, min_scale={min_scale!r}, max_scale={max_scale!r}"
            )
        if master_weights == "auto":
            master_weights = mw.auto_master_weights()
        elif not isinstance(master_weights, bool) and master_weights != "kahan":
            raise ValueError(
                "`master_weights` must be 'auto', True, False or 'kahan'. "
                f"Received: master_weights={master_weights!r}"
            )
        accumulation_steps = checks.integer("accumulation_steps", accumulation_steps)
        inner_steps = getattr(inner_optimizer, "gradient_accumulation_steps", None)
        if inner_steps:
            raise ValueError(
                "The inner optimizer accumulates gradients itself "
                f"(gradient_accumulation_steps={inner_steps}); under loss scaling a skipped "
                "micro-batch would silently drop out of its sum and bias the step. Received: "
                f"inner_optimizer.gradient_accumulation_steps={inner_steps!r}. Use "
                f"`kmix.wrap(opt, accumulation_steps={inner_steps})` on an optimizer without it."
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
        if not isinstance(restore_on_skip, bool):
            raise TypeError(
                f"`restore_on_skip` must be True or False. Received: restore_on_skip={restore_on_skip!r}"
            )
        self.restore_on_skip = restore_on_skip
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
        if self._kahan:
            buffers = {
                optimizer_variable_key(self.inner_optimizer, var_list[i]): (var_list[i], c)
                for i, c in self._kahan.items()
            }
            mw.install_kahan_hooks(self.inner_optimizer, buffers)
        self._skipped_steps = self._int_variable("skipped_steps")
        self._hysteresis_left = self._int_variable("hysteresis_left", initial=self.hysteresis)
        self._overflow_counts = self._int_variable("overflow_counts", shape=(len(var_list),))
        self._min_scale_overflows = self._int_variable("min_scale_overflows")
        self._growth_interval_var = self._int_variable(
            "current_growth_interval", initial=self.growth_interval
        )
        self._index = {id(v): i for i, v in enumerate(var_list)}
        if self.accumulation_steps > 1:
            accumulation.create_state(self, var_list)

    def _int_variable(self, name, shape=(), initial=0):
        return self.add_variable(
            shape=shape,
            dtype="int64",
            initializer=keras.initializers.Constant(initial),
            aggregation="none",
            name=name,
        )

    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor."""
        if not self.built:
            return tf.constant(self.initial_scale, tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

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

    # ------------------------------------------------------------------ loss
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
        return [None if g is None else _unscale(g, scale) for g in grads]

    # ----------------------------------------------------------------- apply
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

    def _scale_matters(self, variables):
        """False for a fixed scale of 1 (scaled or not is the same); builds the optimizer first."""
        if not self.built and variables is not None:
            self.build(variables)
        return self.dynamic or self.initial_scale != 1.0

    def _apply_checked(self, grads, trainable_variables, scaled):
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
        nonfinite = self._nonfinite_per_variable(grads, variables)
        if ctx.num_replicas_in_sync > 1:
            # Every replica sees every replica's overflow, so all skip together.
            nonfinite = ctx.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        finite = tf.equal(tf.reduce_sum(nonfinite), 0.0)
        scale = tf.convert_to_tensor(self.dynamic_scale)
        divisor = scale if scaled else tf.ones([], scale.dtype)  # x / 1 is exact
        unscaled = [
            g if g is None or getattr(v, "overwrite_with_gradient", False) else _unscale(g, divisor)
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

    def _apply_if(self, finite, unscaled, variables):
        """Runs the inner optimizer on already unscaled gradients where `finite` holds."""
        if strategy_supports_no_merge_call():
            tf.cond(finite, lambda: self._apply_inner(unscaled, variables), lambda: None)
        else:
            ctx = tf.distribute.get_replica_context()
            ctx.merge_call(self._cross_replica_apply, args=(finite, unscaled, variables))

    def _cross_replica_apply(self, distribution, finite, unscaled, variables):
        # tf.distribute forbids a merge call inside a replica-context cond, and the
        # inner optimizer merges: so the cond runs here, in cross-replica context.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_fn():
            distribution.extended.call_for_each_replica(self._apply_inner, args=(unscaled, variables))

        tf.cond(finite, apply_fn, lambda: None)

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
        """One step of the class docstring's pseudo-code (`scale_rule.update`)."""
        scale_rule.update(self, finite, nonfinite, scale, active)

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

    def _nonfinite_per_variable(self, grads, variables):
        """A float32 vector, one entry per built variable: 1 where its gradient is non-finite."""
        slots = {}
        for g, v in zip(grads, variables):
            if g is not None:
                values = g.values if isinstance(g, tf.IndexedSlices) else g
                slots[self._index[id(v)]] = tf.reduce_all(tf.math.is_finite(values))
        if not slots:
            return tf.zeros((len(self._model_variables),), tf.float32)
        # One stack and one cast for all variables: per-variable casts cost
        # an op each, which shows on models with many small variables.
        finite = tf.stack([slots.get(i, True) for i in range(len(self._model_variables))])
        return tf.cast(tf.logical_not(finite), tf.float32)

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
            restore_on_skip=self.restore_on_skip,
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


def _unscale(g, scale):
    """`g / scale`, in float32 for half gradients (IndexedSlices kept sparse)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_unscale(g.values, scale), g.indices, g.dense_shape)
    if g.dtype in (tf.float16, tf.bfloat16):
        g = tf.cast(g, tf.float32)
    return g / tf.cast(scale, g.dtype)


def _check_inner(inner):
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a LossScaleOptimizer; scaling twice would square "
            f"the scale. Received: inner_optimizer={inner!r}. Use `kmix.wrap(opt)`, which "
            "re-wraps a Keras LossScaleOptimizer's inner optimizer."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. Received: "
            f"inner_optimizer={inner!r} (of type {type(inner).__name__}). Use `kmix.wrap('adam')` "
            "to create one from a name or a config."
        )


def _dtype(v):
    return keras.backend.standardize_dtype(v.dtype)


def _variable_path(v):
    return getattr(v, "path", None) or v.name
