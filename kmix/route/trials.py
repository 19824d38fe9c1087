"""Trials of the user's own training step on each candidate route, for `kmix.recommend(model, ...)`.

A route is a policy (`"float32"`, `"O1-bfloat16"`, `"O1-float16"`) and a
`jit_compile`. Each is built as the README builds it, on the user's model
itself and its own variables (`kmix.route.inplace`: nothing copied, the
model put back as it was afterwards):

    kmix.autocast(model, policy)                  # in place, for as long as the trace takes
    with policy_scope(policy):
        shared.compile(optimizer=kmix.wrap(inner), loss=<the user's loss>, jit_compile=jit_compile)

where `shared` is a model calling `model` and `inner` one optimizer for all
routes (the user's settings, learning rate 0). Each route is warmed up (two
steps: the trace or XLA compile, and one more) and timed with
`shared.train_on_batch(x, y)` on one batch of the user's data, in
interleaved rounds (`kmix.route.timing.run_rounds`): `MIN_ROUNDS` of every
route, then more rounds of the routes whose comparisons are still
unsettled (`kmix.route.rule.unsettled`) while the budget lasts, up to
`MAX_ROUNDS`. The budget counts building and compiling: a route whose
build would overrun it is not built, and the table says so.
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
from kmix.route import inplace, rule, timing
from kmix.route.probe import DTYPES

TARGET_ROUNDS = 10  # the budget is spread so that about this many rounds fit in it
MIN_ROUNDS = 5  # every route, whatever the budget: fewer ratios tell too little about the noise
MAX_ROUNDS = 30  # where the noise keeps a comparison open, it stays open
CANDIDATE = 0.85  # a half dtype is timed on the model when the probe ran it at least this fast as float32


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
        seconds: how long the trials took, building and compiling included.
        over_budget: `(route label, why)` for the routes not built: `budget_s`
            could not cover their build and compile.
        budget_s: the budget the trials kept to (None: not given).
    """

    routes: tuple
    skipped: tuple = ()
    batch: str = ""
    chosen: int = None
    reference: int = None
    seconds: float = 0.0
    over_budget: tuple = ()
    budget_s: float = None

    def times(self):
        """`{(dtype, jit_compile): seconds per round}`, what the decision compares."""
        return {(r.dtype, r.jit_compile): list(r.seconds) for r in self.routes}

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
        lines = [f"Training step of your model on {self.batch}: median of interleaved rounds "
                 f"({self.seconds:.0f} s in all{budget}, building and compiling included)",
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


def candidates(probe):
    """The dtypes worth timing on a model, from a probe: `(dtypes, [(dtype, why not), ...])`."""
    f32 = probe.best("float32")[0]
    chosen, skipped = ["float32"], []
    for half in ("bfloat16", "float16"):
        rate = max((probe.rate(half, jit) for jit in (False, True) if (half, jit) not in probe.screened),
                   default=0.0)
        if rate < CANDIDATE * f32:
            skipped.append((half, f"the probe ran it at {rate / f32:.2f}x float32's best "
                                  f"({rate:.3g} against {f32:.3g} GFLOP/s), under {CANDIDATE}x"))
        elif half == "float16" and "bfloat16" in chosen and rate <= probe.best("bfloat16")[0]:
            skipped.append((half, f"no faster than bfloat16 on the probe ({rate:.3g} against "
                                  f"{probe.best('bfloat16')[0]:.3g} GFLOP/s), which needs no loss scaling"))
        else:
            chosen.append(half)
    return chosen, skipped


def check_dtypes(dtypes):
    """`dtypes` as `recommend` times them: float32 (the reference) first, then the halves named."""
    dtypes = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"`dtypes` must name some of {DTYPES}. Received: dtypes={dtypes!r}")
    return ["float32"] + [d for d in DTYPES[1:] if d in dtypes]  # float32 is the reference


