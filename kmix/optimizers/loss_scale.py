"""`kmix.LossScaleOptimizer`: dynamic loss scaling with bounds, hysteresis and counters."""

import contextlib
import functools
import types
import weakref

import keras
import tensorflow as tf

from kmix._compat import model_building, no_automatic_dependency_tracking, optimizer_variable_key
from kmix._compat import take_gradients_as_reduced
from kmix.optimizers import accumulation, allreduce, arguments, counters, follow_model, fused_adam, kahan
from kmix.optimizers import master_weights as mw
from kmix.optimizers import replicas, saved_level, scaled_check, step_state
from kmix.optimizers.scaled_check import unscale


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(counters.CounterViews, keras.optimizers.LossScaleOptimizer):
    """A `keras.optimizers.LossScaleOptimizer` with bounds, hysteresis and counters.

    The loss is multiplied by `loss_scale` before the backward pass so that
    small float16 gradients do not flush to zero; the gradients are divided by
    it again (in float32) before the inner optimizer sees them. On every
    `apply(grads)` / `apply_gradients`:

    ```
    scaled = the step's route (kmix.optimizers.scaled_check): scale_loss, get_unscaled_gradients, neither
    grads = all-reduce(grads)                # by kmix in `allreduce_dtype`, or by the inner optimizer
    finite = all gradients finite            # decided on the sums over all replicas
    if finite: apply inner optimizer to grads / scale if scaled else grads (in float32)
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
            trainable variables for the inner optimizer to update; `False`
            updates the variables directly; `"auto"` (the default) is `True`
            unless the active policy has half parameters and asks for none
            (`"O3"`, `"float16"`, `"bfloat16"`). `"kahan"`: a 2-byte buffer
            of each update's rounding remainder instead of a float32 copy;
            the inner optimizer computes in float32 with float32 slots
            (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, Lion, Lamb,
            Adadelta); see `kmix.optimizers.kahan`.
        accumulation_steps: micro-batches per optimizer step, an int >= 1. Their
            unscaled float32 gradients are summed and their mean applied once;
            one overflow discards the whole step (see `flush` for the
            remainder at the end of training).
        allreduce_dtype: None (the default): the inner optimizer all-reduces
            the gradients in their own dtype, as Keras does. `"float16"` or
            `"bfloat16"`: with more than one replica kmix sums them over the
            replicas in that dtype (half the bytes; float16 with a wire scale
            per variable and step that keeps the sums in range), checks the
            sums (an inf on any replica skips the step everywhere) and applies
            in float32. See `kmix.optimizers.allreduce`.
        restore_on_skip: True (the default): a skipped step also puts back
            what its forward pass wrote (batch-norm statistics, seed states),
            found in the traced step (`kmix.optimizers.step_state`). False:
            they keep what the skipped step wrote (Keras's behaviour).
        fused_update: True (the default): `keras.optimizers.Adam` / `AdamW`
            (without `amsgrad`) update dense float32 variables on TensorFlow's
            fused `ResourceApplyAdam` kernel (`kmix.optimizers.fused_adam`).
            False: Keras's own update.
        name: the optimizer's name.

    Example:

    >>> opt = kmix.LossScaleOptimizer(keras.optimizers.Adam(1e-3), hysteresis=2)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> model.fit(x, y)
    >>> float(opt.loss_scale), int(opt.skipped_steps), opt.overflow_report()[:3]
    """

    def __init__(self, inner_optimizer, initial_scale=2.0**15, growth_interval=2000, growth_factor=2.0,
                 backoff_factor=0.5, hysteresis=1, min_scale=1.0, max_scale=2.0**24, dynamic=True, name=None,
                 master_weights="auto", accumulation_steps=1, dynamic_growth_steps=None, allreduce_dtype=None,
                 restore_on_skip=True, fused_update=True, **kwargs):
        (initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale, max_scale,
         dynamic, master_weights, accumulation_steps, allreduce_dtype) = arguments.check(
            inner_optimizer, initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis,
            min_scale, max_scale, dynamic, master_weights, accumulation_steps, dynamic_growth_steps,
            allreduce_dtype,
        )
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=growth_interval,
                         name=name, **kwargs)
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
        self.restore_on_skip = arguments.check_flag("restore_on_skip", restore_on_skip)
        self.fused_update = arguments.check_flag("fused_update", fused_update)
        if fused_update:
            fused_adam.install(inner_optimizer)
        else:
            fused_adam.remove(inner_optimizer)
        self._tracked = None  # what `track` was given: a weak reference to a model, or a tuple of variables
        self._window_starts = {}  # under accumulation: step_state.WindowStart by the written variables' specs

    @no_automatic_dependency_tracking
    def build(self, var_list):
        """Creates the scale, the counters, master weights and the inner optimizer's slots."""
        if self.built:
            return
        var_list = list(var_list)
        follow_model.follow(self, var_list, self._tracked_model() or model_building(self))
        kind = mw.kind_for(self._master_weights_request, var_list)  # first: a read before build is checked here
        self._saved_layout = saved_level.install(self, saved_level.layout_of(self, var_list, kind))
        self._variable_paths = [_variable_path(v) for v in var_list]
        self._model_variables = var_list
        self._masters, self._kahan = mw.create_for(self, self._master_weights_request, var_list)
        # Keras's build creates `step_counter` and `dynamic_scale` and builds the inner
        # optimizer on the list it is given: the float32 copies where there are some.
        with kahan.float32_slots(self.inner_optimizer) if self._kahan else contextlib.nullcontext():
            super().build([self._masters.get(i, v) for i, v in enumerate(var_list)])
        if self.allreduce_dtype is not None:
            take_gradients_as_reduced(self.inner_optimizer)  # `apply` hands it the sums
        if self._kahan:
            kahan.install(self.inner_optimizer, {
                optimizer_variable_key(self.inner_optimizer, var_list[i]): (var_list[i], c)
                for i, c in self._kahan.items()})
        counters.create(self, len(var_list))
        self._index = {id(v): i for i, v in enumerate(var_list)}
        if self.accumulation_steps > 1:
            accumulation.create_state(self, var_list)

    # ------------------------------------------------------------ what it holds
    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor; before `build`, the one it will start from."""
        if not self.built:
            return tf.constant(follow_model.planned_scale(self), tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

    @property
    def master_weights(self):
        """What keeps the updates' low bits: True (float32 copies), `"kahan"` or False.

        Once built, the truth (True only where float32 copies exist: some
        trainable variable is half); before, the request it will act on
        (`"auto"` resolved), which is what `get_config` saves.
        """
        if not self.built:
            return self._master_weights_request
        return mw.in_force(self._masters, self._kahan)

    # ------------------------------------------------------------ the routes in
    def scale_loss(self, loss):
        """Multiplies `loss` by the current scale (what Keras's trainer calls), and marks the step.

        Before the optimizer is built this uses the scale it will start from; a
        `tf.function` that builds it on its first call is traced again once the
        variables exist. The mark tells `apply` / `apply_gradients` in the same
        step that their gradients are scaled (`kmix.optimizers.scaled_check`).
        """
        scaled_check.mark_scaled(self, loss)
        return keras.ops.multiply(loss, self.dynamic_scale if self.built else follow_model.planned_scale(self))

    def get_scaled_loss(self, loss):
        """tf.keras's name for `scale_loss`: `loss * loss_scale`, for custom loops."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """tf.keras's name: each gradient divided by the current scale, in float32.

        `apply` / `apply_gradients` in the same step know these, and in a
        `tf.function` what is computed from them (clipped, say), as unscaled:
        TensorFlow's guide loop trains as written.
        """
        scale = self.loss_scale
        unscaled = [None if g is None else unscale(g, scale) for g in grads]
        scaled_check.mark_unscaled(self, grads, unscaled)
        return unscaled

    def apply_gradients(self, grads_and_vars, scaled=None):
        """Applies `(gradient, variable)` pairs once, or skips the step if any is non-finite.

        Args:
            grads_and_vars: pairs `(gradient or None, variable)`.
            scaled: as for `apply`.

        Returns:
            The optimizer's `iterations`.
        """
        grads, variables = zip(*grads_and_vars)
        loss = scaled_check.step_loss(self)
        scaled = scaled_check.decide(self, grads, variables, scaled, "apply_gradients")
        return self._apply_checked(grads, variables, scaled, loss)

    def apply(self, grads, trainable_variables=None, scaled=None):
        """Applies `grads` once, or skips the step if any is non-finite.

        With `accumulation_steps=k`, each call is one micro-batch: its
        unscaled float32 gradients are summed, and every k-th call applies
        their mean, or skips the whole step if any of the k overflowed.

        Args:
            grads: one gradient (or None) per variable.
            trainable_variables: the variables; those it was built with by default.
            scaled: None (the default): decided when the step is traced
                (`kmix.optimizers.scaled_check`): what `get_unscaled_gradients`
                returned, or was computed from it, is used as given; else the
                gradients of a loss that went through `scale_loss` in the step
                are divided by the scale; else (a step written for float32)
                they are used as given, with a warning once. True: divide.
                False: use as given. Either way in float32, checked and counted.

        Returns:
            The optimizer's `iterations`.

        Example:
            >>> grads = opt.get_unscaled_gradients(tape.gradient(opt.scale_loss(loss), variables))
            >>> grads, _ = tf.clip_by_global_norm(grads, 1.0)  # clip the true gradients
            >>> opt.apply(grads, variables, scaled=False)      # scaled=False: said, not inferred
        """
        grads = list(grads)
        loss = scaled_check.step_loss(self)
        scaled = scaled_check.decide(self, grads, trainable_variables, scaled, "apply")
        return self._apply_checked(grads, trainable_variables, scaled, loss)

    def flush(self):
        """Applies a partial accumulation (fewer than `accumulation_steps` micro-batches).

        Divides by the number of micro-batches summed (MMCV's remainder rule).
        `model.fit` calls it at the end of training; a custom loop calls it
        at its end. A no-op without accumulation or with nothing pending.
        """
        if self.accumulation_steps == 1 or not self.built:
            return
        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(self.flush)
            return
        accumulation.flush(self)

    def track(self, model):
        """Restricts what a skipped step puts back to `model`'s variables, and tells `wrap` the model.

        A skipped step puts back whatever the traced step's forward pass wrote
        (`kmix.optimizers.step_state`), found in the step itself: `fit` and
        custom loops need nothing. A `train_step` with two optimizers (a GAN)
        calls `track(sub_model)` on each, so that neither puts back the
        other's forward pass. Loaded or set weights need no call.

        Args:
            model: a `keras.Model` or layer, or a list of variables.

        Returns:
            The optimizer.

        Example:
            >>> g_opt = kmix.wrap(keras.optimizers.Adam(1e-3)).track(generator)
        """
        variables = step_state.variables_of(model)
        if isinstance(model, keras.Model):
            # A weak reference: saving walks the optimizer's attributes, and the model holds the optimizer.
            self._tracked = weakref.ref(model)
        else:
            self._tracked = types.SimpleNamespace(variables=tuple(variables))  # not tracked for saving
        return self

    def _tracked_model(self):
        return self._tracked() if isinstance(self._tracked, weakref.ref) else None

    def _written(self, loss):
        """What this traced step's forward pass wrote (empty with `restore_on_skip=False` or eagerly)."""
        if not self.restore_on_skip:
            return step_state.Written.nothing()
        only = getattr(self._tracked, "variables", None)
        if isinstance(self._tracked, weakref.ref):
            model = self._tracked()
            only = None if model is None else model.non_trainable_variables
        written = step_state.Written(self._model_variables, loss, only)
        self._written_in_last_trace = len(written)  # how many variables a skipped step puts back (tests, debugging)
        return written

    # ------------------------------------------------------------ one step
    def _apply_checked(self, grads, trainable_variables, scaled, loss=None):
        """Reduce, check, unscale and apply (or skip), update the scale: the body of `apply`."""
        grads = list(grads)
        if not self.built:
            # No outer name scope (Keras's class opens one here): each optimizer scopes
            # its own variables, so slot paths are the same however the build happens.
            self.build(trainable_variables)
        variables = arguments.resolve_variables(self, grads, trainable_variables)
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise ValueError("apply() must be called in a replica context (inside `strategy.run`), "
                             "not in the cross-replica context.")
        scale = tf.convert_to_tensor(self.dynamic_scale)
        reduce_here = allreduce.reduces_here(self.allreduce_dtype, ctx)
        if reduce_here and self.accumulation_steps == 1:
            # Scaled half sums, the same on every replica (accumulation reduces once per window).
            grads = allreduce.all_reduce(grads, variables, self.allreduce_dtype, None if scaled else scale)
            scaled = True
        nonfinite = counters.nonfinite(self, grads, variables)
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
        written = self._written(loss)
        if self.accumulation_steps == 1:
            self._apply_if(finite, unscaled, variables)
            written.restore(tf.logical_not(finite))
            step_state.warn_eager_skip(self, tf.logical_not(finite))
            counters.record_step(self, finite, nonfinite, scale)
        else:
            accumulation.add_micro_batch(self, finite, nonfinite, unscaled, variables, scale, written)
        return self.iterations

    def _apply_if(self, finite, unscaled, variables):
        """Runs the inner optimizer on already unscaled gradients where `finite` holds (on masters if any)."""
        replicas.run_if(finite, functools.partial(mw.apply_inner, self), unscaled, variables)

    def _window_start(self, written):
        """The variables holding the written state's values from the window's first micro-batch."""
        key = tuple((tuple(old.shape), old.dtype.name) for old in written.before)
        if key not in self._window_starts:
            self._window_starts[key] = step_state.WindowStart(written)
        return self._window_starts[key]

    def finalize_variable_values(self, var_list):
        """Applies a pending partial accumulation, then lets the inner optimizer finalize (EMA)."""
        self.flush()
        if not (getattr(self, "_masters", None) and all(id(v) in self._index for v in var_list)):
            return super().finalize_variable_values(var_list)
        mw.finalize(self, var_list)

    # ------------------------------------------------------------ saving and config
    def save_own_variables(self, store):
        """Saves Keras's state by position and the layout it has at its opt level (`saved_level`).

        Args:
            store: the optimizer's entry of a Keras weights store.
        """
        super().save_own_variables(store)
        saved_level.write(self, store)

    def load_own_variables(self, store):
        """Loads what `save_own_variables` wrote, converted from another opt level, or raises naming both.

        Args:
            store: the optimizer's entry of a Keras weights store.
        """
        saved_level.load(self, store, super().load_own_variables)

    def get_config(self):
        """Every constructor argument, so `from_config` rebuilds the same optimizer."""
        config = super().get_config()
        config.pop("dynamic_growth_steps")
        config.update({name: getattr(self, name) for name in _CONFIG}, master_weights=self._master_weights_request)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Re-creates the optimizer; also accepts configs of Keras's own class."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


_CONFIG = ("growth_interval", "growth_factor", "backoff_factor", "hysteresis", "min_scale", "max_scale", "dynamic",
           "accumulation_steps", "allreduce_dtype", "restore_on_skip", "fused_update")


def _variable_path(v):
    return getattr(v, "path", None) or v.name
