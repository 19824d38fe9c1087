"""`kmix.recommend()`: the fastest safe policy and compilation, measured on this device or on your model.

With a model and a batch of its data, `recommend` times the model's own
training step on each candidate route (`kmix.route.trials`); without one it
times a transformer MLP (`kmix.device.probe`). Either way the timings are
interleaved rounds, and the decision is a pure function of them
(`kmix.route.rule.choose`, which states the rule); this module turns it
into a `Recommendation` whose reasons quote the figures.

bfloat16 is preferred over float16: it has float32's range, so it needs no
loss scaling and does not overflow. The half policy is Apex's O1 with that
dtype (`kmix.autocast` places matmuls in it and keeps normalization,
softmax and the model's outputs in float32), spelled as
`kmix.Policy(...).name` spells it, a string every kmix entry point accepts.
"""

import dataclasses
import time

from kmix._output import progress
from kmix.route import data, facts, timing, trials
from kmix.route.probe import DTYPES
from kmix.route.probe import probe as measure_probe
from kmix.route.rule import FLOAT16_MARGIN, MIN_SPEEDUP, choose


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The route `kmix.recommend` picks, with the measured reasons.

    Attributes:
        policy: `"O1-bfloat16"`, `"O1-float16"` or `"float32"`: a spec that
            `kmix.autocast`, `kmix.policy_scope` and `kmix.set_policy`
            accept as it is (and that `kmix.wrap`, called in its scope,
            follows). O1: half matmuls; normalization, softmax and the
            model's outputs in float32 (Keras's `mixed_<half>` plus float32
            outputs).
        jit_compile: the `jit_compile` to pass to `model.compile`.
        reasons: lines that quote the measured figures and the device facts.
        loss_scaling: whether the policy needs a dynamic loss scale (float16).
        probe: the `kmix.device.Probe` measured (the decision's figures
            without a model; which half dtypes to try on a model).
        table: with a model, the `RouteTable` of its training step on each
            route (None otherwise).

    `print(rec)` shows the route, the reasons and the table.
    """

    policy: str
    jit_compile: bool
    reasons: tuple
    loss_scaling: bool
    probe: object = None
    table: object = None

    def __str__(self):
        lines = [f"Recommended: policy {self.policy!r}, jit_compile={self.jit_compile}"]
        lines += [f"  - {reason}" for reason in self.reasons]
        if self.table is not None:
            lines.append(str(self.table))
        return "\n".join(lines)


def recommend(model=None, x=None, y=None, *, sample=None, batch_size=None, loss=None, optimizer=None,
              dtypes=None, budget_s=30.0, probe=None, verbose=True):
    """Measures the fastest safe policy and `jit_compile`: on your model's training step, or on this device.

    With a model and data it times the model's own training step on each
    candidate route, as the README builds it (`kmix.autocast`, compiled in
    `kmix.policy_scope(policy)` with `kmix.wrap` and `jit_compile`), in
    interleaved rounds of `train_on_batch` on one batch, and returns the
    fastest by the rule of `kmix.route.rule`: a half route wins when it is
    faster than float32 beyond the measured noise, or, where the rounds
    cannot separate them, by more than 3% in the median (the reasons say so).
    The candidates are float32 and each half dtype the device's probe ran at
    least 0.85x as fast as float32, each as a `tf.function` and under XLA.
    Every route runs on the model's own variables with one optimizer state
    (`kmix.route.inplace`): no copy of the weights; `model` is left exactly
    as it was (layers, policies, weights bit for bit, its optimizer and
    compiled functions).

    Args:
        model: a built Keras model; compiled with its loss (and optimizer),
            or pass `loss=` (and `optimizer=`). Without data, only the size
            of the probe comes from it (its dense kernels).
        x, y: training data: arrays (the first `batch_size` rows are
            timed), or `x` a `tf.data.Dataset` of `(x, y)` batches (its first batch).
        sample: instead of `x`, `y`: one batch `(x, y)` or a dataset.
        batch_size: rows of `x`, `y` per step; 32 by default (as `fit`).
        loss, optimizer: override the model's compiled ones (the optimizer's
            settings are copied for every route; `"adam"` if none).
        dtypes: the dtypes to time, e.g. `("float32", "bfloat16")`,
            instead of the probe's choice.
        budget_s: seconds for the whole call, probing, building and
            compiling included (a positive number). A route is built only
            where its build and 5 rounds of every route
            (`kmix.route.trials.MIN_ROUNDS`) fit in what is left; the
            reasons name the routes the budget could not cover, and the
            recommendation comes from those measured. Where not even one
            route's build fits (estimated from one forward pass on the
            batch: `kmix.route.trials.build_estimate`), nothing is built and
            this device's probe decides; the reasons say so. The routes whose
            comparisons stay unsettled get more rounds while it lasts.
        probe: a `kmix.device.Probe` to use instead of measuring one.
        verbose: progress lines on stderr while it measures.

    Returns:
        A `Recommendation` (`policy`, `jit_compile`, `reasons`, and with a
        model and data the `table` of routes).

    Example:

    >>> rec = kmix.recommend(model, x=x_train, y=y_train, budget_s=30)
    >>> print(rec)                    # the route, why, and the table of routes
    >>> fast = kmix.autocast(model, rec.policy)
    >>> with kmix.policy_scope(rec.policy):
    ...     fast.compile(optimizer=kmix.wrap("adamw"), loss="mse", jit_compile=rec.jit_compile)
    """
    start = time.perf_counter()
    budget_s = _check_budget(budget_s)
    has_data = x is not None or y is not None or sample is not None
    if model is None or not has_data:
        if probe is None:
            if verbose:
                progress("kmix.recommend: probing this device (a transformer MLP's training step)")
            probe = measure_probe(None if model is None else model_shape(model))
        rec = decide(probe, facts.gpus(), facts.cpu_features(), facts.onednn_enabled())
        if model is not None:
            note = ("Sized from the model's dense layers, not timed on it: pass x=, y= (or sample=) to time "
                    "your own training step on each route.")
            rec = dataclasses.replace(rec, reasons=rec.reasons + (note,))
        return rec
    loss, optimizer = trials.training_setup(model, loss, optimizer)
    batch = trials.first_batch(x, y, sample, batch_size)
    data.check_fits(model, batch[0], "sample" if sample is not None else "x")
    notes = data.nonfinite_notes(batch, "sample" if sample is not None else None)
    if dtypes is None:
        if probe is None:
            if verbose:
                progress("kmix.recommend: probing this device for the half dtypes worth timing")
            probe = measure_probe()
        dtypes, skipped = trials.candidates(probe)
    else:
        dtypes, skipped = trials.check_dtypes(dtypes), ()
    routes = [(_policy(d), jit) for d in dtypes for jit in (False, True)]
    gpus = facts.gpus()
    build, forward = trials.build_estimate(model, batch[0])
    left = budget_s - (time.perf_counter() - start)
    if build > left:  # not even one route fits: what this device's probe measured decides
        if probe is None:
            probe = measure_probe(model_shape(model))
        rec = decide(probe, gpus, facts.cpu_features(), facts.onednn_enabled())
        note = (f"budget_s={budget_s:g} cannot cover timing one route on the model: a forward pass on the batch "
                f"took {forward:.1f} s, so a route's build and compile take about {build:.0f} s, and "
                f"{max(left, 0):.0f} s were left. Recommended from this device's probe instead (above); a "
                f"budget_s of about {build * (len(routes) + 1) + (time.perf_counter() - start):.0f} s times "
                "every route on the model.")
        return dataclasses.replace(rec, reasons=rec.reasons + (note,) + tuple(notes))
    table = trials.time_routes(model, batch, loss, optimizer, routes, budget_s, verbose,
                               default_jit=bool(gpus), start=start)
    table = dataclasses.replace(table, skipped=tuple(skipped))
    rec = decide_routes(table, probe, gpus, facts.cpu_features(), facts.onednn_enabled())
    return dataclasses.replace(rec, reasons=rec.reasons + tuple(notes)) if notes else rec


def _check_budget(budget_s):
    """`budget_s` as a float, or a ValueError naming it."""
    ok = isinstance(budget_s, (int, float)) and not isinstance(budget_s, bool) and 0 < budget_s < float("inf")
    if not ok:
        raise ValueError("`budget_s` must be a positive number of seconds (e.g. 30). "
                         f"Received: budget_s={budget_s!r}")
    return float(budget_s)


def _policy(dtype):
    return "float32" if dtype == "float32" else f"O1-{dtype}"


def model_shape(model):
    """`(m, k, n)` for the probe from a model's dense kernels, or None when it has none."""
    ins, outs = [], []
    for variable in model.trainable_variables:
        shape = tuple(variable.shape)
        if len(shape) == 2 and "kernel" in variable.path.rsplit("/", 1)[-1]:
            ins.append(shape[0])
            outs.append(shape[1])
    if not ins:
        return None
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return (1024, min(max(median(ins), 16), 8192), min(max(median(outs), 16), 8192))


