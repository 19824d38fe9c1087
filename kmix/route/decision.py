"""The decision as `kmix.recommend` gives it: a `Recommendation` whose reasons quote the figures (pure)."""

import dataclasses

from kmix.route import facts, rule, timing, trials
from kmix.route.probe import DTYPES, SCREEN
from kmix.route.rule import FLOAT16_MARGIN, MIN_SPEEDUP, choose
from kmix.route.trials import compiled


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The route `kmix.recommend` picks, with the measured reasons; `print(rec)` shows them and the table.

    Attributes:
        policy: `"O1-bfloat16"`, `"O1-float16"` or `"float32"`, as `kmix.autocast`, `kmix.policy_scope` and
            `kmix.set_policy` accept it.
        jit_compile: the `jit_compile` to pass to `model.compile`.
        reasons: lines that quote the measured figures and the device facts.
        loss_scaling: whether the policy needs a dynamic loss scale (float16).
        probe: the `kmix.device.Probe` measured, or None.
        table: with a model, the `RouteTable` of its training step on each route (None otherwise).

    Example:

    >>> rec = kmix.recommend(model, x=x_train, y=y_train)
    >>> rec.policy, rec.jit_compile
    ('O1-bfloat16', False)
    """

    policy: str
    jit_compile: bool
    reasons: tuple
    loss_scaling: bool
    probe: object = None
    table: object = None

    def __str__(self):
        lines = [f"Recommended: policy {self.policy!r}, jit_compile={self.jit_compile}"]
        lines += [f"  - {reason}" for reason in self.reasons] + ([str(self.table)] if self.table is not None else [])
        return "\n".join(lines)


def policy_name(dtype):
    """The policy `kmix.recommend` gives for a compute dtype: `"float32"` or `"O1-<half>"`."""
    return "float32" if dtype == "float32" else f"O1-{dtype}"


def decide(probe, gpus, cpu, onednn=None):
    """The `Recommendation` from a `kmix.device.Probe` and the device facts (`gpus()`, `cpu_features()`, oneDNN)."""
    choice = choose(probe.times(), bool(gpus), MIN_SPEEDUP, FLOAT16_MARGIN, tie="float32")
    (dtype, jit), (_, ref_jit) = choice.route, choice.reference
    shown = lambda d, jit: _g(probe.rate(d, jit)) if jit in probe.compilations else "not probed"  # noqa: E731
    rates = "; ".join(f"{d} {shown(d, False)} / {shown(d, True)}" for d in DTYPES)
    reasons = [facts.describe(gpus, cpu, onednn), f"Measured on {probe.device} (training step of an MLP "
               f"{probe.step}), GFLOP/s as tf.function / XLA: {rates}."]
    if dtype == "float32":
        halves = ", ".join(f"{h} {g.ratio:.2f}x (noise {g.noise:.0%})" for h, g in choice.gains.items())
        halves = halves or f"each half dtype ran over {SCREEN}x slower on a first call"
        f32 = _g(probe.rate("float32", ref_jit))
        reasons.append(f"No half dtype is {MIN_SPEEDUP}x faster than float32's best ({f32} GFLOP/s) beyond the "
                       f"noise ({halves}): float32, which has no rounding or overflow to manage.")
    else:
        g, other = choice.gains[dtype], "float16" if dtype == "bfloat16" else "bfloat16"
        how = ("O1 with bfloat16 (float32's range: no loss scaling; kmix.wrap keeps a fixed scale of 1 and still "
               "skips non-finite steps)" if dtype == "bfloat16" else
               "O1 with float16, which needs loss scaling: compile with kmix.wrap(optimizer) and keep softmax and "
               "masks in float32 (kmix.autocast does)")
        versus = probe.best(dtype)[0] / max(probe.best(other)[0], 1e-9)
        reasons.append(f"{dtype} runs {g.ratio:.2f}x float32's best (noise {g.noise:.0%}) and {versus:.2f}x "
                       f"{other}'s: {how}.")
    rate = lambda c: f"{_g(probe.rate(*c))} GFLOP/s"  # noqa: E731
    xla_note = (" XLA:CPU does not use oneDNN's bfloat16 kernels (TensorFlow 2.21; --xla_cpu_use_onednn changes "
                "nothing), so bfloat16 wants the tf.function route.")
    reasons.append(_compilation_line(choice.route, probe.times(), rate, bool(gpus))
                   + (xla_note if not gpus and not jit and dtype == "bfloat16" and onednn else ""))
    return _recommendation(dtype, jit, reasons, probe)


def decide_routes(table, probe, gpus, cpu, onednn=None, tie="median"):
    """The `Recommendation` from a `RouteTable` of the user's model, or from `probe` (the `kmix.device.Probe` that
    chose the candidates, or None) where no half route was timed; `tie`: `rule.choose`'s tie rule."""
    times, index = table.times(), {(r.dtype, r.jit_compile): i for i, r in enumerate(table.routes)}
    if no_half_timed(table):
        return _from_probe(table, probe, gpus, cpu, onednn, index)
    choice = choose(times, bool(gpus), 1.0, 1.0, tie=tie)
    table = dataclasses.replace(table, chosen=index[choice.route], reference=index[choice.reference])
    (dtype, jit), ref = choice.route, table.routes[index[choice.reference]]
    ms = lambda c: f"{timing.median(times[c]) * 1e3:.2f} ms"  # noqa: E731
    reasons, floor = [facts.describe(gpus, cpu, onednn), _rounds_line(table)], f"{timing.NOISE_FLOOR:.0%}"
    if dtype == "float32" and not choice.gains:
        why = (f"the device's probe ran {' and '.join(d for d, _ in table.skipped)} too slowly to be worth timing "
               "(below the table)" if table.skipped else "only float32 was asked for (dtypes=)")
        reasons.append(f"No half route was timed: {why}. float32 ({_reference(ref, times)}).")
    elif dtype == "float32":
        halves = [f"{policy_name(h)}, {compiled(g.route[1])} {g.ratio:.2f}x ({_interval(g)})"
                  for h, g in choice.gains.items()]
        reasons.append(f"No half route beats float32's reference route ({_reference(ref, times)}) beyond "
                       f"the measured noise and by more than {floor} ({'; '.join(halves)}): float32.")
    else:
        g = choice.gains[dtype]
        scaling = ("no loss scaling" if dtype == "bfloat16" else
                   "with a dynamic loss scale: compile with kmix.wrap(optimizer)")
        why = (f"beyond the measured noise ({g.noise:.0%})" if g.beyond_noise else
               f"faster in the median by more than {floor}, though the rounds could not separate them beyond the "
               f"noise ({_interval(g)}): the tie rule picks the faster median")
        reasons.append(f"{policy_name(dtype)} runs {g.ratio:.2f}x float32's reference route "
                       f"({_reference(ref, times)}), {why}: {scaling}.")
    undecided = [h for h, g in choice.gains.items() if not g.settled]
    if undecided and dtype == "float32":
        kept = ("the tie rule (tie='float32') keeps float32" if choice.tie else
                f"none is more than {floor} faster in the median, so float32 is kept (no rounding for nothing)")
        reasons.append(f"The rounds could not separate {', '.join(policy_name(h) for h in undecided)} from float32 "
                       f"beyond the noise: {kept}. A longer budget_s, or a quieter machine, may settle it.")
    reasons.append(_compilation_line(choice.route, times, lambda c: f"{ms(c)} a step", bool(gpus)))
    if table.over_budget:
        first, over = max(table.routes, key=lambda r: r.setup_s), "; ".join(label for label, _ in table.over_budget)
        reasons.append(f"{_budget(table)} could not cover building and compiling {over} (building and compiling "
                       f"{first.label} took {first.setup_s:.1f} s): recommended from the {len(table.routes)} "
                       f"route(s) measured. {_budget_advice(table)}")
    return _recommendation(dtype, jit, reasons, probe, table)


