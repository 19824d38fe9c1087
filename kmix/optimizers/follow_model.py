"""`kmix.wrap` follows the model it trains: float16 compute gets dynamic loss scaling.

`kmix.wrap` outside a float16 policy gives a fixed scale of 1 (bfloat16 and
float32 need none). A model placed by `kmix.autocast` records the compute
dtype of each variable's layer (`kmix.policy.advice`), and a model trained
by `fit` is known to the optimizer when it is built; so at build time:

```
half = float16 among the recorded compute dtypes of var_list, or among the
       compute dtypes of the model's layers that own trainable variables
if half and the scale is fixed:
    `dynamic` chosen by wrap from the policy -> dynamic, from the scale the caller gave,
                                                else the advised scale, else 2^15 (INFO log)
    `dynamic=False` from the caller, scale 1  -> kept; a warning says how to get scaling
if dynamic and wrap chose the initial scale (no `initial_scale=`):
    start from the scale kmix.autocast(..., sample=) advised for var_list, if any
```

Before `build` the variables are not known: `planned_scale` is the scale
advised under the policy `wrap` ran in (what `kmix.autocast(model, level,
sample=...)` recorded for that level), which is where `build` starts for
that model's variables.
"""

import logging
import warnings

from kmix.policy import advice
from kmix._tree import own_weights, walk

_log = logging.getLogger("kmix")
DEFAULT_SCALE = 2.0**15


def half_compute(var_list, model=None):
    """Whether `var_list` (or `model`'s layers that own trainable variables) compute in float16."""
    if "float16" in advice.compute_dtypes(var_list):
        return True
    if model is None:
        return False
    layers = [model] + [layer for _, layer, _ in walk(model)]
    return any(
        layer.compute_dtype == "float16" and any(w.trainable for w in own_weights(layer))
        for layer in layers
    )


def follow(optimizer, var_list, model=None):
    """Switches a fixed scale to dynamic loss scaling where the variables compute in float16.

    Called by `LossScaleOptimizer.build` before the scale variable exists.
    """
    if optimizer.dynamic:
        start_from_advice(optimizer, var_list)
        return
    if not half_compute(var_list, model):
        return
    from_wrap = getattr(optimizer, "_initial_scale_from_wrap", False)
    policy = getattr(optimizer, "_policy_name", None) or active_policy_name()
    advised = advice.initial_scale(var_list, policy) if from_wrap else None
    scale = advised or (DEFAULT_SCALE if from_wrap else optimizer.initial_scale)
    if getattr(optimizer, "_dynamic_from_policy", False):
        optimizer.dynamic = True
        optimizer.initial_scale = scale
        optimizer.max_scale = max(optimizer.max_scale, scale)
        optimizer.min_scale = min(optimizer.min_scale, scale)
        _log.info(
            "kmix: %s %r trains variables whose layers compute in float16, but was wrapped under a "
            "policy without float16 compute (fixed scale): switched to dynamic loss scaling from "
            "%g%s.", type(optimizer).__name__, optimizer.name, scale,
            " (the scale kmix.autocast advised)" if advised else "",
        )
        return
    if optimizer.initial_scale != 1.0:
        return  # a fixed scale the caller chose: loss scaling, as asked
    warnings.warn(
        f"{type(optimizer).__name__} {optimizer.name!r} trains variables whose layers compute in "
        "float16 with a fixed loss scale of 1, as its arguments ask (dynamic=False, "
        "initial_scale=1): small float16 gradients flush to zero. For dynamic loss scaling, "
        f"wrap the optimizer with `kmix.wrap(opt, dynamic=True, initial_scale={scale:g})`, or "
        "call `kmix.wrap(opt)` inside `kmix.policy_scope(level)`.",
        stacklevel=4,
    )


def planned_scale(optimizer):
    """The scale an unbuilt `optimizer` will start from, as far as is known before its variables are.

    `initial_scale`, or, for a dynamic scale `kmix.wrap` chose, the scale
    `kmix.autocast(..., sample=)` advised under the policy `wrap` ran in.
    """
    if optimizer.dynamic and getattr(optimizer, "_initial_scale_from_wrap", False):
        advised = advice.initial_scale(policy_name=getattr(optimizer, "_policy_name", None))
        if advised is not None:
            return advised
    return optimizer.initial_scale


def start_from_advice(optimizer, var_list):
    """A dynamic scale that `kmix.wrap` chose starts from the one advised for `var_list`.

    `kmix.autocast(model, level, sample=...)` records, for the copy's
    variables, the initial scale its diagnosis advises; an initial scale the
    caller gave (`kmix.wrap(opt, initial_scale=...)`) is kept. Only the
    variables' own advice counts: the scale advised for one model never
    starts another trained under the same level.
    """
    if not getattr(optimizer, "_initial_scale_from_wrap", False):
        return
    advised = advice.initial_scale(var_list)
    if advised is None or advised == optimizer.initial_scale:
        return
    optimizer.initial_scale = advised
    optimizer.max_scale = max(optimizer.max_scale, advised)
    optimizer.min_scale = min(optimizer.min_scale, advised)
    _log.info("kmix: %s %r starts its loss scale at %g, the scale kmix.autocast advised for its "
              "model's sample.", type(optimizer).__name__, optimizer.name, advised)


def active_policy_name():
    """The name of kmix's active policy (`kmix.Policy.name`), or None."""
    from kmix.policy import active_policy

    policy = active_policy()
    return None if policy is None else policy.name
