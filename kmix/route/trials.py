"""Trials of the user's own training step on each candidate route, for `kmix.recommend(model, ...)`."""

import contextlib
import dataclasses
import gc
import time
import warnings

import keras
import tensorflow as tf

from kmix._output import format_table, progress
from kmix._preserved import Preserved
from kmix.optimizers import wrap
from kmix.placing import autocast
from kmix.policy import policy_scope
from kmix.route import data, rule, timing
from kmix.route.timing import MAX_ROUNDS, MIN_ROUNDS  # noqa: F401  (timing's; the benchmarks read them here)

TARGET_ROUNDS = 10  # the budget is spread so that about this many rounds fit in it
OVERRUN = 0.2  # the rounds stop at (1 + OVERRUN) x budget_s, their minimum reached or not
XLA_BUILD, TRACE = 3.0, 3.0  # an XLA build over a tf.function one; a small model's build, in probe configurations
# A build (autocast, compile, two steps: the first traces and optimizes the step's graph) over one eager forward
# pass on the batch: 11x on a 2-block encoder, 16-22x on a LoRA Qwen2 0.5B (Xeon, 2 cores; the rounds are apart).
BUILD_FORWARDS = 24


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
        return rule.dtype_of(self.policy)

    @property
    def label(self):
        """`"O1-bfloat16, XLA"`."""
        return label((self.policy, self.jit_compile))


def label(route):
    """`"O1-bfloat16, XLA"`: a route `(policy, jit_compile)` as the table names it."""
    return f"{route[0]}, {compiled(route[1])}"


def compiled(jit_compile):
    """`"XLA"` or `"tf.function"`, as the reports name a compilation."""
    return "XLA" if jit_compile else "tf.function"


@dataclasses.dataclass(frozen=True)
class RouteTable:
    """The trials behind a recommendation on the user's model; `str()` shows the table.

    Attributes:
        routes: one `RouteTiming` per route timed; `skipped`: `(dtype, reason)` for the half dtypes not timed.
        batch: a description of the batch timed.
        chosen, reference: indices in `routes` of the route recommended and of float32's reference.
        seconds, before_s: the call's seconds until the trials ended, and before the first build.
        over_budget: `(route label, why)` for the routes `budget_s` could not build.
        budget_s: the budget the trials kept to (None: not given); `order`: the routes in build order.
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
        """Seconds a call like this one would take to time every route of `order`, at this call's pace."""
        builds = {(r.policy, r.jit_compile): r.setup_s for r in self.routes}
        if not builds:
            return self.before_s
        steps = [timing.median(r.seconds) for r in self.routes]
        total = self.before_s + MIN_ROUNDS * sum(steps)
        for route in self.untimed():
            total += estimate_build(route, builds) + MIN_ROUNDS * max(steps)
        return total + sum(builds.values())

    def __str__(self):
        base, rows = (self.routes[self.reference].seconds if self.reference is not None else None), []
        for i, r in enumerate(self.routes):
            marks = ["<- recommended"] * (i == self.chosen) + ["<- float32 reference"] * (i == self.reference)
            ratio = timing.paired(base, r.seconds)[0] if base is not None else "n/a"
            rows.append([r.policy, compiled(r.jit_compile), timing.median(r.seconds) * 1e3, min(r.seconds) * 1e3,
                         f"{timing.spread(r.seconds):.1%}", ratio, len(r.seconds), r.setup_s, ", ".join(marks)])
        headers = ["policy", "compiled", "ms/step", "fastest", "spread", "x float32", "rounds", "setup s", ""]
        budget = "" if self.budget_s is None else f" of budget_s={self.budget_s:g}"
        before = f"{self.before_s:.0f} s before the first build (the probe, the checks), then " if self.order else ""
        lines = [f"Training step of your model on {self.batch}: median of interleaved rounds ({self.seconds:.0f} s "
                 f"in all{budget}: {before}building, compiling and the rounds)", format_table(headers, rows),
                 "x float32: the float32 reference route's step over this route's, round by round (median); "
                 "spread: interquartile range over the median."]
        lines += [f"{dtype}: not timed: {reason}" for dtype, reason in self.skipped]
        lines += [f"{label}: not built: {reason}" for label, reason in self.over_budget]
        return "\n".join(lines)


