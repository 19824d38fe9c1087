"""Trials of the user's own training step on each candidate route, for `kmix.recommend(model, ...)`.

A route is a policy (`"float32"`, `"O1-bfloat16"`, `"O1-float16"`) and a
`jit_compile`. Each is built as the README builds it, on the user's model
itself and its own variables (`kmix.route.inplace`: nothing copied, the
model put back as it was afterwards):

    kmix.autocast(model, policy)                  # in place, for as long as the trace takes
    with policy_scope(policy):
        shared.compile(optimizer=kmix.wrap(inner), loss=<the user's loss>, jit_compile=jit_compile)

where `shared` is a model calling `model` and `inner` one optimizer for all
routes (the user's settings, learning rate 0). The routes are built in the
order the device's probe ranks them (`kmix.route.rule.build_order`: float32's reference
first, then the probe's best half route, then the rest), each while its
build and the rounds still fit the budget. Each is warmed up (two steps:
the trace or XLA compile, and one more) and timed with
`shared.train_on_batch(x, y)` on one batch of the user's data, in
interleaved rounds (`kmix.route.timing.run_rounds`): `MIN_ROUNDS` of every
route where they fit (never past `1 + OVERRUN` times the budget: the table
shows the rounds run), then more rounds of the routes whose comparisons are
still unsettled (`kmix.route.rule.unsettled`) while the budget lasts, up to
`MAX_ROUNDS`.
"""

import contextlib
import dataclasses
import gc
import logging
import time
import warnings

from kmix._output import format_table, progress
from kmix.optimizers import wrap
from kmix.placing import autocast
from kmix.policy import policy_scope
from kmix.route import data, inplace, rule, timing
from kmix.route.timing import MAX_ROUNDS, MIN_ROUNDS  # timing's, the one of each (the benchmarks read them here)

TARGET_ROUNDS = 10  # the budget is spread so that about this many rounds fit in it
# The rounds stop at (1 + OVERRUN) x budget_s, their minimum reached or not: the rounds of routes built
# near budget_s's end get this much past it, and putting the model back the rest of 1.25x budget_s.
OVERRUN = 0.2
# An XLA route's build, before any was built, as this many tf.function builds: on this project's 2-core
# AVX2 CPU under load, the README's model compiled in 8.0 s under XLA against 2.8 s as a tf.function.
XLA_BUILD = 3.0
# Before any route is built, a tf.function build is taken as at least TRACE of the probe's seconds per
# configuration (its traces, compiles and calls: this machine's pace), and PER_VARIABLE of them per trainable
# variable (the train step's graph grows with them; XLA_BUILD times more under XLA). Measured there at load
# 3-6, the README's model (6 variables) and encoders of 1, 2 and 4 blocks (20-68 variables) built in 1.1-3.5
# of them, 0.13-0.58 per variable; the README's model under XLA in 4-5.4.
TRACE = 3.0
PER_VARIABLE = 0.5


@dataclasses.dataclass(frozen=True)
class RouteTiming:
    """One route's trial: `policy`, `jit_compile`, `seconds` (per step, one per round), `setup_s`, `steps`."""

    policy: str
    jit_compile: bool
    seconds: tuple
    setup_s: float
    steps: int

    @property
    def dtype(self):
        """The compute dtype: `"float32"`, `"bfloat16"` or `"float16"`."""
        return self.policy.rsplit("-", 1)[-1]

    @property
    def label(self):
        """`"O1-bfloat16, XLA"`."""
        return f"{self.policy}, {'XLA' if self.jit_compile else 'tf.function'}"


