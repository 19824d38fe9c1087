"""`kmix.autocast(model)`: the user's own model, each layer placed by precision, in place.

One loop, read top to bottom in `autocast`, each step a module of this package:

1. plan (`rules`): the rules give every layer a `rules.Row` (policy, `Kind`,
   reason), walking the layer tree once, with the float32 islands the user
   names and, with `sample=`, those a diagnosis of the sample finds;
2. place (`place`): each layer takes its policy on itself: no copy, no
   weights moved;
3. twin (`settle`): a twin of the placed model built from its config as
   `keras.models.load_model` builds it, without weights; the model made to
   compute what the twin computes (policy maps, the rebuilt graph's constants);
4. check (`repair`): one call of the placed model; where two dtypes meet in
   a block, the plan gives way (the rules' islands inside it, or the block
   goes float32), and step 3 again;
5. the twin, run on the model's own variables, must predict bit for bit
   what the model predicted in step 4 (`settle.compare`).
"""

import collections
import warnings

import keras
import numpy as np

from kmix import _compat
from kmix.diagnose import islands
from kmix.placing import place, reload, repair, settle, trace
from kmix.optimizers.late import warn_if_unscaled
from kmix.policy import advice
from kmix._tree import is_graph_model, own_weights, resolved_policy, walk
from kmix.placing.rules import Kind, Rules
from kmix.policy.policy import parse
from kmix import _checks, _preserved

_ROUNDS = 3  # checks that change the plan, at most, each followed by a new twin

Placement = collections.namedtuple("Placement", "layer cls before after reason")
Placement.__doc__ = """One row of `autocast`'s table: a layer's path and class, its policy
before and after, and the rule that placed it."""



class AutocastTable(list):
    """The rows (`Placement`s) of an `autocast`, printed as an aligned table by `str()`.

    One row per layer, nested layers included (their `layer` is a path such
    as `"transformer_layer_0/self_attention_layer/query"`).
    """

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

    Each layer takes its policy on itself, as Apex's `amp.initialize` does:
    half compute for matmuls, convolutions and embeddings; float32 for
    normalization, softmax, mixture-of-experts routers, timestep embeddings
    and the outputs (a `Dense` or convolution producing one computes its
    matmul in half and hands float32 out, where the model's config lists it;
    float32 otherwise), variables a layer makes float32 on purpose (LoRA)
    and layers with a variable beyond float16's range. A twin of the placed model is built
    from its config without weights and run on the model's own variables:
    the model is made to predict bit for bit what `keras.models.load_model`
    rebuilds, or a warning says why not. The rules, the table and what a
    reload keeps: docs/guide.md, "Where an opt level's placement comes from".

    Args:
        model: a built `keras.Model` (Sequential, functional, subclassed, keras-hub).
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes, names or paths (as the table shows
            them) to keep in float32 as well, with everything inside them.
        verbose: print the table of layer, class, policy before and after, why.
        return_table: also return the table (an `AutocastTable` of `Placement`s).
        sample: a batch `(x, y)` or a `tf.data.Dataset`, for a model compiled
            with its loss: the layers `kmix.diagnose` finds overflowing on it
            stay float32, and `kmix.wrap` starts from the loss scale it advises.
        copy: place and return a copy (as `load_model` gives it back) instead.

    Returns:
        `model` itself (a copy with `copy=True`, or where its variables
        cannot change dtype in place, with a warning), or `(model, table)`
        with `return_table=True`.

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
    # All or nothing: an error or an interrupt anywhere below puts the model back as it was
    # (policies, classes, graph nodes, variables' storage, compiled functions, call wrappers).
    with _preserved.Preserved(model, saved="none", storage=True, undo="on_error") as kept:
        model, table = _place(model, rules, specs, copy, advised, policy, float32_layers)
        advice.record_model(model, advised and advised.initial_scale, policy.name)  # what kmix.wrap reads
        warn_if_unscaled(model, policy)
        if verbose:
            print(table)
        kept.commit()
    return (model, table) if return_table else model


