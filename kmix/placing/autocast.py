"""`kmix.autocast(model)`: the user's own model, each layer placed by precision, in place.

One pass, its stages read top to bottom in `_place`; only `write` writes to the model:

1. facts (`rules.gather`): the layer tree walked once, with what the rules read;
2. plan (`rules.Rules.plan`): a pure function of the facts: a policy and a reason per layer;
3. place (`write.place`): each layer takes its policy on itself;
4. twin (`write.write_maps`, `twin.build`): the blocks that re-create placed layers given maps of the
   placement, then the model serialized once and rebuilt as `load_model` rebuilds it, without weights;
   where a reload names layers anew, the twin's maps foresee it (`renaming`), and the maps are keyed by its paths;
5. settle (`twin.compare`, `write.settle`): what the model takes from its twin, read, then written;
6. repair (`repair.repair`): the model called once; where two dtypes meet in a block, the plan gives way (4-6 again);
7. check (`twin.check`): the twin, run on the model's own variables, predicts bit for bit what the
   model predicts, or a warning says why not; it only reads.
"""

import collections
import warnings

import keras
import numpy as np

from kmix import _checks, _compat, _preserved
from kmix._state import record_model
from kmix._tree import is_graph_model, own_weights, resolved_policy
from kmix.diagnose import islands
from kmix.placing import renaming, repair, trace, twin, write
from kmix.placing.records import record_model_level, warn_if_unscaled
from kmix.placing.rules import Kind, Rules, gather
from kmix.policy.policy import parse

_ROUNDS = 4  # placements twinned at most: the plan's, and one per repair that changed it

Placement = collections.namedtuple("Placement", "layer cls before after reason")
Placement.__doc__ = """One row of `autocast`'s table: a layer's path and class, its policy before and
after, and the rule that placed it."""


class AutocastTable(list):
    """The `Placement`s of an `autocast`, one per layer (nested ones by path), printed aligned by `str()`."""

    def __str__(self):
        header = Placement("layer", "class", "before", "after", "why")
        rows = [header] + list(self)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def moved(self):
        """The paths of the layers whose policy or class changed."""
        return [row.layer for row in self if row.before != row.after or "->" in row.cls]


@_compat.releases_custom_gradients
def autocast(model, policy="O1", float32_layers=None, verbose=False, return_table=False, sample=None,
             copy=False):
    """Places each layer of `model` by precision, in place (half matmuls, float32 islands); returns `model`.

    Each layer takes its policy on itself, as Apex's `amp.initialize` does; a twin rebuilt from the
    model's config without weights, run on the model's own variables, checks that a reload predicts
    bit for bit what trains, or a warning says why not. The rules and what a reload keeps:
    docs/guide.md, "Where an opt level's placement comes from".

    Args:
        model: a built `keras.Model` (Sequential, functional, subclassed, keras-hub).
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes, names or paths (as the table shows them) kept in float32,
            with everything inside them.
        verbose: print the table of layer, class, policy before and after, why.
        return_table: also return the table (an `AutocastTable` of `Placement`s).
        sample: a batch `(x, y)` or a `tf.data.Dataset`, for a model compiled with its loss: the
            layers `kmix.diagnose` finds overflowing on it stay float32, and `kmix.wrap` starts from
            the loss scale it advises.
        copy: place and return a copy (as `load_model` gives it back) instead.

    Returns:
        `model` itself (a copy with `copy=True`, or, with a warning, where its variables cannot change
        dtype in place), or `(model, table)` with `return_table=True`.

    Raises:
        TypeError / ValueError: naming `model`, `float32_layers` or `sample`.

    Example:

    >>> model = kmix.autocast(model, "O1", float32_layers=["logits"])   # the same object
    >>> with kmix.policy_scope("O1"):
    ...     model.compile(optimizer=kmix.wrap("adam"), loss="mse")
    """
    policy = parse(policy, "policy")
    _checks.built_model(model, layers_may_stand_in=True)
    advised = islands.advise(model, policy, sample) if sample is not None else None
    given = float32_layers if advised is None else islands.merge(float32_layers, list(advised.targets))
    rules = Rules(policy, given)
    specs = trace.input_specs(model, advised.x if advised is not None else None)
    # All or nothing: an error or an interrupt anywhere below puts the model back as it was.
    with _preserved.Preserved(model, saved="none", storage=True, undo="on_error") as kept:
        model, table = _place(model, rules, specs, copy, advised, float32_layers)
        record_model(model, advised and advised.initial_scale, policy.name)  # what kmix.wrap reads
        warn_if_unscaled(model, policy)
        if verbose:
            print(table)
        record_model_level(model)  # last: nothing after it can fail
        kept.commit()
    return (model, table) if return_table else model


