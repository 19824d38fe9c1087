"""`kmix.recommend()`: the fastest safe policy and compilation, measured on this device or on your model."""

import dataclasses
import time

from kmix import _compat
from kmix._output import progress
from kmix.route import data, facts, rule, trials
from kmix.route.decision import Recommendation, decide, decide_routes, no_half_timed  # noqa: F401  (public here)
from kmix.route.decision import policy_name as _policy
from kmix.route.probe import probe as measure_probe

PROBE_SHARE = 0.4  # of budget_s, for the device's probe before any route is built: XLA left out beyond it


@_compat.releases_custom_gradients
def recommend(model=None, x=None, y=None, *, sample=None, batch_size=None, loss=None, optimizer=None,
              dtypes=None, budget_s=30.0, probe=None, verbose=True):
    """Measures the fastest safe policy and `jit_compile`: on your model's training step, or on this device.

    With data it times each candidate route in interleaved rounds and leaves `model` as it was (docs/guide.md).

    Args:
        model: a built Keras model, compiled with its loss (and optimizer), or pass `loss=` (and `optimizer=`).
            Without data, only the size of the probe comes from it (its dense kernels).
        x, y: arrays of one row per example (the first `batch_size` rows are timed), or `x` a `tf.data.Dataset`
            of `(x, y)` batches (its first batch); or `sample`: one batch `(x, y)` or a dataset.
        batch_size: rows of `x`, `y` per step; 32 by default (as `fit`).
        loss, optimizer: override the model's compiled ones (`"adam"` if none); an optimizer is a Keras
            optimizer, its name or its config dict, its settings copied for every route.
        dtypes: the dtypes to time, e.g. `("float32", "bfloat16")`, instead of the probe's choice.
        budget_s: seconds for the whole call, probing, building and compiling included (a positive number; kept
            within 1.25x: the probe takes at most 0.4x, XLA left out of it where it would not fit, docs/guide.md).
        probe: a `kmix.device.Probe` to use instead of measuring one (where no half route was timed, the probe
            decides); `verbose`: progress lines on stderr.

    Returns:
        A `Recommendation` (`policy`, `jit_compile`, `reasons`, and with a model and data the `table` of routes).

    Example:

    >>> rec = kmix.recommend(model, x=x_train, y=y_train, budget_s=30)
    >>> print(rec)                    # the route, why, and the table of routes
    """
    start, budget_s = time.perf_counter(), _check_budget(budget_s)
    optimizer = data.check_optimizer(optimizer)
    if model is None or (x is None and y is None and sample is None):
        probe = _measured(probe, verbose and "probing this device (a transformer MLP's training step)",
                          None if model is None else model_shape(model), limit_s=budget_s)
        rec = decide(probe, facts.gpus(), facts.cpu_features(), facts.onednn_enabled())
        return rec if model is None else _noted(rec, "Sized from the model's dense layers, not timed on it: pass "
                                                "x=, y= (or sample=) to time your own training step on each route.")
    loss, optimizer = data.training_setup(model, loss, optimizer)
    batch = data.first_batch(x, y, sample, batch_size)
    data.check_fits(model, batch[0], "sample" if sample is not None else "x")
    notes = data.nonfinite_notes(batch, "sample" if sample is not None else None)
    if dtypes is None:
        probe = _measured(probe, verbose and "probing this device for the half dtypes worth timing", None,
                          _probe_budget(budget_s), PROBE_SHARE * budget_s)
        dtypes, skipped = rule.candidates(probe)
    else:
        dtypes, skipped = rule.check_dtypes(dtypes), ()
    routes, gpus = [(_policy(d), jit) for d in dtypes for jit in (False, True)], facts.gpus()
    build, forward = trials.build_estimate(model, batch[0])
    firsts = {route: trials.first_build(route, build, probe) for route in routes}
    spent = time.perf_counter() - start
    cheapest = min(seconds for (policy, _), seconds in firsts.items() if policy == "float32")
    if cheapest > budget_s - spent:  # not even one route fits: what this device's probe measured decides
        probe = _measured(probe, None, model_shape(model), _probe_budget(budget_s), budget_s - spent)
        rec = decide(probe, gpus, facts.cpu_features(), facts.onednn_enabled())
        return _noted(rec, f"budget_s={budget_s:g} left {max(budget_s - spent, 0):.1f} s after {spent:.1f} s of "
                      f"probing and checks: not enough to build one route on the model (about {cheapest:.1f} s, "
                      f"estimated as {trials.BUILD_FORWARDS} forward passes on the batch of {forward * 1e3:.0f} ms, "
                      "or a small model's build at the probe's pace). Recommended from this device's probe instead "
                      f"(above). Timing every route would take a budget_s of about {spent + sum(firsts.values()):.0f} "
                      f"s or more (this call's {spent:.0f} s again, {len(routes)} builds so estimated, and their "
                      "rounds), estimated, not measured: a busier machine needs more.",
                      *notes)
    table = trials.time_routes(model, batch, loss, optimizer, routes, budget_s, verbose,
                               default_jit=bool(gpus), start=start, probe=probe, first_builds=firsts)
    table = dataclasses.replace(table, skipped=tuple(skipped))
    if probe is None and no_half_timed(table):  # dtypes= given: the probe that decides is measured now
        probe = _measured(probe, verbose and "no half route timed within budget_s: probing this device to decide",
                          model_shape(model), _probe_budget(budget_s), budget_s - (time.perf_counter() - start))
    return _noted(decide_routes(table, probe, gpus, facts.cpu_features(), facts.onednn_enabled()), *notes)


def _measured(probe, why, shape, budget=0.25, limit_s=None):
    """`probe`, else the device's probe measured now (within `limit_s`), saying `why` on stderr (when truthy)."""
    if probe is None and why:
        progress(f"kmix.recommend: {why}")
    return measure_probe(shape, budget, limit_s) if probe is None else probe


def _noted(rec, *notes):
    return dataclasses.replace(rec, reasons=rec.reasons + notes) if notes else rec


def _probe_budget(budget_s):
    """The probe's `budget` within `budget_s`: a full-size probe costs about 200 times it, so a thousandth."""
    return min(0.25, budget_s / 1000)


def _check_budget(budget_s):
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < float("inf"):
        raise ValueError(f"`budget_s` must be a positive number of seconds (e.g. 30). Received: budget_s={budget_s!r}")
    return float(budget_s)


def model_shape(model):
    """`(m, k, n)` for the probe from a model's dense kernels, or None when it has none."""
    kernels = [tuple(v.shape) for v in model.trainable_variables
               if len(v.shape) == 2 and "kernel" in v.path.rsplit("/", 1)[-1]]
    if not kernels:
        return None
    ins, outs = zip(*kernels)
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return (1024, min(max(median(ins), 16), 8192), min(max(median(outs), 16), 8192))