def first_batch(x, y, sample, batch_size):
    """One batch `(x, y)` of tensors from what `kmix.recommend` received."""
    import keras
    import tensorflow as tf

    if sample is not None:
        if x is not None or y is not None:
            raise ValueError("Pass the data as `x=`, `y=` or as `sample=`, not both. "
                             f"Received: sample and x={type(x).__name__}, y={type(y).__name__}.")
        if isinstance(sample, tf.data.Dataset):
            x = sample
        elif isinstance(sample, (tuple, list)) and len(sample) in (2, 3):
            return _tensors(sample[0]), _tensors(sample[1]), "the batch given"
        else:
            raise TypeError("`sample` must be a batch `(x, y)` or a `tf.data.Dataset` of batches. "
                            f"Received: sample of type {type(sample).__name__}.")
    if isinstance(x, tf.data.Dataset):
        batch = next(iter(x))
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError("The dataset must yield batches `(x, y)` (or `(x, y, sample_weight)`). "
                             f"Received: an element of type {type(batch).__name__}.")
        return _tensors(batch[0]), _tensors(batch[1]), "the dataset's first batch"
    if x is None or y is None:
        raise ValueError("`kmix.recommend(model, ...)` times your training step on your data: pass "
                         f"`x=` and `y=`, `sample=(x, y)` or a dataset. Received: x={type(x).__name__}, "
                         f"y={type(y).__name__}.")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    rows = 32 if batch_size is None else int(batch_size)
    take = lambda t: t[:rows]  # noqa: E731
    x, y = keras.tree.map_structure(take, x), keras.tree.map_structure(take, y)
    shown = keras.tree.flatten(x)[0].shape[0]
    return _tensors(x), _tensors(y), f"a batch of {shown} rows"


def _tensors(data):
    import keras
    import tensorflow as tf

    return keras.tree.map_structure(tf.convert_to_tensor, data)


