"""The decision: the fastest safe route from `times` `{(dtype, jit_compile): seconds per step, one per round}`.

```
best(dtype) = its compilation that is faster by more than NOISE_FLOOR (3%), else Keras's default
for each half dtype h, r = best(float32)'s step / best(h)'s step, round by round (`timing.bounds`):
    beyond the noise: low > 1 and median > 1 + NOISE_FLOOR -> a win (if median >= min_gain)
    settled: high <= 1 + NOISE_FLOOR -> no win; otherwise the tie rule decides:
        tie="median": a win when median > 1 + NOISE_FLOOR (and >= min_gain); tie="float32": no win
route = the winning half dtype (float16 over bfloat16 only when float16_margin faster, beyond the noise), else float32
```
"""

import dataclasses

from kmix.route import timing
from kmix.route.probe import DTYPES

MIN_SPEEDUP = 1.1  # the probe: a half dtype must beat float32 by this much to be worth its rounding
FLOAT16_MARGIN = 1.25  # the probe: float16 over bfloat16 only this much faster (it needs loss scaling)
TIES = ("median", "float32")
CANDIDATE = 0.85  # a half dtype is timed on the model when the probe ran it at least this fast as float32


@dataclasses.dataclass(frozen=True)
class Gain:
    """A half dtype's best `route` against float32's: `ratio` (above 1: faster), `noise`, interval `low`, `high`."""

    route: tuple
    ratio: float
    noise: float
    low: float
    high: float

    @property
    def beyond_noise(self):
        """Faster than float32 beyond the noise (the lower bound above 1, the median above the floor)."""
        return self.ratio > 1 + self.noise

    @property
    def settled(self):
        """Whether the rounds tell: faster beyond the noise, or at most `NOISE_FLOOR` faster."""
        return self.beyond_noise or self.high <= 1 + timing.NOISE_FLOOR


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `choose` found: the `route`, float32's `reference`, `gains` per half dtype, those the `tie` rule decided."""

    route: tuple
    reference: tuple
    gains: dict
    tie: tuple = ()


def best(times, dtype, default_jit):
    """`dtype`'s route: its other compilation only when faster than the default by more than `NOISE_FLOOR`."""
    configs = [c for c in times if c[0] == dtype]
    default = (dtype, default_jit) if (dtype, default_jit) in times else configs[0]
    for other in configs:
        if other != default and timing.paired(times[default], times[other])[0] > 1 + timing.NOISE_FLOOR:
            return other
    return default


def gain(times, reference, route):
    """`Gain` of `route` over `reference`, round by round."""
    low, ratio, high = timing.bounds(times[reference], times[route])
    return Gain(route, ratio, max(ratio - low, timing.NOISE_FLOOR), low, high)


def choose(times, default_jit, min_gain, float16_margin, tie="median"):
    """The `Choice` of the fastest safe route from interleaved timings (pure; the rule is the module's).

    Args:
        times: `{(dtype, jit_compile): [seconds per round]}` (float32 required).
        default_jit: the compilation kept when both are within `NOISE_FLOOR` (True with a GPU).
        min_gain, float16_margin: the least speed-up of a half dtype over float32, of float16 over bfloat16.
        tie: what an unsettled comparison gives: `"median"` or `"float32"`.
    """
    if tie not in TIES:
        raise ValueError(f"`tie` must be one of {TIES}. Received: tie={tie!r}")
    reference = best(times, "float32", default_jit)
    gains = {h: gain(times, reference, best(times, h, default_jit))
             for h in ("bfloat16", "float16") if any(c[0] == h for c in times)}
    wins, ties = {}, []
    for half, g in gains.items():
        if g.ratio < min_gain or g.ratio <= 1 + timing.NOISE_FLOOR:
            continue
        if g.beyond_noise:
            wins[half] = g
        elif not g.settled:
            ties.append(half)
            if tie == "median":
                wins[half] = g
    if not wins:
        return Choice(reference, reference, gains, tuple(ties))
    if "float16" in wins and "bfloat16" in wins:
        ratio, noise = timing.paired(times[wins["bfloat16"].route], times[wins["float16"].route])
        half = "float16" if ratio >= float16_margin and ratio > 1 + noise else "bfloat16"
    else:
        half = next(iter(wins))
    return Choice(wins[half].route, reference, gains, tuple(ties))


def unsettled(times, default_jit):
    """The routes of the comparisons `choose` reads (`Gain.settled`) that the rounds have not settled yet."""
    open_ = set()
    for dtype in {c[0] for c in times}:
        configs = [c for c in times if c[0] == dtype]
        if len(configs) == 2 and not (gain(times, *configs).settled and gain(times, *configs[::-1]).settled):
            open_.update(configs)
    if any(c[0] == "float32" for c in times):
        reference = best(times, "float32", default_jit)
        for route in [best(times, h, default_jit) for h in ("bfloat16", "float16") if any(c[0] == h for c in times)]:
            if not gain(times, reference, route).settled:
                open_.update((reference, route))
    return open_


def candidates(probe):
    """The dtypes worth timing on a model, from a probe: `(dtypes, [(dtype, why not), ...])`."""
    f32, chosen, skipped = probe.best("float32")[0], ["float32"], []
    for half in ("bfloat16", "float16"):
        rate = max((probe.rate(half, jit) for jit in (False, True) if (half, jit) not in probe.screened), default=0.0)
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
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"`dtypes` must name some of {DTYPES}. Received: dtypes={dtypes!r}")
    return ["float32"] + [d for d in DTYPES[1:] if d in dtypes]  # float32 is the reference


def build_order(routes, probe=None, default_jit=False):
    """`routes` (`(policy, jit_compile)` pairs) in build order: float32's reference, the probe's best half, the rest.

    Without a `probe`, Keras's default compilation (`default_jit`) first, float32 first within each.
    """
    routes = list(dict.fromkeys(routes))
    if probe is None:
        return sorted(routes, key=lambda r: (r[1] != default_jit, r[0] != "float32"))
    rate = lambda route: probe.rate(dtype_of(route[0]), route[1])  # noqa: E731
    float32, order = [r for r in routes if r[0] == "float32"], []
    if float32:
        jit = best({c: t for c, t in probe.times().items() if c[0] == "float32"}, "float32", default_jit)[1]
        order.append(("float32", jit) if ("float32", jit) in float32 else float32[0])
    order += sorted((r for r in routes if r[0] != "float32"), key=rate, reverse=True)[:1]  # the probe's best half
    return order + sorted((r for r in routes if r not in order), key=rate, reverse=True)


def dtype_of(policy):
    """The compute dtype of a route's policy: `"O1-bfloat16"` -> `"bfloat16"`, `"float32"` -> `"float32"`."""
    return policy.rsplit("-", 1)[-1]