@dataclasses.dataclass(frozen=True)
class RouteTable:
    """The trials behind a recommendation on the user's model.

    Attributes:
        routes: one `RouteTiming` per route timed.
        skipped: `(dtype, reason)` for the half dtypes not timed.
        batch: a description of the batch timed.
        chosen: the index in `routes` of the route recommended (None before the decision).
        reference: the index of the fastest float32 route, the ratios' baseline.
        seconds: how long the call took until the trials ended (from its
            start: the probe, building and compiling included).
        over_budget: `(route label, why)` for the routes not built: `budget_s`
            could not cover their build and compile.
        budget_s: the budget the trials kept to (None: not given).
        order: the routes `(policy, jit_compile)` asked for, in the order
            they were taken up for building (`kmix.route.rule.build_order`);
            empty where not recorded.
        before_s: seconds the call had spent before the first build (the
            probe, the checks of the arguments).
    """

    routes: tuple
    skipped: tuple = ()
    batch: str = ""
    chosen: int = None
    reference: int = None
    seconds: float = 0.0
    over_budget: tuple = ()
    budget_s: float = None
    order: tuple = ()
    before_s: float = 0.0

    def times(self):
        """`{(dtype, jit_compile): seconds per round}`, what the decision compares."""
        return {(r.dtype, r.jit_compile): list(r.seconds) for r in self.routes}

    def untimed(self):
        """The routes of `order` not timed (the budget could not cover them), in build order."""
        timed = {(r.policy, r.jit_compile) for r in self.routes}
        return [route for route in self.order if route not in timed]

    def needed_s(self):
        """Seconds a call like this one would take to time every route of `order`, at this call's pace.

        What this call spent before building, each route's build as measured
        (one not built: `estimate_build`), and `MIN_ROUNDS` rounds of every
        route (one not built: as the slowest step). Too low where the load
        grows, or where an XLA compile costs more than estimated.
        """
        builds = {(r.policy, r.jit_compile): r.setup_s for r in self.routes}
        if not builds:
            return self.before_s
        steps = [timing.median(r.seconds) for r in self.routes]
        total = self.before_s + MIN_ROUNDS * sum(steps)
        for route in self.untimed():
            total += estimate_build(route, builds) + MIN_ROUNDS * max(steps)
        return total + sum(builds.values())

    def __str__(self):
        base = self.routes[self.reference].seconds if self.reference is not None else None
        rows = []
        for i, r in enumerate(self.routes):
            ratio = timing.paired(base, r.seconds)[0] if base is not None else "n/a"
            rows.append([r.policy, "XLA" if r.jit_compile else "tf.function", timing.median(r.seconds) * 1e3,
                         min(r.seconds) * 1e3, f"{timing.spread(r.seconds):.1%}", ratio, len(r.seconds),
                         r.setup_s, _marks(i, self.chosen, self.reference)])
        headers = ["policy", "compiled", "ms/step", "fastest", "spread", "x float32", "rounds", "setup s", ""]
        budget = "" if self.budget_s is None else f" of budget_s={self.budget_s:g}"
        before = f"{self.before_s:.0f} s before the first build (the probe, the checks), then " if self.order else ""
        lines = [f"Training step of your model on {self.batch}: median of interleaved rounds ({self.seconds:.0f} s "
                 f"in all{budget}: {before}building, compiling and the rounds)",
                 format_table(headers, rows)]
        lines.append("x float32: the float32 reference route's step over this route's, round by round (median); "
                     "spread: interquartile range over the median.")
        lines += [f"{dtype}: not timed: {reason}" for dtype, reason in self.skipped]
        lines += [f"{label}: not built: {reason}" for label, reason in self.over_budget]
        return "\n".join(lines)


def _marks(i, chosen, reference):
    marks = ["<- recommended"] if i == chosen else []
    if i == reference:
        marks.append("<- float32 reference")
    return ", ".join(marks)