def decide(probe, gpus, cpu, onednn=None):
    """The recommendation from the MLP probe and the device facts (pure).

    Args:
        probe: a `kmix.device.Probe`.
        gpus: `kmix.device.gpus()`: dicts with `name`, `compute_capability`.
        cpu: `kmix.device.cpu_features()`.
        onednn: whether oneDNN is on (None: unknown).

    Returns:
        A `Recommendation`.
    """
    choice = choose(probe.times(), bool(gpus), MIN_SPEEDUP, FLOAT16_MARGIN, tie="float32")
    (dtype, jit), (_, ref_jit) = choice.route, choice.reference
    reasons = [facts.describe(gpus, cpu, onednn)]
    reasons.append(
        f"Measured on {probe.device} ({_shape(probe)}), GFLOP/s as tf.function / XLA: "
        + "; ".join(f"{d} {_g(probe.rate(d, False))} / {_g(probe.rate(d, True))}" for d in DTYPES)
        + "."
    )
    f32 = probe.rate("float32", ref_jit)
    if dtype == "float32":
        halves = [f"{h} {g.ratio:.2f}x (noise {g.noise:.0%})" for h, g in choice.gains.items()]
        reasons.append(
            f"No half dtype is {MIN_SPEEDUP}x faster than float32's best ({_g(f32)} GFLOP/s) beyond the "
            f"noise ({', '.join(halves) or 'none timed'}): float32, which has no rounding or overflow to manage."
        )
    elif dtype == "bfloat16":
        gain, noise = choice.gains["bfloat16"].ratio, choice.gains["bfloat16"].noise
        reasons.append(
            f"bfloat16 runs {gain:.2f}x float32's best (noise {noise:.0%}){_vs_float16(probe)}: O1 with "
            "bfloat16 (float32's range: no loss scaling; kmix.wrap keeps a fixed scale of 1 and still "
            "skips non-finite steps)."
        )
    else:
        gain, noise = choice.gains["float16"].ratio, choice.gains["float16"].noise
        versus = probe.best("float16")[0] / max(probe.best("bfloat16")[0], 1e-9)
        reasons.append(
            f"float16 runs {gain:.2f}x float32's best (noise {noise:.0%}) and {versus:.2f}x bfloat16's: O1 "
            "with float16, which needs loss scaling: compile with kmix.wrap(optimizer) and keep softmax and "
            "masks in float32 (kmix.autocast does)."
        )
    rate = lambda c: f"{_g(probe.rate(*c))} GFLOP/s"  # noqa: E731
    reasons.append(_compilation_line(choice.route, probe.times(), rate, bool(gpus))
                   + _xla_note(dtype, jit, gpus, onednn))
    return _recommendation(dtype, jit, reasons, probe)