def _place(model, rules, specs, copy, advised, float32_layers):
    """autocast's stages on the model (see the module); returns `(model, table)`."""
    plan = _plan(model, rules, specs)
    blocker = write.recast_blocker(model, plan)
    if blocker and not copy:
        warnings.warn(f"kmix.autocast({rules.policy.name!r}) changes the dtype of model {model.name!r}'s variables, "
                      f"and {blocker}: it placed a copy instead, which it returns. Train the returned model, "
                      "or call autocast before compiling (or outside the strategy's scope).", stacklevel=4)
    if copy or blocker:
        model = twin.copy_model(model)
        plan = _plan(model, rules, specs)
    before = {id(row.layer): (resolved_policy(row.layer).name, type(row.layer)) for row in plan}

    write.place(plan)
    repaired, built, outputs, holders = repair.Repaired({}, {}), None, None, write.stale_maps(plan)
    for round_ in range(_ROUNDS):  # one twin, and one more where the repair changes the plan
        built, holders = _twin(model, plan, built, holders)
        verdict, edits = twin.compare(model, built, rules.default.name)
        write.settle(model, edits)
        if round_ == _ROUNDS - 1:
            break  # the twin checked is the placement's own
        changed, outputs = repair.repair(model, plan, specs)  # on the model as a reload makes it
        repaired.kept.update(changed.kept)
        repaired.relaxed.update(changed.relaxed)
        if not (changed.kept or changed.relaxed):
            break
    twin.check(model, built, verdict, specs, outputs)

    _warn_kept(repaired, plan)
    if advised is None and rules.policy.compute_dtype == "float16" and specs is not None:
        _check_finite_made_up(model, specs, outputs)
    twin.warn(model, verdict, stacklevel=5)
    table = _table(plan, before, repaired, verdict)
    if advised is not None:
        _explain(table, plan, advised.targets, float32_layers)
        _check_finite(model, advised)
    return model, table


def _twin(model, plan, previous, holders):
    """The placement's `Twin`, and the blocks holding maps of it: one build, where its maps foresee a reload's names.

    The maps are keyed by the model's paths (and a `previous` twin's); where the twin names layers anew, its maps
    gave them the policies of the layers they rename (`renaming.TwinMaps`), and the maps are keyed by the twin's
    paths too. Where those give a path otherwise than the twin was given, the twin is built again from them.
    """
    layers = [row.layer for row in plan]
    before = write.write_maps(plan, previous and previous.model, holders)
    maps = renaming.TwinMaps(renaming.renamed_policies(plan)) if before.holders else None
    built = twin.build(model, layers, maps)
    if built.error is not None or maps is None:
        return built, before.holders
    after = write.write_maps(plan, built.model, before.holders) if maps.missed() else before
    if not maps.foresaw(before, after):
        built = twin.build(model, layers)  # a reload's names no map foresaw: the twin of the maps written
    return built, after.holders


def _plan(model, rules, specs):
    """`rules.plan` of the model's facts; a subclassed model's output layers found by a float32 call."""

    def outputs_of(layers):
        traced = trace.trace(model, layers, specs) if specs is not None else None
        if traced is not None and traced.error is None:
            return traced.outputs
        if rules.policy.output_dtype == "float32":
            warnings.warn(f"kmix.autocast could not tell which layers produce the outputs of {type(model).__name__} "
                          f"{model.name!r} (a subclassed model " + ("never called on a single input" if specs is None
                          else f"whose symbolic call raised {type(traced.error).__name__}") + "): they compute in "
                          "half. Name them in `float32_layers=[...]`, or pass `sample=(x, y)`.", stacklevel=7)
        return set()

    find = outputs_of if not is_graph_model(model) and rules.half_compute and not rules.pure else None
    return rules.plan(model, gather(model, rules, find))


