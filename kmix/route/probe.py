"""The measured probe (`kmix.device.probe`): a transformer MLP's training step per dtype and compilation."""

import dataclasses
import functools
import time

import tensorflow as tf

from kmix.route import timing
from kmix.route.facts import cpu_features, gpus

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Probe:
    """Measured throughput of a transformer MLP's training step per dtype and compilation.

    Attributes:
        device: where it ran (`"CPU"` or a GPU's name).
        shape: `(m, k, n)`: `x` of shape `(m, k)`, `w1` `(k, n)`, `w2` `(n, k)`.
        gflops: `{(dtype, jit_compile): GFLOP/s}` (`12*rows*k*n` matmul FLOPs per step over the median round).
        seconds, rounds: how long the probe took; `{(dtype, jit_compile): seconds of each round}` (or None).
        rows: the rows every timed configuration ran on: `m`, or `m // 16` where `m` would not fit the budget.
        screened: configurations `SCREEN` times slower than the fastest on a first call at `m // 16` rows.
        tf32: whether float32 matmuls could use TF32 tensor cores (None: not recorded).
        compilations: the `jit_compile` values probed: `(False,)` where XLA's did not fit the probe's `limit_s`.
    """

    device: str
    shape: tuple
    gflops: dict
    seconds: float = 0.0
    rounds: dict = None
    rows: int = None
    screened: tuple = ()
    tf32: bool = None
    compilations: tuple = (False, True)

    def rate(self, dtype, jit_compile):
        """GFLOP/s of `dtype` as a `tf.function` (`jit_compile=False`) or under XLA; 0.0 where not probed."""
        return self.gflops.get((dtype, bool(jit_compile)), 0.0)

    def best(self, dtype):
        """`(GFLOP/s, jit_compile)` of `dtype`'s faster compilation."""
        return max((self.rate(dtype, jit), jit) for jit in self.compilations)

    def times(self):
        """`{(dtype, jit_compile): seconds per round}`: the rounds, else one round of 1/rate per configuration."""
        if self.rounds is not None:
            return {config: list(seconds) for config, seconds in self.rounds.items()}
        return {config: [1.0 / max(rate, 1e-12)] for config, rate in self.gflops.items() if config not in self.screened}

    @property
    def step(self):
        """The step timed, at the rows timed: `"x + gelu(x @ w1 + b1) @ w2, x 1024x512, w1 512x2048"`."""
        m, k, n = self.shape
        return f"x + gelu(x @ w1 + b1) @ w2, x {self.rows or m}x{k}, w1 {k}x{n}"

    def __str__(self):
        rounds = f", median of {len(next(iter(self.rounds.values())))} interleaved rounds" if self.rounds else ""
        tf32 = f", TF32 {'on' if self.tf32 else 'off'}" if self.tf32 is not None and "CPU" not in self.device else ""
        lines = [f"training step of {self.step}, on {self.device} ({self.seconds:.1f} s{rounds}{tf32}): "
                 "GFLOP/s (spread)", f"  {'dtype':<9} {'tf.function':>16} {'XLA':>16}"]
        lines += [f"  {d:<9} {self._cell(d, False):>16} {self._cell(d, True):>16}" for d in DTYPES]
        if True not in self.compilations:
            lines.append("  -: XLA not probed: its compilations would not fit the probe's limit_s")
        if self.screened:
            lines.append(f"  *: {SCREEN}x slower than the fastest on a first call at {max(1, self.shape[0] // 16)} "
                         "rows (all at that size); not timed further")
        return "\n".join(lines)

    def _cell(self, dtype, jit):
        if jit not in self.compilations:
            return "-"
        config, rate = (dtype, jit), f"{self.gflops[(dtype, jit)]:.4g}"
        if config in self.screened:
            return rate + " *"
        return f"{rate} ({timing.spread(self.rounds[config]):.0%})" if self.rounds and config in self.rounds else rate


PROBE_ROUNDS = 7  # interleaved rounds of every configuration, at least
SCREEN = 4  # a configuration this much slower than the fastest on the first call is not timed further
MIN_GPU_CALL_S = 2e-3  # a GPU call shorter than this is mostly kernel launches: the rows grow until it is not
GPU_TENSOR_BYTES = 2**28  # the rows grow at most until a float32 (rows, max(k, n)) tensor takes this much
XLA_COST = 8  # XLA's compilations take ~6x the tf.function traces (2-core AMD EPYC, load 9: 11.3 s against 1.8)
_MEASURED = {}  # {(shape, budget, on_gpu, tf32): Probe}: one probe per process, the fullest measured


def probe(shape=None, budget=0.25, limit_s=None):
    """Times the training step of `x + gelu(x @ w1 + b1) @ w2` per dtype, as a `tf.function` and under XLA; cached.

    Args:
        shape: `(m, k, n)`; by default `(1024, 512, 2048)` on a CPU and `(8192, 4096, 4096)` on a GPU, where
            the rows double while a call is shorter than `MIN_GPU_CALL_S`, up to `gpu_row_limit(shape)`.
        budget: seconds of rounds per configuration; where the fastest full-size call would take longer, all
            run at `m // 16` rows.
        limit_s: seconds the probe may take (None: no limit). XLA's compilations are left out (`compilations`)
            where the tf.function traces, `XLA_COST` times over, would not fit what is left of it.

    Returns:
        A `Probe`, measured once per shape, budget and TF32 setting in a process (again where an earlier
        one left XLA out and `limit_s` allows more).

    Example:

    >>> kmix.device.probe().best("bfloat16")   # (GFLOP/s, jit_compile)
    """
    on_gpu = bool(tf.config.list_physical_devices("GPU"))
    shape = ((8192, 4096, 4096) if on_gpu else (1024, 512, 2048)) if shape is None else shape
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"`shape` must be three positive ints (m, k, n). Received: shape={shape!r}")
    key = (shape, float(budget), on_gpu, tf.config.experimental.tensor_float_32_execution_enabled())
    known = _MEASURED.get(key)
    if known is None or (True not in known.compilations and limit_s is None):
        _MEASURED[key] = _probe(*key, limit_s=limit_s)  # without a limit: XLA's too
    return _MEASURED[key]


