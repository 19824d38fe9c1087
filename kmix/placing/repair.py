"""The placed model called once (autocast's repair): where two dtypes meet in a half block, the plan gives way.

A block adds raw tensors (`x + residual`), which do not promote dtypes: where a call raises a dtype error
in it, the rules' float32 islands inside take its policy; failing that, the whole block computes in float32.
"""

import collections

from kmix._tree import is_graph_model, resolved_policy
from kmix.placing import trace, write
from kmix.placing.rules import Kind

TRIES = 8  # placements changed at most, one per call, before giving up


Repaired = collections.namedtuple("Repaired", "kept relaxed")
Repaired.__doc__ = """What `repair` changed: `kept` {id(block): error} in float32, `relaxed`
{id(island): (id(block), error)}."""


def repair(model, plan, specs):
    """Calls `model` on made-up inputs (else traces it) and gives way where a dtype clash raises.

    Returns `(Repaired, outputs)`: what changed, and a clean call's outputs on the placement as it is (or None).
    """
    rows = {id(row.layer): row for row in plan}
    repaired, outputs = Repaired({}, {}), None
    for unit, unit_specs in _units(model, plan, specs):
        layers = [row.layer for row in plan] if unit is model else plan.subtree(unit)
        for _ in range(TRIES):
            traced = trace.trace(unit, layers, unit_specs, eager=True)
            if traced.error is not None and not trace.is_dtype_error(traced.error):
                traced = trace.trace(unit, layers, unit_specs)  # made-up inputs it cannot run on: its graph
            if traced.error is None and unit is model:
                outputs = traced.values
            block = traced.culprit
            if traced.error is None or block is None or id(block) in repaired.kept:
                break
            if block.compute_dtype == "float32" or not trace.is_dtype_error(traced.error):
                break  # it fails in float32 too, or not for a dtype: not the placement's doing
            error, outputs = trace.first_words(traced.error), None
            islands = [sub for sub in plan.subtree(block)
                       if id(sub) not in repaired.relaxed and sub.compute_dtype == "float32" and id(sub) in rows
                       and rows[id(sub)].kind is Kind.ISLAND and rows[id(sub)].dtype == "float32"]
            for island in islands:
                write.set_layer_policy(island, resolved_policy(block).name)
                repaired.relaxed[id(island)] = (id(block), error)
            if not islands:
                repaired.kept[id(block)] = error
                for sub in [block] + plan.subtree(block):
                    write.set_layer_policy(sub, "float32")
    return repaired, outputs


def _units(model, plan, specs):
    """`[(model, specs)]`, or for a subclassed model never called on one input, its outermost graph models'."""
    if specs is not None:
        return [(model, specs)]
    units, covered = [], set()
    for row in plan:  # parents come before the layers inside them
        if id(row.parent) in covered:
            covered.add(id(row.layer))
        elif is_graph_model(row.layer) and trace.input_specs(row.layer) is not None:
            units.append((row.layer, trace.input_specs(row.layer)))
            covered.add(id(row.layer))
    return units