def _place(model, rules, specs, copy, advised, policy, float32_layers):
    """autocast's work on the model: plan, place, check and repair; returns `(model, table)`."""
    model, plan = _model_and_plan(model, rules, specs, copy)
    before = {id(row.layer): (resolved_policy(row.layer).name, type(row.layer)) for row in plan}

    place.place(plan)
    settled, repaired, outputs = settle.settle(model, specs, rules.default.name), repair.Repaired(), None
    for _ in range(_ROUNDS):  # check; where the plan gives way, a new twin for the new plan
        changed, outputs = repair.repair(model, specs, plan)
        if not changed:
            break
        repaired.update(changed)
        settled = settle.settle(model, specs, rules.default.name, settled.holders)
    settle.compare(model, settled, specs, outputs)

    _warn_repaired(repaired, plan)
    _warn_too_large(plan)
    if advised is None and policy.compute_dtype == "float16":
        _check_finite_made_up(model, specs, outputs)
    settle.warn(model, settled, stacklevel=3)
    place.reset_compiled_functions(model)
    table = _table(plan, before, repaired, settled)
    if advised is not None:
        _explain(table, plan, advised.targets, float32_layers)
        _check_finite(model, advised)
    return model, table


def _model_and_plan(model, rules, specs, copy):
    """The model to place (a copy with `copy`, or where its variables cannot change dtype) and its plan."""
    plan = _plan(rules, model, specs)
    blocker = place.recast_blocker(model, plan)
    if not (copy or blocker):
        return model, plan
    if blocker and not copy:
        warnings.warn(
            f"kmix.autocast({rules.policy.name!r}) changes the dtype of model {model.name!r}'s variables, "
            f"and {blocker}: it placed a copy instead, which it returns. Train the returned model, "
            "or call autocast before compiling (or outside the strategy's scope).",
            stacklevel=3,
        )
    model = reload.copy_model(model)
    return model, _plan(rules, model, specs)


def _table(plan, before, repaired, settled):
    """The `AutocastTable`: each row's placement, and why (the plan's reason, what the checks changed)."""
    table = AutocastTable()
    for row in plan:
        layer, reason = row.layer, row.reason
        old, old_cls = before[id(layer)]
        cls = old_cls.__name__
        if type(layer) is not old_cls:
            cls += f" -> kmix.layers.{type(layer).__name__}"
        if id(layer) in repaired.kept:
            reason = f"fails in half: {repaired.kept[id(layer)]}"
        elif id(layer) in repaired.relaxed:
            reason = f"{reason}; its block mixes it with half tensors, so as its block"
        if id(layer) in settled.adopted and settled.adopted[id(layer)][1] != resolved_policy(layer).name:
            reason += f" (planned {settled.adopted[id(layer)][1]}: its block makes it so)"
        if id(layer) in settled.unplaced:
            reason += f" (a reload gives {settle.describe_policy(settled.unplaced[id(layer)][2])})"
        own = resolved_policy(layer).variable_dtype
        fixed = [v.name for v in own_weights(layer) if keras.backend.standardize_dtype(v.dtype) not in (own, "int32", "int64", "bool")]
        if fixed and own != "float32":
            reason += f"; {', '.join(fixed)} kept float32: the layer makes them so under any policy (as Keras's own)"
        table.append(Placement(row.path, cls, old, resolved_policy(layer).name, reason))
    return table


def _plan(rules, model, specs):
    """`rules.plan(model)`; a subclassed model's output layers found by a float32 symbolic call."""
    outputs = None
    if not is_graph_model(model) and rules.half_compute and not rules.pure:
        traced = trace.trace(model, specs) if specs is not None else None
        if traced is not None and traced.error is None:
            outputs = traced.outputs
        elif rules.policy.output_dtype == "float32":
            warnings.warn(
                f"kmix.autocast could not tell which layers produce the outputs of {type(model).__name__} "
                f"{model.name!r} (a subclassed model " + ("never called on a single input" if specs is None
                else f"whose symbolic call raised {type(traced.error).__name__}") + "): they compute in "
                "half. Name them in `float32_layers=[...]`, or pass `sample=(x, y)`.",
                stacklevel=3,
            )
            outputs = set()
    return rules.plan(model, outputs)