def _table(plan, before, repaired, verdict):
    """The `AutocastTable`: each row's placement, and why (the plan's reason, what the checks changed)."""
    table = AutocastTable()
    for row in plan:
        layer, reason = row.layer, row.reason
        old, old_cls = before[id(layer)]
        cls = old_cls.__name__ + (f" -> kmix.layers.{type(layer).__name__}" if type(layer) is not old_cls else "")
        if id(layer) in repaired.kept:
            reason = f"fails in half: {repaired.kept[id(layer)]}"
        elif id(layer) in repaired.relaxed:
            reason = f"{reason}; its block mixes it with half tensors, so as its block"
        if id(layer) in verdict.adopted and verdict.adopted[id(layer)][1] != resolved_policy(layer).name:
            reason += f" (planned {verdict.adopted[id(layer)][1]}: its block makes it so)"
        if id(layer) in verdict.unplaced:
            reason += f" (a reload gives {twin.describe_policy(verdict.unplaced[id(layer)][3])})"
        own = resolved_policy(layer).variable_dtype
        fixed = [v.name for v in own_weights(layer)
                 if keras.backend.standardize_dtype(v.dtype) not in (own, "int32", "int64", "bool")]
        if fixed and own != "float32":
            reason += f"; {', '.join(fixed)} kept float32: the layer makes them so under any policy (as Keras's own)"
        table.append(Placement(row.path, cls, old, resolved_policy(layer).name, reason))
    return table


def _warn_kept(repaired, plan):
    """Warns of what the repair changed (blocks kept in float32, islands relaxed) and of variables too large."""
    paths, parts = {id(row.layer): row.path for row in plan}, []
    if repaired.kept:
        parts.append(f"kept {[paths.get(i, '?') for i in repaired.kept]} in float32: their `call` fails in half "
                     f"precision ({next(iter(repaired.kept.values()))}). To place them yourself, pass them in "
                     "`float32_layers`")
    if repaired.relaxed:
        parts.append(f"computes {[paths.get(i, '?') for i in repaired.relaxed]} as their blocks do, not in float32: "
                     f"the blocks combine their outputs with half tensors ({next(iter(repaired.relaxed.values()))[1]})")
    if parts:
        warnings.warn("kmix.autocast " + "; it ".join(parts) + ".", stacklevel=5)
    too_large = [row for row in plan if row.kind is Kind.TOO_LARGE]
    if too_large:
        warnings.warn(f"kmix.autocast kept {[row.path for row in too_large]} in float32: a variable of theirs is "
                      f"finite but beyond float16's largest value, 65504 ({too_large[0].reason}), and would become "
                      "inf in float16. They compute in float32; to place them in half, scale those weights down "
                      "first.", stacklevel=5)


def _check_finite_made_up(model, specs, outputs=None):
    """Warns where the float16 model's outputs (`outputs`, where known) are not finite on made-up inputs."""
    if outputs is None:
        outputs, _ = trace.call(model, specs)
    if outputs is None or _finite(outputs):  # None: the model cannot run on made-up inputs, no verdict
        return
    warnings.warn(f"kmix.autocast placed model {model.name!r} in float16, and its outputs are not finite on inputs "
                  "made from its input specs: a layer overflows float16's 65504 (or a mask constant becomes -inf). "
                  "Pass a batch, `kmix.autocast(model, policy, sample=(x, y))`, so that autocast diagnoses it and "
                  "keeps the overflowing layers in float32, or train in bfloat16 (`'O1-bfloat16'`).", stacklevel=5)


def _explain(table, plan, targets, given):
    """The `why` of the rows the sample put in float32: `sample: <finding>`."""
    given = {item for item in islands.as_list(given) if isinstance(item, str)}
    for i, (row, planned) in enumerate(zip(table, plan)):
        if planned.kind is not Kind.NAMED or not row.reason.startswith(planned.reason):
            continue  # not named, or kept in float32 by the repair
        parts = row.layer.split("/")
        for target, finding in targets.items():
            if target in given:
                continue
            own = row.layer == target or ("/" not in target and parts[-1] == target)
            inside = row.layer.startswith(target + "/") if "/" in target else target in parts[:-1]
            if own or inside:
                why = f"sample: {finding}" if own else f"sample: in {target}"
                table[i] = row._replace(reason=why + row.reason[len(planned.reason):])
                break


def _check_finite(model, advised):
    """Warns where the placed model's outputs on the sample are still non-finite."""
    if not _finite(model(advised.x, training=False)):
        warnings.warn(f"kmix.autocast(sample=...): the model's outputs on the sample are still non-finite after "
                      f"keeping {sorted(advised.targets)} in float32. Run "
                      "`print(kmix.diagnose(model, x, y, policy, float32_layers=[...]))` with those layers "
                      "to see what fails next, or train in bfloat16.", stacklevel=5)


def _finite(outputs):
    return all(np.all(np.isfinite(keras.ops.convert_to_numpy(o))) for o in keras.tree.flatten(outputs)
               if keras.backend.is_float_dtype(keras.backend.standardize_dtype(o.dtype)))