def decide_routes(table, probe, gpus, cpu, onednn=None, tie="median"):
    """The recommendation from the trials of the user's model (pure; the rule is `kmix.route.rule`'s).

    Args:
        table: a `RouteTable` from `kmix.route.trials.time_routes`.
        probe: the `kmix.device.Probe` that chose the candidates, or None.
        gpus, cpu, onednn: the device facts, as for `decide`.
        tie: what decides a half route the rounds could not separate from
            float32 (`kmix.route.rule.choose`): `"median"`, the default, or
            `"float32"` (`bench recommend` measures both).

    Returns:
        A `Recommendation` whose `table` marks the route chosen.
    """
    times = table.times()
    choice = choose(times, bool(gpus), 1.0, 1.0, tie=tie)
    index = {(r.dtype, r.jit_compile): i for i, r in enumerate(table.routes)}
    table = dataclasses.replace(table, chosen=index[choice.route], reference=index[choice.reference])
    (dtype, jit), ref = choice.route, table.routes[index[choice.reference]]
    ms = lambda c: f"{timing.median(times[c]) * 1e3:.2f} ms"  # noqa: E731
    counts = sorted({len(r.seconds) for r in table.routes})
    shown = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    reasons = [facts.describe(gpus, cpu, onednn),
               f"Timed your model's training step on {table.batch}: {len(table.routes)} routes, "
               f"{shown} interleaved rounds each (the table below)."]
    floor = f"{timing.NOISE_FLOOR:.0%}"
    if dtype == "float32":
        halves = [f"{_policy(h)}, {_compiled(g.route[1])} {g.ratio:.2f}x ({_interval(g)})"
                  for h, g in choice.gains.items()]
        reasons.append(f"No half route beats float32's reference route ({_reference(ref, times)}) beyond "
                       f"the measured noise and by more than {floor} "
                       f"({'; '.join(halves) or 'none timed'}): float32.")
    else:
        g = choice.gains[dtype]
        scaling = ("no loss scaling" if dtype == "bfloat16" else
                   "with a dynamic loss scale: compile with kmix.wrap(optimizer)")
        if g.beyond_noise:
            why = f"beyond the measured noise ({g.noise:.0%})"
        else:
            why = (f"faster in the median by more than {floor}, though the rounds could not separate "
                   f"them beyond the noise ({_interval(g)}): the tie rule picks the faster median")
        reasons.append(f"{_policy(dtype)} runs {g.ratio:.2f}x float32's reference route "
                       f"({_reference(ref, times)}), {why}: {scaling}.")
    undecided = [h for h, g in choice.gains.items() if not g.settled]
    if undecided and dtype == "float32":
        kept = ("the tie rule (tie='float32') keeps float32" if choice.tie else
                f"none is more than {floor} faster in the median, so float32 is kept (no rounding for nothing)")
        reasons.append(f"The rounds could not separate {', '.join(_policy(h) for h in undecided)} from float32 "
                       f"beyond the noise: {kept}. A longer budget_s, or a quieter machine, may settle it.")
    reasons.append(_compilation_line(choice.route, times, lambda c: f"{ms(c)} a step", bool(gpus)))
    if table.over_budget:
        first = max(table.routes, key=lambda r: r.setup_s)
        reasons.append(f"budget_s={table.budget_s:g} could not cover building and compiling "
                       f"{'; '.join(label for label, _ in table.over_budget)} (building and compiling "
                       f"{first.label} took {first.setup_s:.1f} s): recommended from the {len(table.routes)} "
                       "route(s) measured. A larger budget_s times them too.")
    return _recommendation(dtype, jit, reasons, probe, table)