def _from_probe(table, probe, gpus, cpu, onednn, index):
    """No half route timed on the model: the device probe's route (float32 as timed without a probe)."""
    reference = rule.best(table.times(), "float32", bool(gpus))
    timed = "; ".join(f"{r.label}, {timing.median(r.seconds) * 1e3:.2f} ms a step" for r in table.routes)
    untimed = "; ".join(trials.label(route) for route in table.untimed())
    spent = (f"On your model, {_budget(table)} timed {timed} (the table below, {_rounds(table)}) and no half "
             f"route: {untimed} not built.")
    if probe is None:
        table = dataclasses.replace(table, chosen=index[reference], reference=index[reference])
        reasons = [facts.describe(gpus, cpu, onednn), f"{spent} No device probe to decide from (dtypes= given, "
                   f"probe=None): float32 as timed, untested against the half routes. {_budget_advice(table)}"]
        return _recommendation("float32", reference[1], reasons, None, table)
    rec = decide(probe, gpus, cpu, onednn)
    dtype = rule.dtype_of(rec.policy)
    table = dataclasses.replace(table, chosen=index.get((dtype, rec.jit_compile)), reference=index[reference])
    note = (f"{spent} The route above is therefore this device's probe's, not measured on your model. "
            f"{_budget_advice(table)}")
    return _recommendation(dtype, rec.jit_compile, rec.reasons + (note,), probe, table)