def time_routes(model, batch, loss, optimizer, routes, budget_s, verbose=True, default_jit=False, start=None,
                probe=None, first_builds=None):
    """Builds, warms up and times every route that fits the budget; returns a `RouteTable` (no decision yet).

    Every route runs on `model`'s own variables (`kmix.route.inplace`): the
    model is placed in place for a route, the route's step traced, the model
    put back; one optimizer (the user's settings, learning rate 0, so that
    the weights do not move) serves every route. Only the non-trainable
    variables are copied (to disk) to be put back, unless the optimizer's
    kind moves a variable at learning rate 0 (`kmix.route.data.still_at_zero`): then all of
    them. On exit the model is as it was: layers, policies, weights bit for
    bit, compiled functions.

    Args:
        model: the user's model (left as it was).
        batch: `(x, y, description)` from `kmix.route.data.first_batch`.
        loss, optimizer: from `kmix.route.data.training_setup`.
        routes: `(policy, jit_compile)` pairs, in the order the table shows them.
        budget_s: seconds for the whole call, building and compiling
            included, counted from `start`. The routes are built in
            `kmix.route.rule.build_order`, float32's first (its other
            compilation instead where only that one's `first_builds`
            estimate fits); the first always, each other only when its build
            (`estimate_build`, from the routes built so far) and `MIN_ROUNDS`
            rounds of every route fit in what is left. The rounds share what
            is left, and stop at `1 + OVERRUN` times `budget_s` (after one
            round of each), `MIN_ROUNDS` reached or not.
        verbose: progress lines on stderr.
        default_jit: Keras's default compilation here (True with a GPU): the
            decision keeps it within the noise floor (the comparisons left
            unsettled depend on it), and without a probe it is built first.
        start: `time.perf_counter()` when the call began (now by default).
        probe: the device's `kmix.device.Probe`, which orders the builds (None: Keras's default first).
        first_builds: `{route: seconds}` estimated before any build (`first_build`), or None.
    """
    say = progress if verbose else (lambda message: None)
    x, y, described = batch
    start = time.perf_counter() if start is None else start
    before = time.perf_counter() - start
    deadline, hard = start + budget_s, start + (1 + OVERRUN) * budget_s
    inner = data.fresh_optimizer(optimizer, learning_rate=0.0)
    built, setup, first, over = {}, {}, {}, []
    order = rule.build_order(routes, probe, default_jit)
    if first_builds:
        order = fitting_first(order, first_builds, deadline - time.perf_counter())
    saved = "non-trainable" if data.still_at_zero(optimizer) else "all"  # no copy of the weights where none is needed
    with inplace.Preserved(model, saved=saved) as kept, _quiet_retracing(), warnings.catch_warnings():
        warnings.filterwarnings("once", category=UserWarning)  # autocast's, about the model: once, not per route
        for n, route in enumerate(order, 1):
            policy, jit = route
            shown = label(route)
            why = _over_budget(route, setup, first, deadline, budget_s) if built else None
            if why:
                over.append((shown, why))
                say(f"kmix.recommend: [{n}/{len(order)}] {shown}: not built, {why}")
                continue
            say(f"kmix.recommend: [{n}/{len(order)}] building and compiling {shown}")
            begin = time.perf_counter()
            try:
                step = _route_step(model, policy, jit, inner, loss, x, y)
                step()  # traces (or compiles) and builds the optimizer
                step()
            finally:
                kept.restore_layers()  # the traced step keeps the route's placement
            setup[route] = time.perf_counter() - begin
            begin = time.perf_counter()
            step()
            first[route] = time.perf_counter() - begin
            built[route] = step
        now = time.perf_counter()
        left = max(deadline - now, 0.0)
        per_round = left / TARGET_ROUNDS / len(built)
        steps = {route: max(1, int(per_round / max(first[route], 1e-6))) for route in built}
        say(f"kmix.recommend: timing {len(built)} routes in interleaved rounds ({left:.0f} s left of budget_s)")
        key = {route: (rule.dtype_of(route[0]), route[1]) for route in built}

        def more(rounds):
            open_ = rule.unsettled({key[route]: seconds for route, seconds in rounds.items()}, default_jit)
            return [route for route in built if key[route] in open_]

        alone = len(built) == 1  # nothing to compare it with: one round shows its step
        rounds = timing.run_rounds(built, steps, 0.0 if alone else left, min_rounds=1 if alone else MIN_ROUNDS,
                                   max_rounds=MAX_ROUNDS, more=more, hard_s=hard - now)
        built.clear()
    gc.collect()
    timings = tuple(RouteTiming(policy, bool(jit), tuple(rounds[(policy, jit)]), setup[(policy, jit)],
                                steps[(policy, jit)]) for policy, jit in routes if (policy, jit) in rounds)
    return RouteTable(timings, batch=described, seconds=time.perf_counter() - start, over_budget=tuple(over),
                      budget_s=budget_s, order=tuple(order), before_s=before)


STEPS_PER_BUILD = 3  # a route's build runs this many training steps (two to trace and build, one timed)
FORWARDS_PER_STEP = 3  # a training step costs about three forward passes (forward, two backward matmuls)


