"""`kmix.LossScaleOptimizer`: dynamic loss scaling with bounds, hysteresis and counters, in one object."""

import contextlib
import functools
import logging
import types
import weakref

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix import _compat
from kmix.optimizers import allreduce, saved_level, scaling, steps, updates
from kmix.optimizers.scaling import AUTO

_log = logging.getLogger("kmix")


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleOptimizer(scaling.Settling, steps.Accumulation, keras.optimizers.LossScaleOptimizer):
    """A `keras.optimizers.LossScaleOptimizer` with bounds, hysteresis, counters and float32 master weights.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        initial_scale: the first scale, > 0, or `"auto"` (the scale `kmix.autocast` advised, else 2^15; 1 if fixed).
        growth_interval: finite steps between two growths (`dynamic_growth_steps`, Keras's name, too).
        growth_factor: the scale's factor on growth, > 1.
        backoff_factor: the scale's factor on overflow, in (0, 1).
        hysteresis: overflows tolerated before the scale backs off, >= 1.
        min_scale, max_scale: the scale's bounds.
        dynamic: True, False (a fixed scale; non-finite steps still skipped) or `"auto"`.
        master_weights: `"auto"` (on unless the policy asks for half parameters without, as O3), True
            (float32 copies of half trainable variables), False, or `"kahan"` (a 2-byte remainder each).
        accumulation_steps: micro-batches per step, their float32 gradients averaged; an overflow skips the window.
        allreduce_dtype: None, or `"float16"` / `"bfloat16"`: gradients summed over replicas in that dtype.
        restore_on_skip: a skipped step puts back what its forward pass wrote (batch-norm statistics).
        fused_update: exact Adam / AdamW update dense float32 variables on TensorFlow's fused kernel.
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
        if dynamic_growth_steps is not None:
            if growth_interval not in (2000, dynamic_growth_steps):
                raise ValueError("`dynamic_growth_steps` is Keras's name for `growth_interval`; pass only one. "
                                 f"Received: growth_interval={growth_interval!r}, "
                                 f"dynamic_growth_steps={dynamic_growth_steps!r}")
            growth_interval = scaling.count("dynamic_growth_steps", dynamic_growth_steps)
        scaling.check_inner(inner_optimizer)
        initial_scale, dynamic, min_scale, max_scale = scaling.check_scales(initial_scale, dynamic, min_scale,
                                                                            max_scale)
        growth_interval = scaling.count("growth_interval", growth_interval)
        if master_weights == "auto":
            master_weights = scaling.auto_master_weights()
        elif master_weights == "kahan":
            updates.check_kahan(inner_optimizer)
        elif not isinstance(master_weights, bool):
            raise ValueError("`master_weights` must be 'auto', True, False or 'kahan'. "
                             f"Received: master_weights={master_weights!r}")
        start = initial_scale if initial_scale != AUTO else (scaling.DEFAULT_SCALE if dynamic is True else 1.0)
        super().__init__(inner_optimizer, initial_scale=start, dynamic_growth_steps=growth_interval, name=name,
                         **kwargs)
        self._initial_request, self._dynamic_request = initial_scale, dynamic
        self.dynamic = dynamic is True  # "auto": fixed until the variables or the step say float16
        self.growth_interval = growth_interval
        self.growth_factor = checks.real("growth_factor", growth_factor, low=1.0, low_open=True)
        self.backoff_factor = checks.real("backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True,
                                          high_open=True)
        self.hysteresis = scaling.count("hysteresis", hysteresis)
        self.min_scale, self.max_scale = self._bounds = (min_scale, max_scale)
        self._master_weights_request = master_weights
        self.accumulation_steps = scaling.count("accumulation_steps", accumulation_steps)
        self.allreduce_dtype = allreduce.check_dtype(allreduce_dtype)
        self.restore_on_skip = checks.boolean("restore_on_skip", restore_on_skip)
        self.fused_update = checks.boolean("fused_update", fused_update)
        updates.use_fused_adam(inner_optimizer, fused_update)
        self._marks = steps.StepMarks()
        self._tracked = None  # a weak reference to the model `track` was given, or a tuple of variables
        self._window_starts = {}  # under accumulation: steps.WindowStart by the written variables' specs
        self._undecided = dynamic is not True  # no evidence of float16 compute yet (to switch, or to warn)

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        """Creates the scale, the counters, master weights and the inner optimizer's slots."""
        if self.built:
            return
        var_list = list(var_list)
        self._settle(scaling.float16_evidence(var_list, self._tracked_model()), var_list)
        kind = updates.kind_for(self._master_weights_request, var_list)
        # The checkpoint record first: a read before `build` is checked before any variable exists.
        self._saved = saved_level.SavedLevel(self, saved_level.Layout.of(var_list, kind, self._scaled()), None)
        self._weights = self._saved.weights = updates.MasterWeights(self, self._master_weights_request, var_list)
        with _compat.float32_slots(self.inner_optimizer) if kind == "kahan" else contextlib.nullcontext():
            super().build(self._weights.targets())  # Keras's `step_counter`, `dynamic_scale`, inner slots
        if self.allreduce_dtype is not None:
            _compat.take_gradients_as_reduced(self.inner_optimizer)  # `apply` hands it the sums
        self._weights.install_kahan(self.inner_optimizer)
        self._skipped_steps = self._int_variable("skipped_steps")
        self._hysteresis_left = self._int_variable("hysteresis_left", self.hysteresis)
        self._overflow_counts = self._int_variable("overflow_counts", shape=(len(var_list),))
        self._min_scale_overflows = self._int_variable("min_scale_overflows")
        self._growth_interval_var = self._int_variable("current_growth_interval", self.growth_interval)
        if self.accumulation_steps > 1:
            self._accumulators = [self.add_variable(tuple(v.shape), dtype="float32", initializer="zeros",
                                                    aggregation="none", name="accumulator_" + updates.slug(v))
                                  for v in var_list]
            self._micro_step = self._int_variable("micro_step")
            self._window_nonfinite = self.add_variable((len(var_list),), dtype="float32", initializer="zeros",
                                                       aggregation="none", name="window_nonfinite")
            self._accumulated = [True] * len(var_list)  # which variables receive gradients, for `flush`

    def _int_variable(self, name, initial=0, shape=()):
        return self.add_variable(shape=shape, dtype="int64", initializer=keras.initializers.Constant(initial),
                                 aggregation="none", name=name)

    def _scaled(self):
        return bool(self.dynamic or self.initial_scale != 1.0)

    @property
    def loss_scale(self):
        """The current loss scale, a float32 scalar tensor; before `build`, the one it will start from."""
        return tf.convert_to_tensor(self.dynamic_scale) if self.built else tf.constant(self.initial_scale, tf.float32)

    @property
    def master_weights(self):
        """True (float32 copies in force), `"kahan"` or False; before `build`, the request it will act on."""
        return self._weights.in_force if self.built else self._master_weights_request

    def _counter(self, name):
        if not self.built:
            raise ValueError(f"{type(self).__name__} {self.name!r} is not built yet: its counters exist once it "
                             "has applied a step or `optimizer.build(model.trainable_variables)` was called.")
        return getattr(self, name)

    good_steps = property(lambda self: self._counter("step_counter"),
                          doc="Finite steps since the scale last changed (Keras's `step_counter`).")
    skipped_steps = property(lambda self: self._counter("_skipped_steps"),
                             doc="Steps skipped for non-finite gradients (an int64 variable).")
    hysteresis_left = property(lambda self: self._counter("_hysteresis_left"),
                               doc="Overflows left before the next back-off (an int64 variable).")
    overflow_counts = property(lambda self: self._counter("_overflow_counts"),
                               doc="Per trainable variable, how often its gradient was non-finite (int64).")
    min_scale_overflows = property(lambda self: self._counter("_min_scale_overflows"),
                                   doc="Overflows while the scale was already at `min_scale`.")
    current_growth_interval = property(lambda self: self._counter("_growth_interval_var"),
                                       doc="The growth interval in force (`LossScaleWarmup` changes it).")

    def overflow_report(self, top=None):
        """`(variable_path, count)` for the variables whose gradients were non-finite, most frequent first."""
        counts = self.overflow_counts
        return scaling.report([getattr(v, "path", None) or v.name for v in self._weights.variables], counts, top)

    def scale_loss(self, loss):
        """`loss * loss_scale` (what Keras's trainer calls); marks the step's gradients as scaled."""
        self._marks.scaled(loss)
        return keras.ops.multiply(loss, self.dynamic_scale if self.built else self.initial_scale)

    def get_scaled_loss(self, loss):
        """tf.keras's name for `scale_loss`, for TensorFlow's guide loop."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """tf.keras's name: each gradient divided by the scale, in float32; `apply` then takes them as given."""
        scale = self.loss_scale
        unscaled = [None if g is None else steps.unscale(g, scale) for g in grads]
        self._marks.unscaled(grads, unscaled)
        return unscaled

    def apply_gradients(self, grads_and_vars, scaled=None):
        """Applies `(gradient, variable)` pairs once, or skips the step if any is non-finite; see `apply`."""
        grads, variables = zip(*grads_and_vars)
        loss = self._marks.loss()
        scaled = steps.decide(self, self._marks, grads, variables, scaled, "apply_gradients")
        return self._apply_checked(list(grads), variables, scaled, loss)

    def apply(self, grads, trainable_variables=None, scaled=None):
        """Applies `grads` once, or skips the step if any is non-finite (one micro-batch under accumulation).

        Args:
            grads: one gradient (or None) per variable.
            trainable_variables: the variables; those it was built with by default.
            scaled: None (decided from the traced step), True (divide by the scale) or False (use as given).

        Returns:
            The optimizer's `iterations`.

        Example:
            >>> grads = opt.get_unscaled_gradients(tape.gradient(opt.scale_loss(loss), variables))
            >>> opt.apply(tf.clip_by_global_norm(grads, 1.0)[0], variables, scaled=False)
        """
        grads = list(grads)
        loss = self._marks.loss()
        scaled = steps.decide(self, self._marks, grads, trainable_variables, scaled, "apply")
        return self._apply_checked(grads, trainable_variables, scaled, loss)

    def flush(self):
        """Applies a partial accumulation, divided by the micro-batches summed (`fit` calls it at its end)."""
        if self.accumulation_steps == 1 or not self.built:
            return
        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(self.flush)
            return
        count = tf.convert_to_tensor(self._micro_step)
        self._finish(count > 0, tf.convert_to_tensor(self._window_nonfinite), count, self.loss_scale,
                     lambda skipped: None)  # outside any step: no forward pass wrote anything

    def track(self, model):
        """Names the model this optimizer trains: a skipped step puts back only its variables (a GAN's two).

        Args:
            model: a `keras.Model` or layer, or a list of variables (`fit` and custom loops need no call).

        Returns:
            The optimizer.

        Example:
            >>> g_opt = kmix.wrap(keras.optimizers.Adam(1e-3)).track(generator)
        """
        if not isinstance(model, keras.layers.Layer) and not (isinstance(model, (list, tuple)) and all(
                isinstance(v, (keras.Variable, tf.Variable)) for v in model)):
            raise TypeError("`track` takes a keras.Model (or layer) or a list of variables. Received: "
                            f"{model!r} (of type {type(model).__name__}).")
        variables = model.variables if isinstance(model, keras.layers.Layer) else model
        # A weak reference: saving walks the optimizer's attributes, and the model holds the optimizer.
        self._tracked = (weakref.ref(model) if isinstance(model, keras.Model)
                         else types.SimpleNamespace(variables=tuple(variables)))  # not tracked for saving
        return self

    def _tracked_model(self):
        return self._tracked() if isinstance(self._tracked, weakref.ref) else None

    def _apply_checked(self, grads, trainable_variables, scaled, loss=None):
        if not self.built:
            self.build(trainable_variables)
        variables = self._weights.variables if trainable_variables is None else list(trainable_variables)
        self._check_variables(grads, variables)
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise ValueError("apply() must be called in a replica context (inside `strategy.run`), not in the "
                             "cross-replica context.")
        if self._undecided and tf.inside_function():
            self._settle_in_step(grads)
        scale = tf.convert_to_tensor(self.dynamic_scale)
        reduce_here = allreduce.reduces_here(self.allreduce_dtype, ctx)
        if reduce_here and self.accumulation_steps == 1:
            grads = allreduce.all_reduce(grads, variables, self.allreduce_dtype, None if scaled else scale)
            scaled = True
        nonfinite = self._nonfinite(grads, variables)
        if ctx.num_replicas_in_sync > 1 and not reduce_here:
            nonfinite = ctx.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)  # every replica skips together
        finite = tf.equal(tf.reduce_sum(nonfinite), 0.0)
        divisor = scale if scaled and self._scaled() else None  # a fixed scale of 1: nothing to divide by
        unscaled = [g if g is None or getattr(v, "overwrite_with_gradient", False) else steps.unscale(g, divisor)
                    for g, v in zip(grads, variables)]
        model = self._tracked_model()  # else the variables given to `track`, or None
        only = getattr(self._tracked, "variables", None) if model is None else model.non_trainable_variables
        written = steps.Written(self._weights.variables, loss, only, enabled=self.restore_on_skip)
        self._written_in_last_trace = len(written)  # how many variables a skipped step puts back (tests)
        if self.accumulation_steps == 1:
            self._apply_if(finite, unscaled, variables)
            written.restore(tf.logical_not(finite))
            steps.warn_eager_skip(self, tf.logical_not(finite))
            self._record_step(finite, nonfinite, scale)
        else:
            self._add_micro_batch(finite, nonfinite, unscaled, variables, scale, written)
        return self.iterations

    def _check_variables(self, grads, variables):
        if len(grads) != len(variables):
            raise ValueError(f"Received {len(grads)} gradients for {len(variables)} variables; expected one "
                             "gradient (or None) per variable.")
        unknown = [getattr(v, "path", None) or v.name for v in variables if id(v) not in self._weights.index]
        if unknown:
            raise ValueError(f"{type(self).__name__} was built for other variables; received variables it does "
                             f"not know: {unknown[:5]}. Build it with every variable it will update.")

    def _nonfinite(self, grads, variables):
        """A float32 vector over the built variables: 1 where the gradient is non-finite."""
        slots = {self._weights.index[id(v)]: tf.reduce_all(tf.math.is_finite(allreduce.values_of(g)))
                 for g, v in zip(grads, variables) if g is not None}
        count = len(self._weights.variables)
        if not slots:
            return tf.zeros((count,), tf.float32)
        return tf.cast(tf.logical_not(tf.stack([slots.get(i, True) for i in range(count)])), tf.float32)

    def _apply_if(self, finite, unscaled, variables):
        steps.run_if(finite, functools.partial(self._weights.apply, self.inner_optimizer), unscaled, variables)

    def _record_step(self, finite, nonfinite, scale, active=None):
        """One step of the scale rule and the counters; nothing where `active` (a micro-batch) is False."""
        rule = scaling.ScaleRule(self._growth_interval_var, self.growth_factor, self.backoff_factor,
                                 self.hysteresis, *self._bounds, self.dynamic)
        before = scaling.ScaleState(scale, tf.convert_to_tensor(self.step_counter),
                                    tf.convert_to_tensor(self._hysteresis_left))
        after = rule.adjust(before, finite)
        zero = tf.constant(0, tf.int64)
        skipped = tf.where(finite, zero, 1)
        at_floor = tf.where(scale <= self._bounds[0], skipped, zero)
        overflowed = tf.cast(nonfinite > 0, tf.int64)
        if active is not None:
            after = scaling.ScaleState(*(tf.where(active, a, b) for a, b in zip(after, before)))
            skipped, at_floor = (tf.where(active, t, zero) for t in (skipped, at_floor))
            overflowed = tf.where(active, overflowed, tf.zeros_like(overflowed))
        self.dynamic_scale.assign(after.scale)
        self.step_counter.assign(tf.cast(after.good_steps, self.step_counter.dtype))
        self._hysteresis_left.assign(after.hysteresis_left)
        self._skipped_steps.assign_add(skipped)
        self._overflow_counts.assign_add(overflowed)
        self._min_scale_overflows.assign_add(at_floor)

    def finalize_variable_values(self, var_list):
        """Applies a pending partial accumulation, then the inner optimizer's finalization (EMA)."""
        self.flush()
        if self.built and self._weights.copies and all(id(v) in self._weights.index for v in var_list):
            self._weights.finalize(self.inner_optimizer, var_list)
            return
        super().finalize_variable_values(var_list)

    def save_own_variables(self, store):
        """Keras's state by position, and the layout of its opt level (`kmix.optimizers.saved_level`)."""
        super().save_own_variables(store)
        if self.built:
            self._saved.write(store)

    def load_own_variables(self, store):
        """Loads what `save_own_variables` wrote, converted from another opt level, or raises naming both."""
        if not self.built:
            super().load_own_variables(saved_level.without_record(store))  # Keras's warning: nothing to load into
            return
        self._saved.load(store, super().load_own_variables,
                         [self.dynamic_scale, self.step_counter, self._hysteresis_left, self._growth_interval_var])

    def get_config(self):
        """Every constructor argument as given (`"auto"` kept), so `from_config` rebuilds the same optimizer."""
        config = super().get_config()
        config.pop("dynamic_growth_steps")
        config.update({name: getattr(self, name) for name in _CONFIG}, master_weights=self._master_weights_request,
                      initial_scale=self._initial_request, dynamic=self._dynamic_request)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Re-creates the optimizer; also accepts configs of Keras's own class."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


_CONFIG = ("growth_interval", "growth_factor", "backoff_factor", "hysteresis", "min_scale", "max_scale",
           "accumulation_steps", "allreduce_dtype", "restore_on_skip", "fused_update")
