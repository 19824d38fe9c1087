"""`kmix.autocast(model)`: the user's own model, each layer placed by precision, in place.

One pipeline, read top to bottom in `autocast`, each step a module of this package:

1. plan (`rules`): the rules give every layer a policy, walking the layer
   tree once into rows `(path, layer, policy, reason)` (`rules.Plan`), with
   the float32 islands the user names and, with `sample=`, those a
   diagnosis of the sample finds, before anything runs in half;
2. place (`place`): each layer takes its policy on itself: no copy, no
   weights moved;
3. settle (`settle`): the model built from its config as
   `keras.models.load_model` builds it; the model in memory made to compute
   what that model computes (policy maps, the rebuilt graph's constants),
   checked bit for bit;
4. repair (`repair`): one symbolic call; where two dtypes meet in a block,
   the rules' islands inside it give way to the block, or the block goes
   float32; then settle again.
"""

import collections
import warnings

import keras
import numpy as np

from kmix.diagnose import islands
from kmix.placing import place, reload, repair, settle, trace
from kmix.policy import advice
from kmix._tree import is_graph_model, resolved_policy, walk
from kmix.placing.rules import Rules
from kmix.policy.policy import Policy

_ROUNDS = 3  # repair-and-settle rounds at most

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


def autocast(model, policy="O1", float32_layers=None, verbose=False, return_table=False, sample=None,
             copy=False):
    """Places each layer of `model` by precision, in place, and returns `model`.

    Like Apex's `amp.initialize`, it configures the model you have: each
    layer takes its policy on itself (Keras layers' settable `dtype_policy`),
    so your handles on the model and its layers (a `base_model` to unfreeze,
    a LoRA-enabled backbone, a subclassed model's attributes) stay valid, and
    Keras's compiled train / test / predict functions are reset to see it.
    Under a policy with half compute (O1, O2, `"mixed_float16"`, ...):

    - half (`policy.to_keras()`): `Dense`, `EinsumDense`, convolutions,
      `Embedding`, attention projections, and every layer not listed below;
    - kmix's safe classes: a `keras.layers.Softmax` becomes a
      `kmix.layers.Softmax` and a `keras.layers.MultiHeadAttention` a
      `kmix.layers.MultiHeadAttention` (the same object, weights and
      arguments; where they are layers of the model's graph);
    - float32: normalization layers (their variables too, batch-norm
      statistics included, under O2), `Activation("softmax")` /
      `Activation("log_softmax")` (and any layer whose `activation` is one
      of these), the layers producing the model's outputs (looking through
      `keras.ops` nodes and nested models; for a subclassed model, found by
      one symbolic call), `float32_layers`, and with `sample` the layers a
      diagnosis of the sample finds overflowing;
    - inside a block (a custom layer, a keras-hub transformer layer), a
      layer without variables follows its block, as the block makes it; a
      normalization computes its statistics in float32 (one that casts to
      float32 inside keeps the block's dtype with float32 variables, so its
      output still adds to the block's raw tensors; one that squares in
      half, keras-hub's `T5LayerNorm`, computes in float32).

    Under O2 / O3 the variables of half layers become half (the same
    variable objects); where that is not safe (a built optimizer holds
    state for them, or they were made under a `tf.distribute` strategy) a
    copy is placed instead, with a warning. Under a pure-half policy (O3,
    `"float16"`) every layer is half except `float32_layers`; under float32
    compute (O0) every layer is float32. `kmix.layers.WithPolicy` layers
    keep their policy.

    Two more float32 islands: the router of a mixture of experts (its
    softmax and top-k choose the experts; Mixtral, Qwen-MoE, GPT-OSS) and a
    sinusoidal timestep embedding (Flux, SD3).

    A layer whose `call` fails in half (a custom layer adding float32 noise
    with a raw TensorFlow op) is found by one symbolic call of the placed
    model and kept in float32, with one warning naming it; where the clash
    is a rule's island inside a block whose raw arithmetic needs one dtype,
    the island computes as its block instead. What trains is what reloads:
    the model is built from its config as `keras.models.load_model` builds
    it, blocks that re-create their layers get the placement in their dtype
    (a `keras.dtype_policies.DTypePolicyMap`, as keras-hub does for
    quantized layers), a layer its block makes with a dtype of its own
    computes so, the constants a constructor baked into a functional graph
    are taken as the reload makes them, and the two models must predict bit
    for bit the same. What a reload cannot rebuild (layers made without
    `dtype=` take the global policy when loaded) is named in one warning
    saying how to reload the model.

    Args:
        model: a built `keras.Model`: Sequential, functional, subclassed,
            nested, keras-hub backbones and tasks, with LoRA or custom
            layers (registered or not).
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes and/or layer names to keep in float32
            as well; a block's or nested model's name covers its inside. A
            path as the table's `layer` column shows it names one layer
            where several share a name (`"t5/decoder_0/self_attention"`).
        verbose: print the table of layer, class, policy before and after.
        return_table: also return the table (an `AutocastTable` of
            `Placement(layer, cls, before, after, reason)` rows).
        sample: a batch `(x, y)` (arrays, tensors, or lists / dicts of them),
            or a `tf.data.Dataset` whose first batch is used; `model` must
            be compiled with its loss. `kmix.diagnose` runs the float32
            model and its half-precision self on it first: the layers that
            overflow (or hold a `-1e9` mask) are kept in float32 (the table's
            `why` says `sample: ...`), and the initial loss scale it advises
            is recorded for the model's variables, so that `kmix.wrap(opt)`
            (without `initial_scale=`) starts from it when the optimizer is
            built. Ignored under float32 compute.
        copy: place and return a copy (as `keras.models.load_model` gives
            the model back, weights included), leaving `model` as it is.

    Returns:
        `model` itself (a copy with `copy=True`), or `(model, table)` with
        `return_table=True`. The global policy is left as it was: compile
        inside `kmix.policy_scope(policy)` so that `kmix.wrap` picks the
        loss scaling and master weights the policy needs.

    Raises:
        TypeError: for a `model` that is not a `keras.Model`.
        ValueError: for an unbuilt model, or a name in `float32_layers` that
            is no layer of the model.
        TypeError / ValueError: naming `sample`, for a sample that is not a
            batch `(x, y)` or a dataset, or a model not compiled with a loss.

    Example:

    >>> model = kmix.autocast(model, "O1", float32_layers=["logits"])   # the same object
    >>> with kmix.policy_scope("O1"):
    ...     model.compile(optimizer=kmix.wrap("adam"), loss="mse")
    >>> base_model.trainable = True       # your handles still reach the placed layers
    """
    policy = Policy(policy)
    _check_model(model)
    advised = islands.advise(model, policy, sample) if sample is not None else None
    given = float32_layers
    if advised is not None:
        float32_layers = islands.merge(float32_layers, list(advised.targets))
    rules = Rules(policy, float32_layers)
    specs = trace.input_specs(model, advised.x if advised is not None else None)
    plan = _plan(rules, model, specs)
    blocker = place.recast_blocker(model, plan)
    if copy or blocker:
        if blocker and not copy:
            warnings.warn(
                f"kmix.autocast({policy.name!r}) changes the dtype of model {model.name!r}'s variables, "
                f"and {blocker}: it placed a copy instead, which it returns. Train the returned model, "
                "or call autocast before compiling (or outside the strategy's scope).",
                stacklevel=2,
            )
        model = reload.copy_model(model)
        plan = _plan(rules, model, specs)
    before = {id(layer): (resolved_policy(layer).name, type(layer)) for _, layer, _, _ in plan}

    place.place(plan)
    settled = settle.settle(model, specs, rules.default.name)
    repaired = repair.Repaired()
    for _ in range(_ROUNDS):  # what repair changes, a reload must make too; settling may move a layer
        changed = repair.repair(model, specs, plan)
        if not changed:
            break
        repaired.update(changed)
        settled = settle.settle(model, specs, rules.default.name, settled.holders)
    _warn_repaired(repaired, plan)
    if advised is None and policy.compute_dtype == "float16":
        _check_finite_made_up(model, specs)
    settle.warn(model, settled, stacklevel=3)
    place.reset_compiled_functions(model)

    table = AutocastTable()
    for path, layer, _, reason in plan:
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
        table.append(Placement(path, cls, old, resolved_policy(layer).name, reason))
    if advised is not None:
        _explain(table, advised.targets, given)
        _check_finite(model, advised)
    # What kmix.wrap reads when the optimizer is built: compute dtypes, and the advised scale.
    advice.record_model(model, advised and advised.initial_scale, policy.name)
    if verbose:
        print(table)
    return (model, table) if return_table else model


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model={model!r} (of type {type(model).__name__})."
        )
    layers = [layer for _, layer, _ in walk(model)]
    # A subclassed model whose call is never used (keras.io's VAE trains its built encoder and
    # decoder in `train_step`) is placed through its built layers.
    if not model.built and not (layers and all(layer.built for layer in layers)):
        raise ValueError(
            f"`model` must be built, so that its layers have variables to place. Received: model "
            f"{model.name!r} ({type(model).__name__}), not built. Start it with `keras.Input(shape)`, "
            "call it on a batch, or call `model.build(input_shape)` first."
        )


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
    paths = {id(layer): path for path, layer, _, _ in plan}
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


def _check_finite_made_up(model, specs):
    """Warns where the float16 model's outputs are not finite on inputs made from its specs.

    Made-up inputs (ones for token ids, normal values) are no data, but a
    model overflowing on them (T5 squares activations past 65504; a block
    fills its mask with -1e9) overflows on real data too.
    """
    if specs is None:
        return
    try:
        with trace.untouched(model):
            outputs = keras.tree.flatten(model(trace.sample_inputs(specs), training=False))
    except Exception:  # noqa: BLE001  the model cannot run on made-up inputs: no verdict
        return
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


def _explain(table, targets, given):
    """The `why` of the rows the sample put in float32: `sample: <finding>`."""
    given = {item for item in islands.as_list(given) if isinstance(item, str)}
    for i, row in enumerate(table):
        if not row.reason.startswith("float32_layers"):
            continue
        parts = row.layer.split("/")
        for target, finding in targets.items():
            if target in given:
                continue
            own = row.layer == target or ("/" not in target and parts[-1] == target)
            inside = row.layer.startswith(target + "/") if "/" in target else target in parts[:-1]
            if own or inside:
                why = f"sample: {finding}" if own else f"sample: in {target}"
                table[i] = row._replace(reason=why + row.reason[len("float32_layers"):])
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