def no_half_timed(table):
    """Whether the budget left every half route of `table` unbuilt (and some were asked for)."""
    return (any(policy != "float32" for policy, _ in table.untimed())
            and all(r.dtype == "float32" for r in table.routes))


def _rounds(table):
    """`"5 interleaved rounds each"`, `"3 to 7 ..."`, `"1 round"`: what each route of `table` got."""
    counts, each = sorted({len(r.seconds) for r in table.routes}), " each" if len(table.routes) > 1 else ""
    if counts == [1]:
        return "1 round" + each
    return (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}") + " interleaved rounds" + each


def _rounds_line(table):
    """The reason that says what was timed, and whether the rounds fell short of `MIN_ROUNDS`."""
    n = len(table.routes)
    line = f"Timed your model's training step on {table.batch}: {n} route{'s' if n != 1 else ''}, {_rounds(table)}"
    if min(len(r.seconds) for r in table.routes) >= timing.MIN_ROUNDS or n < 2:
        return line + " (the table below)."
    return (line + f" (the table below): fewer than the {timing.MIN_ROUNDS} a comparison aims for, as budget_s ran "
            f"out (the rounds stop at {1 + trials.OVERRUN:g}x budget_s), so the ratios are rough.")


def _budget(table):
    return "the budget" if table.budget_s is None else f"budget_s={table.budget_s:g}"


def _budget_advice(table):
    """What budget_s would time the routes left out, at this call's pace, and what it cannot promise."""
    xla = any(jit for _, jit in table.untimed()) and not any(r.jit_compile for r in table.routes)
    guess = f"; an XLA compile, not measured here, taken as {trials.XLA_BUILD:g} builds, may take longer" if xla else ""
    return (f"At this call's pace, timing them too would take a budget_s of {table.needed_s():.0f} s or more "
            f"({table.before_s:.0f} s before building, then each build and {timing.MIN_ROUNDS} rounds of every "
            f"route as measured{guess}); a busier machine needs more.")


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
            f"{compiled(not route.jit_compile)} round by round ({ratio:.2f}x)")


def _interval(gain):
    """`"between 0.95x and 1.30x round by round"`: a ratio's confidence interval."""
    return f"between {gain.low:.2f}x and {gain.high:.2f}x round by round, at least {timing.CONFIDENCE:.0%} each side"


def _recommendation(dtype, jit, reasons, probe, table=None):
    return Recommendation(policy_name(dtype), bool(jit), tuple(reasons), dtype == "float16", probe, table)


def _compilation_line(route, times, shown, gpu):
    """Why `route`'s compilation: its figure against the other one's, round by round."""
    (dtype, jit), other = route, (route[0], not route[1])
    if other not in times:
        return f"{dtype} timed as {compiled(jit)} only ({shown(route)}): jit_compile={jit}."
    ratio = timing.paired(times[other], times[route])[0]
    why = (f"{ratio:.2f}x round by round" if ratio > 1 + timing.NOISE_FLOOR else
           f"{ratio:.2f}x round by round, within {timing.NOISE_FLOOR:.0%}: Keras's default, {compiled(gpu)}")
    return (f"{dtype} as {compiled(jit)}: {shown(route)} against {shown(other)} as {compiled(not jit)} "
            f"({why}): jit_compile={jit}.")


def _g(rate):
    """A rate in GFLOP/s as printed: whole numbers, or 2 significant digits below 10."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"