def time_routes(model, batch, loss, optimizer, routes, budget_s, verbose=True, default_jit=False, start=None,
                probe=None, first_builds=None):
    """Builds, warms up and times every route that fits `budget_s` (from `start`); returns a `RouteTable`."""
    say = progress if verbose else (lambda message: None)
    x, y, described = batch
    start = time.perf_counter() if start is None else start
    before = time.perf_counter() - start
    deadline, hard = start + budget_s, start + (1 + OVERRUN) * budget_s
    inner, built, setup, first, over = data.fresh_optimizer(optimizer, learning_rate=0.0), {}, {}, {}, []
    order = rule.build_order(routes, probe, default_jit)
    order = fitting_first(order, first_builds, deadline - time.perf_counter()) if first_builds else order
    saved = "non-trainable" if data.still_at_zero(optimizer) else "all"  # no copy of the weights where none is needed
    with Preserved(model, saved=saved) as kept, _quiet_retracing(), warnings.catch_warnings():
        warnings.filterwarnings("once", category=UserWarning)  # autocast's, about the model: once, not per route
        for n, route in enumerate(order, 1):
            why = _over_budget(route, setup, first, deadline, budget_s) if built else None
            if why:
                over.append((label(route), why))
                say(f"kmix.recommend: [{n}/{len(order)}] {label(route)}: not built, {why}")
                continue
            say(f"kmix.recommend: [{n}/{len(order)}] building and compiling {label(route)}")
            begin = time.perf_counter()
            try:
                step = _route_step(model, *route, inner, loss, x, y)
                step()  # traces (or compiles) and builds the optimizer
                step()
            finally:
                kept.restore_layers()  # the traced step keeps the route's placement
            setup[route] = time.perf_counter() - begin
            first[route], built[route] = timing.seconds(step), step
        now = time.perf_counter()
        left = max(deadline - now, 0.0)
        steps = {route: max(1, int(left / TARGET_ROUNDS / len(built) / max(first[route], 1e-6))) for route in built}
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
    timings = tuple(RouteTiming(r[0], bool(r[1]), tuple(rounds[r]), setup[r], steps[r]) for r in routes if r in rounds)
    return RouteTable(timings, batch=described, seconds=time.perf_counter() - start, over_budget=tuple(over),
                      budget_s=budget_s, order=tuple(order), before_s=before)


def build_estimate(model, x):
    """`(seconds a route's build is estimated to take, seconds one forward pass took)`, from one forward pass."""
    # Converted to NumPy for the sync: on a GPU the call returns once the ops are queued, not done.
    forward = timing.seconds(lambda: keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=False)))
    return forward * BUILD_FORWARDS, forward


def fitting_first(order, first_builds, left):
    """`order` with the first float32 route whose `first_builds` estimate fits `left` seconds moved to the front."""
    fits = [route for route in order if route[0] == "float32" and first_builds[route] <= left]
    return [fits[0]] + [route for route in order if route != fits[0]] if fits else list(order)


def first_build(route, forward_build, probe=None):
    """Seconds `route`'s build is estimated to take before any route was built (`forward_build`: `build_estimate`'s);
    at least a small model's build at the pace of the device's `probe`."""
    per_configuration = probe.seconds / len(probe.gflops) if probe is not None and probe.gflops else 0.0
    return max(forward_build, per_configuration * TRACE * (XLA_BUILD if route[1] else 1.0))


def estimate_build(route, setup):
    """Seconds `route`'s build is estimated to take: the longest in `setup` `{route: seconds}` of its compilation."""
    same = [s for r, s in setup.items() if r[1] == route[1]]
    return max(same) if same else max(setup.values()) * (XLA_BUILD if route[1] else 1.0)


def _over_budget(route, setup, first, deadline, budget_s):
    """Why `route` is not built within the budget, or None when its build and the rounds fit."""
    build, rounds = estimate_build(route, setup), MIN_ROUNDS * (sum(first.values()) + max(first.values()))
    left = deadline - time.perf_counter()
    if build + rounds <= left:
        return None
    how = ("as the longest build so far of its compilation" if any(r[1] == route[1] for r in setup) else
           f"{XLA_BUILD:g}x the longest tf.function build, as no XLA route was built" if route[1] else
           "as the longest XLA build so far")
    return (f"budget_s={budget_s:g} cannot cover its build and compile (about {build:.1f} s, {how}) and "
            f"{MIN_ROUNDS} rounds of every route ({rounds:.1f} s): {max(left, 0):.1f} s left")


class _Shared(keras.Model):
    """A model calling `inner` (inputs as `fit` gives them): its own compile and step, `inner`'s variables."""

    def __init__(self, inner):
        super().__init__(name=f"kmix_timing_{inner.name}", autocast=False)
        self.inner = inner

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)


def _route_step(model, policy, jit, inner, loss, x, y):
    """`model` placed under `policy` (in place) and a step of a model sharing its variables, compiled."""
    shared = _Shared(model)
    autocast(model, policy)
    with policy_scope(policy):
        shared.compile(optimizer=wrap(inner), loss=loss, jit_compile=jit)
        shared.optimizer.build(shared.trainable_variables)  # built in the first step, that step would trace twice
    return lambda: shared.train_on_batch(x, y)  # returns the loss as a Python float: the device is done


@contextlib.contextmanager
def _quiet_retracing():
    """Drops TensorFlow's retracing warning while the routes trace (one train-step function per copy)."""
    logger = tf.get_logger()
    quiet = lambda record: "triggered tf.function retracing" not in record.getMessage()  # noqa: E731
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