def build_estimate(model, x):
    """`(seconds a route's build is estimated to take, seconds one forward pass took)`, from one forward pass.

    `recommend` asks before building its first route: a model whose one
    route cannot fit the budget is recommended for from the device probe.
    The build is its steps (`STEPS_PER_BUILD` of about `FORWARDS_PER_STEP`
    forward passes each) and a trace (about one forward pass more).
    """
    import keras  # for the sync: on a GPU the call returns once the ops are queued, not done

    begin = time.perf_counter()
    keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=False))
    forward = time.perf_counter() - begin
    return forward * (STEPS_PER_BUILD * FORWARDS_PER_STEP + 1), forward


def label(route):
    """`"O1-bfloat16, XLA"`: a route `(policy, jit_compile)` as the table names it."""
    return f"{route[0]}, {'XLA' if route[1] else 'tf.function'}"


def fitting_first(order, first_builds, left):
    """`order` with the first float32 route whose build fits in `left` seconds moved to the front (pure).

    float32's reference comes first (`kmix.route.rule.build_order`); where
    its build cannot fit (an XLA compile on a busy CPU) but the other
    compilation's can, that one is built first, so that the budget times a
    route. `first_builds`: `{route: seconds}` (`first_build`).
    """
    fits = [route for route in order if route[0] == "float32" and first_builds[route] <= left]
    return [fits[0]] + [route for route in order if route != fits[0]] if fits else list(order)


def first_build(route, forward_build, probe=None, variables=0):
    """Seconds `route`'s build is estimated to take before any route was built.

    The larger of `forward_build` (`build_estimate`'s, from one forward
    pass: what the model's compute costs) and a trace's, from the device's
    probe: its seconds per configuration (this machine's pace) times `TRACE`
    or `PER_VARIABLE` per trainable variable of the model (`variables`),
    the larger, and `XLA_BUILD` times more under XLA (none without a probe).
    """
    per_configuration = probe.seconds / len(probe.gflops) if probe is not None and probe.gflops else 0.0
    trace = per_configuration * max(TRACE, PER_VARIABLE * variables) * (XLA_BUILD if route[1] else 1.0)
    return max(forward_build, trace)


def estimate_build(route, setup):
    """Seconds `route`'s build is estimated to take, from `setup` `{route: seconds}` of the builds so far.

    The longest build so far of the same compilation; with none, the
    longest of the other, times `XLA_BUILD` for an XLA route (an XLA
    compile costs more than a trace).
    """
    same = [s for r, s in setup.items() if r[1] == route[1]]
    return max(same) if same else max(setup.values()) * (XLA_BUILD if route[1] else 1.0)


def _over_budget(route, setup, first, deadline, budget_s):
    """Why `route` is not built within the budget, or None when its build and the rounds fit.

    Its build is estimated by `estimate_build`, its step as the slowest step so far.
    """
    build = estimate_build(route, setup)
    rounds = MIN_ROUNDS * (sum(first.values()) + max(first.values()))
    left = deadline - time.perf_counter()
    if build + rounds <= left:
        return None
    how = ("as the longest build so far of its compilation" if any(r[1] == route[1] for r in setup) else
           f"{XLA_BUILD:g}x the longest tf.function build, as no XLA route was built" if route[1] else
           "as the longest XLA build so far")
    return (f"budget_s={budget_s:g} cannot cover its build and compile (about {build:.1f} s, {how}) and "
            f"{MIN_ROUNDS} rounds of every route ({rounds:.1f} s): {max(left, 0):.1f} s left")


def _route_step(model, policy, jit, inner, loss, x, y):
    """`model` placed under `policy` (in place) and a step of a model sharing its variables, compiled."""
    shared = inplace.shared_model(model)
    autocast(model, policy)
    with policy_scope(policy):
        shared.compile(optimizer=wrap(inner), loss=loss, jit_compile=jit)
    return _step(shared, x, y)


def _step(model, x, y):
    def step():
        model.train_on_batch(x, y)  # returns the loss as a Python float: the device is done

    return step


class _RetracingFilter(logging.Filter):
    def filter(self, record):
        return "triggered tf.function retracing" not in record.getMessage()


@contextlib.contextmanager
def _quiet_retracing():
    """Drops TensorFlow's retracing warning while the routes trace their copies' steps.

    Keras builds each model's train step from one nested function, and
    TensorFlow counts traces per code object: four copies traced in a row
    read as one function retraced. Other warnings pass.
    """
    import tensorflow as tf

    logger, quiet = tf.get_logger(), _RetracingFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