def training_setup(model, loss, optimizer):
    """The loss and optimizer each route compiles with: the arguments, else the model's compile."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}.")
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise ValueError(f"kmix.recommend times the training step of model {model.name!r}, which needs its "
                         "loss: compile the model first, or pass `loss=`. Received: loss=None.")
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    return loss, optimizer if optimizer is not None else "adam"


def fresh_optimizer(optimizer, learning_rate=None):
    """A new optimizer with `optimizer`'s settings (the inner one of a loss-scale optimizer).

    `learning_rate`, when given, replaces the configured one (a schedule included).
    """
    import keras

    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    config = optimizer.get_config()
    if learning_rate is not None:
        config["learning_rate"] = learning_rate
    return optimizer.__class__.from_config(config)


def still_at_zero(optimizer):
    """Whether `optimizer`'s kind, at learning rate 0, leaves a variable bit for bit as it was.

    Tried on a scratch variable, two steps of a gradient drawn at random
    (Keras's optimizers, weight decay included, scale every update by the
    learning rate; FTRL divides by it, and an optimizer of the user's may
    do anything). `recommend` then keeps no copy of the trainable weights.
    """
    import numpy as np
    import tensorflow as tf

    try:
        probe = fresh_optimizer(optimizer, learning_rate=0.0)
        rng = np.random.default_rng(0)
        start = rng.standard_normal((4, 3)).astype("float32")
        variable = tf.Variable(start)
        for _ in range(2):
            probe.apply_gradients([(tf.constant(rng.standard_normal((4, 3)).astype("float32")), variable)])
        return bool(np.array_equal(variable.numpy(), start))
    except Exception:  # noqa: BLE001  an optimizer that cannot step a scratch variable: keep the copy
        return False


def time_routes(model, batch, loss, optimizer, routes, budget_s, verbose=True, default_jit=False, start=None):
    """Builds, warms up and times every route that fits the budget; returns a `RouteTable` (no decision yet).

    Every route runs on `model`'s own variables (`kmix.route.inplace`): the
    model is placed in place for a route, the route's step traced, the model
    put back; one optimizer (the user's settings, learning rate 0, so that
    the weights do not move) serves every route. Only the non-trainable
    variables are copied (to disk) to be put back, unless the optimizer's
    kind moves a variable at learning rate 0 (`still_at_zero`): then all of
    them. On exit the model is as it was: layers, policies, weights bit for
    bit, compiled functions.

    Args:
        model: the user's model (left as it was).
        batch: `(x, y, description)` from `first_batch`.
        loss, optimizer: from `training_setup`.
        routes: `(policy, jit_compile)` pairs, in the order the table shows them.
        budget_s: seconds for the whole call, building and compiling
            included, counted from `start`. A route is built only when its
            build (estimated from the routes built so far) and `MIN_ROUNDS`
            rounds of every route fit in what is left; the first route
            (float32, Keras's default compilation) always is. The rounds
            share what is left.
        verbose: progress lines on stderr.
        default_jit: Keras's default compilation here (True with a GPU): its
            routes are built first, and the decision keeps it within the
            noise floor (the comparisons left unsettled depend on it).
        start: `time.perf_counter()` when the call began (now by default).
    """
    say = progress if verbose else (lambda message: None)
    x, y, described = batch
    start = time.perf_counter() if start is None else start
    deadline = start + budget_s
    inner = fresh_optimizer(optimizer, learning_rate=0.0)
    built, setup, first, over = {}, {}, {}, []
    order = sorted(routes, key=lambda r: (r[1] != default_jit, r[0] != "float32"))
    saved = "non-trainable" if still_at_zero(optimizer) else "all"  # no copy of the weights where none is needed
    with inplace.Preserved(model, saved=saved) as kept, _quiet_retracing(), warnings.catch_warnings():
        warnings.filterwarnings("once", category=UserWarning)  # autocast's, about the model: once, not per route
        for n, route in enumerate(order, 1):
            policy, jit = route
            label = _label(route)
            why = _over_budget(route, setup, first, deadline, budget_s) if built else None
            if why:
                over.append((label, why))
                say(f"kmix.recommend: [{n}/{len(order)}] {label}: not built, {why}")
                continue
            say(f"kmix.recommend: [{n}/{len(order)}] building and compiling {label}")
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
        left = max(deadline - time.perf_counter(), 0.0)
        per_round = left / TARGET_ROUNDS / len(built)
        steps = {route: max(1, int(per_round / max(first[route], 1e-6))) for route in built}
        say(f"kmix.recommend: timing {len(built)} routes in interleaved rounds ({left:.0f} s left of budget_s)")
        key = {route: (route[0].rsplit("-", 1)[-1], route[1]) for route in built}  # (dtype, jit)

        def more(rounds):
            open_ = rule.unsettled({key[route]: seconds for route, seconds in rounds.items()}, default_jit)
            return [route for route in built if key[route] in open_]

        alone = len(built) == 1  # nothing to compare it with: one round shows its step
        rounds = timing.run_rounds(built, steps, 0.0 if alone else left, min_rounds=1 if alone else MIN_ROUNDS,
                                   max_rounds=MAX_ROUNDS, more=more)
        built.clear()
    gc.collect()
    timings = tuple(RouteTiming(policy, bool(jit), tuple(rounds[(policy, jit)]), setup[(policy, jit)],
                                steps[(policy, jit)]) for policy, jit in routes if (policy, jit) in rounds)
    return RouteTable(timings, batch=described, seconds=time.perf_counter() - start, over_budget=tuple(over),
                      budget_s=budget_s)


STEPS_PER_BUILD = 3  # a route's build runs this many training steps (two to trace and build, one timed)
FORWARDS_PER_STEP = 3  # a training step costs about three forward passes (forward, two backward matmuls)


def build_estimate(model, x):
    """`(seconds a route's build is estimated to take, seconds one forward pass took)`, from one forward pass.

    `recommend` asks before building its first route: a model whose one
    route cannot fit the budget is recommended for from the device probe.
    The build is its steps (`STEPS_PER_BUILD` of about `FORWARDS_PER_STEP`
    forward passes each) and a trace (about one forward pass more).
    """
    begin = time.perf_counter()
    model(x, training=False)
    forward = time.perf_counter() - begin
    return forward * (STEPS_PER_BUILD * FORWARDS_PER_STEP + 1), forward


def _label(route):
    return f"{route[0]}, {'XLA' if route[1] else 'tf.function'}"


def _over_budget(route, setup, first, deadline, budget_s):
    """Why `route` is not built within the budget, or None when its build and the rounds fit.

    Its build is estimated as the longest build so far of the same
    compilation (else of any), its step as the slowest step so far.
    """
    same = [s for r, s in setup.items() if r[1] == route[1]]
    build = max(same or setup.values())
    rounds = MIN_ROUNDS * (sum(first.values()) + max(first.values()))
    left = deadline - time.perf_counter()
    if build + rounds <= left:
        return None
    return (f"budget_s={budget_s:g} cannot cover its build and compile (about {build:.1f} s, as the routes "
            f"built so far took) and {MIN_ROUNDS} rounds of every route ({rounds:.1f} s): {max(left, 0):.1f} s "
            "left")


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