def _warn_repaired(repaired, plan):
    """One warning naming what the symbolic call changed: blocks kept in float32, islands relaxed."""
    if not repaired:
        return
    paths = {id(row.layer): row.path for row in plan}
    parts = []
    if repaired.kept:
        parts.append(
            f"kept {[paths.get(i, '?') for i in repaired.kept]} in float32: their `call` fails in half "
            f"precision ({next(iter(repaired.kept.values()))}). To place them yourself, pass them in "
            "`float32_layers`"
        )
    if repaired.relaxed:
        parts.append(
            f"computes {[paths.get(i, '?') for i in repaired.relaxed]} as their blocks do, not in float32: "
            f"the blocks combine their outputs with half tensors ({next(iter(repaired.relaxed.values()))[1]})"
        )
    warnings.warn("kmix.autocast " + "; it ".join(parts) + ".", stacklevel=3)


def _warn_too_large(plan):
    """One warning naming the layers kept in float32 because a variable of theirs does not fit float16."""
    rows = [row for row in plan if row.kind is Kind.TOO_LARGE]
    if rows:
        warnings.warn(
            f"kmix.autocast kept {[row.path for row in rows]} in float32: a variable of theirs is finite but "
            f"beyond float16's largest value, 65504 ({rows[0].reason}), and would become inf in float16. "
            "They compute in float32; to place them in half, scale those weights down first.",
            stacklevel=4,
        )


def _check_finite_made_up(model, specs, outputs=None):
    """Warns where the float16 model's outputs are not finite on inputs made from its specs.

    Made-up inputs (ones for token ids, normal values) are no data, but a
    model overflowing on them (T5 squares activations past 65504; a block
    fills its mask with -1e9) overflows on real data too. `outputs`: the
    check's, on those inputs, where it ran on the placement as it is.
    """
    if specs is None:
        return
    try:
        if outputs is None:
            with trace.untouched(model):
                outputs = model(trace.sample_inputs(specs), training=False)
    except Exception:  # noqa: BLE001  the model cannot run on made-up inputs: no verdict
        return
    outputs = keras.tree.flatten(outputs)
    floats = [keras.ops.convert_to_numpy(o) for o in outputs
              if keras.backend.is_float_dtype(keras.backend.standardize_dtype(o.dtype))]
    if all(np.all(np.isfinite(o)) for o in floats):
        return
    warnings.warn(
        f"kmix.autocast placed model {model.name!r} in float16, and its outputs are not finite on inputs "
        "made from its input specs: a layer overflows float16's 65504 (or a mask constant becomes -inf). "
        "Pass a batch, `kmix.autocast(model, policy, sample=(x, y))`, so that autocast diagnoses it and keeps "
        "the overflowing layers in float32, or train in bfloat16 (`'O1-bfloat16'`).",
        stacklevel=3,
    )


def _explain(table, plan, targets, given):
    """The `why` of the rows the sample put in float32: `sample: <finding>`."""
    given = {item for item in islands.as_list(given) if isinstance(item, str)}
    for i, (row, planned) in enumerate(zip(table, plan)):
        if planned.kind is not Kind.NAMED or not row.reason.startswith(planned.reason):
            continue  # not named, or kept in float32 by the check
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
    outputs = keras.tree.flatten(model(advised.x, training=False))
    if all(np.all(np.isfinite(keras.ops.convert_to_numpy(o))) for o in outputs):
        return
    warnings.warn(
        f"kmix.autocast(sample=...): the model's outputs on the sample are still non-finite after "
        f"keeping {sorted(advised.targets)} in float32. Run "
        "`print(kmix.diagnose(model, x, y, policy, float32_layers=[...]))` with those layers "
        "to see what fails next, or train in bfloat16.",
        stacklevel=3,
    )
