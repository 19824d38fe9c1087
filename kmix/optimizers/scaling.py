"""The loss scale: its rule as a pure function, the constructor's checks, and where an `"auto"` scale starts."""

import logging
import warnings
from typing import NamedTuple

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix import _state
from kmix.optimizers import saved_level, steps
from kmix.optimizers.updates import HALF

DEFAULT_SCALE = 2.0**15
AUTO = "auto"
_INT64_MAX = 2**63 - 1  # step counts live in int64 variables
_log = logging.getLogger("kmix")


class ScaleState(NamedTuple):
    """The scale (float32), finite steps since it last changed and overflows still tolerated (int64)."""

    scale: tf.Tensor
    good_steps: tf.Tensor
    hysteresis_left: tf.Tensor


class ScaleRule(NamedTuple):
    """How the scale reacts to one step's finite flag (torch's `GradScaler` at `hysteresis=1`, Megatron-LM's at 2).

        if not finite:  # the step is skipped
            good_steps = 0; hysteresis_left = max(hysteresis_left - 1, 0)
            if dynamic and hysteresis_left == 0: scale = max(scale * backoff_factor, min_scale)
        else:
            good_steps += 1
            if dynamic and good_steps >= growth_interval:
                good_steps = 0; hysteresis_left = hysteresis; scale = min(scale * growth_factor, max_scale)

    `growth_interval` may be an int64 variable (`LossScaleWarmup` lowers it; `>=` then grows at the next step).

    >>> ScaleRule(2000, 2.0, 0.5, 1, 1.0, 2.0**24).adjust(state, finite=False)
    """

    growth_interval: object
    growth_factor: float
    backoff_factor: float
    hysteresis: int
    min_scale: float
    max_scale: float
    dynamic: bool = True

    def adjust(self, state, finite):
        """The `ScaleState` after a step whose gradients were `finite` (a boolean scalar)."""
        finite = tf.convert_to_tensor(finite, tf.bool)
        scale = tf.convert_to_tensor(state.scale, tf.float32)
        good = tf.where(finite, tf.cast(state.good_steps, tf.int64) + 1, tf.constant(0, tf.int64))
        left_before = tf.cast(state.hysteresis_left, tf.int64)
        grow = tf.logical_and(tf.logical_and(finite, good >= tf.cast(self.growth_interval, tf.int64)), self.dynamic)
        left = tf.where(finite, tf.where(grow, tf.constant(self.hysteresis, tf.int64), left_before),
                        tf.maximum(left_before - 1, 0))
        if self.dynamic:
            backoff = tf.logical_and(tf.logical_not(finite), left <= 0)
            scale = tf.where(grow, tf.minimum(scale * self.growth_factor, self.max_scale), scale)
            scale = tf.where(backoff, tf.maximum(scale * self.backoff_factor, self.min_scale), scale)
        return ScaleState(scale, tf.where(grow, tf.zeros_like(good), good), left)


def count(name, value):
    """`value` as an int in [1, 2**63 - 1]: a step count held in, or compared with, an int64 variable."""
    value = checks.integer(name, value)
    if value > _INT64_MAX:
        raise ValueError(f"`{name}` must be an int in [1, 2**63 - 1]: it is counted in an int64 variable. "
                         f"Received: {name}={value!r}")
    return value


def check_scales(initial_scale, dynamic, min_scale, max_scale):
    """`(initial_scale, dynamic, min_scale, max_scale)` checked; `"auto"` kept for the first two."""
    if initial_scale != AUTO:
        initial_scale = checks.real("initial_scale", initial_scale, low=0.0, low_open=True)
    if dynamic != AUTO and not isinstance(dynamic, bool):
        raise TypeError(f"`dynamic` must be True, False or 'auto'. Received: dynamic={dynamic!r}")
    min_scale = checks.real("min_scale", min_scale, low=0.0, low_open=True)
    max_scale = checks.real("max_scale", max_scale, low=0.0, low_open=True, allow_inf=True)
    if min_scale > max_scale:
        raise ValueError(f"`min_scale` must be <= `max_scale`. Received: min_scale={min_scale!r}, "
                         f"max_scale={max_scale!r}")
    if initial_scale != AUTO and dynamic is True and not min_scale <= initial_scale <= max_scale:
        raise ValueError("`initial_scale` must lie within [min_scale, max_scale]. Received: "
                         f"initial_scale={initial_scale!r}, min_scale={min_scale!r}, max_scale={max_scale!r}")
    if initial_scale != AUTO and initial_scale > max_scale:
        raise ValueError("`initial_scale` must be <= `max_scale`, the cap of the loss scale, fixed or dynamic. "
                         f"Received: initial_scale={initial_scale!r}, max_scale={max_scale!r}. Pass a larger "
                         "`max_scale` as well.")
    return initial_scale, dynamic, min_scale, max_scale