def _reference(route, times):
    """The float32 reference route as the table marks it, and why it is the one every ratio divides."""
    step = f"{timing.median(times[(route.dtype, route.jit_compile)]) * 1e3:.2f} ms a step"
    other = (route.dtype, not route.jit_compile)
    if other not in times:
        return f"{route.label}, {step}, the only float32 route timed"
    ratio = timing.paired(times[other], times[(route.dtype, route.jit_compile)])[0]
    if ratio > 1 + timing.NOISE_FLOOR:
        return f"{route.label}, {step}, {ratio:.2f}x the other compilation round by round"
    return (f"{route.label}, {step}: Keras's default compilation, within {timing.NOISE_FLOOR:.0%} of "
            f"{_compiled(not route.jit_compile)} round by round ({ratio:.2f}x)")


def _interval(gain):
    """`"between 0.95x and 1.30x round by round"`: a ratio's confidence interval."""
    return f"between {gain.low:.2f}x and {gain.high:.2f}x round by round, at least {timing.CONFIDENCE:.0%} each side"


def _recommendation(dtype, jit, reasons, probe, table=None):
    policy = _policy(dtype)
    return Recommendation(policy, bool(jit), tuple(reasons), dtype == "float16", probe, table)


def _compiled(jit):
    return "XLA" if jit else "tf.function"


def _compilation_line(route, times, shown, gpu):
    """Why `route`'s compilation: its figure against the other one's, round by round."""
    (dtype, jit), other = route, (route[0], not route[1])
    if other not in times:
        return f"{dtype} timed as {_compiled(jit)} only ({shown(route)}): jit_compile={jit}."
    ratio = timing.paired(times[other], times[route])[0]
    why = (f"{ratio:.2f}x round by round" if ratio > 1 + timing.NOISE_FLOOR else
           f"{ratio:.2f}x round by round, within {timing.NOISE_FLOOR:.0%}: Keras's default, {_compiled(gpu)}")
    return (f"{dtype} as {_compiled(jit)}: {shown(route)} against {shown(other)} as {_compiled(not jit)} "
            f"({why}): jit_compile={jit}.")


def _g(rate):
    """A rate in GFLOP/s as printed: whole numbers, or 2 significant digits below 10."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def _shape(probe):
    m, k, n = probe.shape
    rows = probe.rows or m
    return f"training step of an MLP x + gelu(x @ w1 + b1) @ w2, x {rows}x{k}, w1 {k}x{n}"


def _vs_float16(probe):
    bf16, f16 = probe.best("bfloat16")[0], probe.best("float16")[0]
    return f" and {bf16 / max(f16, 1e-9):.2f}x float16's"


def _xla_note(dtype, jit, gpus, onednn):
    if gpus or jit or dtype != "bfloat16" or not onednn:
        return ""
    return (" XLA:CPU does not use oneDNN's bfloat16 kernels (TensorFlow 2.21; "
            "--xla_cpu_use_onednn changes nothing), so bfloat16 wants the tf.function route.")
