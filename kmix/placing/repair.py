"""The placed model called once (autocast's check): where two dtypes meet in a block, the plan gives way.

A block (a custom layer, a keras-hub transformer layer) combines its
sublayers' outputs with raw TensorFlow ops (`x * mask`, `a @ v`,
`x + residual`), which do not promote dtypes. Where one call of the placed
model raises a dtype error in a block that computes in half:

1. the float32 islands the rules made inside it (a norm that squares in
   half, a router) take the block's policy, as a model built under the half
   policy would have them: the block's raw arithmetic needs one dtype;
2. failing that (the clash is the block's own: a custom layer adding its
   float32 noise, or a layer the user named in `float32_layers`), the block
   and everything inside it compute in float32.

The call is one real call on made-up inputs (`trace.sample_inputs`; the
check against the twin compares its outputs), or, where the model cannot run
on those, its graph traced on open shapes. It is repeated until it runs
cleanly (at most `TRIES` times). An error that is not two dtypes meeting (a
`range` over an unknown length) is no verdict on the placement, and changes
nothing.
"""

import re

from kmix._tree import is_graph_model, resolved_policy, walk
from kmix.placing import place, trace
from kmix.placing.rules import Kind

TRIES = 8  # placements changed at most, one per symbolic call, before giving up


class Repaired:
    """What `repair` changed.

    Attributes:
        kept: `{id(layer): the error}` for the blocks kept in float32.
        relaxed: `{id(island): (id(block), the error)}` for the islands that
            took their block's policy.
    """

    def __init__(self):
        self.kept, self.relaxed = {}, {}

    def __bool__(self):
        return bool(self.kept or self.relaxed)

    def update(self, other):
        """Adds what another round of `repair` changed."""
        self.kept.update(other.kept)
        self.relaxed.update(other.relaxed)


def repair(model, specs, plan):
    """Calls `model` once and changes the placement where a dtype clash raises.

    Args:
        model: the placed model.
        specs: `trace.input_specs(model)`, or None (its graph parts are called).
        plan: the `rules.Plan` placed.

    Returns:
        `(Repaired, outputs)`: what changed, and the model's outputs on
        `trace.sample_inputs(specs)` from a clean last call on the placement as
        it now is (None where there is none).
    """
    rows = {id(row.layer): row for row in plan}
    repaired, outputs = Repaired(), None
    for unit, unit_specs in _traceable(model, specs):
        for _ in range(TRIES):
            traced = trace.trace(unit, unit_specs, eager=True)
            if traced.error is not None and not is_dtype_error(traced.error):
                traced = trace.trace(unit, unit_specs)  # made-up inputs it cannot run on: its graph, open shapes
            if traced.error is None and unit is model:
                outputs = traced.values
            block = traced.culprit
            if traced.error is None or block is None or id(block) in repaired.kept:
                break
            if block.compute_dtype == "float32" or not is_dtype_error(traced.error):
                break  # it fails in float32 too, or not for a dtype: not a placement's doing
            error = first_words(traced.error)
            islands = [
                sub for sub in plan.subtree(block)
                if id(sub) not in repaired.relaxed and sub.compute_dtype == "float32"
                and id(sub) in rows and rows[id(sub)].kind is Kind.ISLAND and rows[id(sub)].dtype == "float32"
            ]
            if islands:
                for island in islands:
                    place.set_policy(island, resolved_policy(block).name)
                    repaired.relaxed[id(island)] = (id(block), error)
                continue
            repaired.kept[id(block)] = error
            for sub in [block] + plan.subtree(block):
                place.set_policy(sub, "float32")
    return repaired, (outputs if not repaired else None)


def _traceable(model, specs):
    """`[(model or nested model, input specs)]` to call symbolically: the model, else its graph parts.

    A subclassed model never called on one input (keras.io's VAE, whose
    `train_step` calls its encoder and decoder) is checked through the
    outermost graph models inside it.
    """
    if specs is not None:
        return [(model, specs)]
    units, covered = [], set()
    for _, layer, parent in walk(model):  # parents come before the layers inside them
        if id(parent) in covered:
            covered.add(id(layer))
        elif is_graph_model(layer) and trace.input_specs(layer) is not None:
            units.append((layer, trace.input_specs(layer)))
            covered.add(id(layer))
    return units


def is_dtype_error(error):
    """Whether `error` is two dtypes meeting (what half precision can cause), not a shape or trace error."""
    message = str(error).split("Arguments received by")[0]  # Keras lists the call's arguments, dtypes and all
    return re.search(r"float16|bfloat16|half|float32|float64|dtype|DT_", message) is not None


def first_words(error):
    """The error's class and first line that says something (Keras starts with "Exception encountered")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")] or lines or [""]
    text = lines[0].replace("\x1b[1m", "").replace("\x1b[0m", "")
    return f"{type(error).__name__}: {text[:160]}"