def check_inner(inner):
    """Refuses a loss-scale optimizer (scaling twice), anything not a Keras optimizer, and Keras's accumulation."""
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError("`inner_optimizer` is already a LossScaleOptimizer; scaling twice would square the "
                         f"scale. Received: inner_optimizer={inner!r}. Use `kmix.wrap(opt)`, which re-wraps a "
                         "Keras LossScaleOptimizer's inner optimizer.")
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError("`inner_optimizer` must be a `keras.optimizers.Optimizer` instance. Received: "
                        f"inner_optimizer={inner!r} (of type {type(inner).__name__}). Use `kmix.wrap('adam')` "
                        "to create one from a name or a config.")
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if steps:
        raise ValueError(
            f"The inner optimizer accumulates gradients itself (gradient_accumulation_steps={steps}); under loss "
            "scaling a skipped micro-batch would silently drop out of its sum and bias the step. Received: "
            f"inner_optimizer.gradient_accumulation_steps={steps!r}. Use `kmix.wrap(opt, accumulation_steps={steps})` "
            "on an optimizer without it.")


def auto_master_weights():
    """`master_weights="auto"` under the active policy: off only for half parameters without masters (O3)."""
    policy = _state.active_policy()
    if policy is not None:
        return bool(policy.needs_master_weights) or policy.params_dtype not in HALF
    return keras.config.dtype_policy().variable_dtype not in HALF


def float16_evidence(var_list, model=None):
    """Whether `var_list` is float16, was placed to compute in float16, or `model`'s trained layers compute so."""
    if any(keras.backend.standardize_dtype(v.dtype) == "float16" for v in var_list):
        return True
    if any(p.compute_dtype == "float16" for p in _state.placed(var_list)):
        return True
    if model is None:
        return False
    from kmix._tree import own_weights, walk

    return any(layer.compute_dtype == "float16" and any(w.trainable for w in own_weights(layer))
               for layer in [model] + [layer for _, layer, _ in walk(model)])


def advised_scale(var_list):
    """The largest initial scale `kmix.autocast(..., sample=)` advised for `var_list`, or None."""
    scales = [p.initial_scale for p in _state.placed(var_list) if p.initial_scale is not None]
    return max(scales) if scales else None


class Settling:
    """How `kmix.LossScaleOptimizer` decides an `"auto"` scale (its own methods, kept here by topic)."""

    def _settle(self, float16, var_list):
        """Decides an `"auto"` scale: dynamic where the variables compute in float16, else fixed."""
        dynamic = float16 if self._dynamic_request == AUTO else self._dynamic_request
        advised = advised_scale(var_list)
        start = self._initial_request if self._initial_request != AUTO else (
            (advised or DEFAULT_SCALE) if dynamic else 1.0)
        self._undecided = self._undecided and not float16
        if dynamic and self._dynamic_request == AUTO:
            _log.info("kmix: %s %r trains variables that compute in float16: switched to dynamic loss scaling "
                      "from %g%s.", type(self).__name__, self.name, start, " (advised)" if advised else "")
        elif dynamic and advised and self._initial_request == AUTO:
            _log.info("kmix: %s %r starts its loss scale at %g, the scale kmix.autocast advised.",
                      type(self).__name__, self.name, start)
        elif float16 and not dynamic and start == 1.0:
            warnings.warn(
                f"{type(self).__name__} {self.name!r} trains variables whose layers compute in float16 with a "
                "fixed loss scale of 1, as its arguments ask (dynamic=False, initial_scale=1): small float16 "
                f"gradients flush to zero. For dynamic loss scaling, wrap the optimizer with `kmix.wrap(opt, "
                f"dynamic=True, initial_scale={advised or DEFAULT_SCALE:g})`, or call `kmix.wrap(opt)` "
                "inside `kmix.policy_scope(level)`.", stacklevel=5)
        self.dynamic, self.initial_scale = dynamic, start
        self._bounds = (min(self.min_scale, start), max(self.max_scale, start)) if dynamic else self._bounds

    def _settle_in_step(self, grads):
        """No float16 variables: the first traced step shows whether it computes in float16 (`"auto"` decides)."""
        self._undecided = False
        was_dynamic = self.dynamic
        if not steps.computes_in_float16(grads):
            return
        self._settle(True, self._weights.variables)
        if was_dynamic or not self.dynamic:
            return
        self._saved.layout = saved_level.Layout.of(self._weights.variables, self._weights.kind, True)
        with tf.init_scope():  # before the step runs; a scale restored from a checkpoint is kept
            if int(self.iterations) == 0:
                self.dynamic_scale.assign(self.initial_scale)


def report(paths, counts, top=None):
    """`(path, count)` rows with `count > 0`, most frequent first, then by path; the first `top` only."""
    if top is not None:
        top = checks.integer("top", top, minimum=0)
    counts = [int(c) for c in tf.convert_to_tensor(counts).numpy()]
    rows = sorted(((p, c) for p, c in zip(paths, counts) if c > 0), key=lambda row: (-row[1], row[0]))
    return rows if top is None else rows[:top]