def gpu_row_limit(shape):
    """The most rows `probe` grows `x` to on a GPU: `m`, or a float32 `(rows, max(k, n))` of `GPU_TENSOR_BYTES`."""
    m, k, n = shape
    return max(m, GPU_TENSOR_BYTES // (4 * max(k, n)))


def size_rows(seconds_at, rows, limit, min_seconds=MIN_GPU_CALL_S):
    """The rows, doubling from `rows` up to `limit`, at which one call (`seconds_at(rows)`) takes `min_seconds`.

        >>> size_rows(lambda rows: 1e-4 + rows * 1e-7, 1024, 65536)  # 1e-4 + 32768e-7 >= 2e-3
        32768
    """
    while rows < limit and seconds_at(rows) < min_seconds:
        rows = min(rows * 2, limit)
    return rows


def _probe(shape, budget, on_gpu, tf32, limit_s=None):
    start = time.perf_counter()
    m, k, n = shape
    limit = gpu_row_limit(shape) if on_gpu else m
    tensors = mlp_tensors((limit, k, n), DTYPES)
    fns = step_functions([(dtype, jit) for jit in (False, True) for dtype in DTYPES])  # tf.function's first
    at = lambda dtype, rows: [tensors[dtype][0][:rows]] + tensors[dtype][1:]  # noqa: E731  (x cut to `rows`)
    small_rows = max(1, m // 16)
    first = {config: _first_call(fns[config], at(config[0], small_rows)) for config in fns if not config[1]}
    traced = time.perf_counter() - start
    compilations = (False, True) if limit_s is None or (1 + XLA_COST) * traced <= limit_s else (False,)
    fns = {config: fn for config, fn in fns.items() if config[1] in compilations}
    first.update({config: _first_call(fn, at(config[0], small_rows)) for config, fn in fns.items() if config[1]})
    rows, screened = plan_rows(first, m, small_rows, budget)
    if on_gpu and rows == m:
        fastest = min(first, key=first.get)
        rows = size_rows(lambda r: _first_call(fns[fastest], at(fastest[0], r)), rows, limit)
    args = {dtype: at(dtype, rows) for dtype in DTYPES}
    calls = {c: functools.partial(_call, fn, args[c[0]]) for c, fn in fns.items() if c not in screened}
    for call in calls.values():  # trace at this size, and warm up
        call()
        call()
    rounds = timing.run_rounds(calls, dict.fromkeys(calls, 1), budget * len(calls), min_rounds=PROBE_ROUNDS)
    gflops = {config: 12 * small_rows * k * n / first[config] / 1e9 for config in screened}
    gflops.update({config: 12 * rows * k * n / timing.median(seconds) / 1e9 for config, seconds in rounds.items()})
    where = gpus()[0]["name"] if on_gpu else f"CPU ({cpu_features()['model']})"
    return Probe(where, shape, gflops, time.perf_counter() - start,
                 {config: tuple(seconds) for config, seconds in rounds.items()}, rows, screened, tf32, compilations)


def plan_rows(first, m, small_rows, budget):
    """`(rows, screened)` from `first` `{config: seconds}` at `small_rows`: `m` if the fastest fits `budget` there."""
    fastest = min(first.values())
    screened = tuple(c for c in first if c[0] != "float32" and first[c] > SCREEN * fastest)
    return (m if fastest * m / small_rows <= budget else small_rows), screened


def _call(fn, args):
    fn(*args).numpy()  # waits for the device, so the time is real


def _first_call(fn, args):
    """Seconds of the faster of two calls after the one that traces (or compiles)."""
    _call(fn, args)
    return min(timing.seconds(lambda: _call(fn, args)) for _ in range(2))


def mlp_tensors(shape, dtypes):
    """`{dtype: [x, w1, b1, w2]}`: the MLP's seeded inputs and weights for `shape` `(m, k, n)`."""
    m, k, n = shape
    gen = tf.random.Generator.from_seed(0)
    tensors32 = (gen.normal((m, k)), gen.normal((k, n), stddev=k**-0.5), tf.zeros((n,)),
                 gen.normal((n, k), stddev=n**-0.5))
    return {dtype: [tf.cast(t, dtype) for t in tensors32] for dtype in dtypes}


def step_functions(configs):
    """`{(dtype, jit_compile): tf.function of train_step}`, each around a partial of its own.

    TensorFlow counts retracing per Python code object: functions of one callable would warn of it.
    """
    return {config: tf.function(functools.partial(train_step), jit_compile=config[1]) for config in configs}


def train_step(x, w1, b1, w2):
    """The gradients of a float32 loss of the MLP with respect to its input and weights."""
    with tf.GradientTape() as tape:
        tape.watch([x, w1, b1, w2])
        y = x + tf.matmul(tf.nn.gelu(tf.matmul(x, w1) + b1), w2)
        loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32)))
    return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in tape.gradient(loss, [x, w1, b1, w2])])
