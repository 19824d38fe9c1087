"""The checks of `kmix.LossScaleOptimizer`'s constructor arguments, in one place.

Each bad value is a `TypeError` / `ValueError` that names the argument, what
was received and what is accepted (`kmix._checks` words them).
"""

import keras

from kmix import _checks as checks
from kmix.optimizers import allreduce, kahan
from kmix.optimizers import master_weights as mw

_INT64_MAX = 2**63 - 1  # the counters the step counts are compared with are int64 variables


def check(inner_optimizer, initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis,
          min_scale, max_scale, dynamic, master_weights, accumulation_steps, dynamic_growth_steps,
          allreduce_dtype):
    """The arguments in their canonical types, `"auto"` master weights resolved.

    Returns:
        `(initial_scale, growth_interval, growth_factor, backoff_factor,
        hysteresis, min_scale, max_scale, dynamic, master_weights,
        accumulation_steps, allreduce_dtype)`.
    """
    if dynamic_growth_steps is not None:
        if growth_interval not in (2000, dynamic_growth_steps):
            raise ValueError(
                "`dynamic_growth_steps` is Keras's name for `growth_interval`; pass only "
                f"one. Received: growth_interval={growth_interval!r}, "
                f"dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        growth_interval = _count("dynamic_growth_steps", dynamic_growth_steps)
    check_inner(inner_optimizer)
    initial_scale = checks.real("initial_scale", initial_scale, low=0.0, low_open=True)
    growth_interval = _count("growth_interval", growth_interval)
    growth_factor = checks.real("growth_factor", growth_factor, low=1.0, low_open=True)
    backoff_factor = checks.real(
        "backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True
    )
    hysteresis = _count("hysteresis", hysteresis)
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
    if initial_scale > max_scale:  # a fixed scale too: `kmix.wrap` makes it dynamic for a float16 model
        raise ValueError(
            "`initial_scale` must be <= `max_scale`, the cap of the loss scale, fixed or dynamic. Received: "
            f"initial_scale={initial_scale!r}, max_scale={max_scale!r}. Pass a larger `max_scale` as well."
        )
    if master_weights == "auto":
        master_weights = mw.auto_master_weights()
    elif master_weights == "kahan":
        kahan.check_inner(inner_optimizer)
    elif not isinstance(master_weights, bool):
        raise ValueError(
            "`master_weights` must be 'auto', True, False or 'kahan'. "
            f"Received: master_weights={master_weights!r}"
        )
    accumulation_steps = _count("accumulation_steps", accumulation_steps)
    allreduce_dtype = allreduce.check_dtype(allreduce_dtype)
    inner_steps = getattr(inner_optimizer, "gradient_accumulation_steps", None)
    if inner_steps:
        raise ValueError(
            "The inner optimizer accumulates gradients itself "
            f"(gradient_accumulation_steps={inner_steps}); under loss scaling a skipped "
            "micro-batch would silently drop out of its sum and bias the step. Received: "
            f"inner_optimizer.gradient_accumulation_steps={inner_steps!r}. Use "
            f"`kmix.wrap(opt, accumulation_steps={inner_steps})` on an optimizer without it."
        )
    return (initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale, max_scale,
            dynamic, master_weights, accumulation_steps, allreduce_dtype)


def _count(name, value):
    """`value` as an int in [1, 2**63 - 1]: a step count held in, or compared with, an int64 variable."""
    value = checks.integer(name, value)
    if value > _INT64_MAX:
        raise ValueError(
            f"`{name}` must be an int in [1, 2**63 - 1]: it is counted in an int64 variable. "
            f"Received: {name}={value!r}"
        )
    return value


def check_inner(inner):
    """Refuses a loss-scale optimizer (scaling twice) and anything that is not a Keras optimizer."""
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


def check_flag(name, value):
    """`value` if it is True or False; a `TypeError` naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return value


def resolve_variables(opt, grads, trainable_variables):
    """The variables `grads` belong to: those given, else those `opt` was built with; checked against `opt`."""
    variables = opt._model_variables if trainable_variables is None else list(trainable_variables)
    if len(grads) != len(variables):
        raise ValueError(
            f"Received {len(grads)} gradients for {len(variables)} variables; "
            "expected one gradient (or None) per variable."
        )
    unknown = [getattr(v, "path", None) or v.name for v in variables if id(v) not in opt._index]
    if unknown:
        raise ValueError(
            f"{type(opt).__name__} was built for other variables; received variables it "
            f"does not know: {unknown[:5]}. Build it with every variable it will update."
        )
    return variables
