"""`kmix.recommend()`: the fastest safe policy and compilation for this device, measured.

The decision is `decide(probe, gpus, cpu)`, a pure function of the probe's
figures (`kmix.device.Probe`), so that every branch is tested with injected
figures; the device facts only explain it:

```
f32 = float32's best rate (tf.function or XLA)
half = bfloat16 if it is at least 1/FLOAT16_MARGIN as fast as float16, else float16
if rate(half) >= MIN_SPEEDUP * f32:  policy = "O1-<half>"      # worth its rounding
else:                                policy = "float32"
jit_compile = rate(policy's dtype, XLA) >= rate(policy's dtype, tf.function)
```

bfloat16 is preferred over float16 unless float16 is clearly faster: it has
float32's range, so it needs no loss scaling and does not overflow. The half
policy is Apex's O1 with that dtype (`kmix.autocast` places matmuls in it and
keeps normalization, softmax and the model's outputs in float32), spelled as
`kmix.Policy(...).name` spells it, a string every kmix entry point accepts.
"""

import dataclasses

from kmix import device

MIN_SPEEDUP = 1.1  # a half dtype must beat float32 by this much to be worth its rounding
# float16 is chosen over bfloat16 only when this much faster: it needs loss scaling and
# overflows at 65504, where bfloat16 has float32's range.
FLOAT16_MARGIN = 1.25


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
        probe: the `kmix.device.Probe` the decision came from.

    `print(rec)` shows a short report.
    """

    policy: str
    jit_compile: bool
    reasons: tuple
    loss_scaling: bool
    probe: object = None

    def __str__(self):
        lines = [f"Recommended: policy {self.policy!r}, jit_compile={self.jit_compile}"]
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


def recommend(model=None, probe=None):
    """Measures this device and returns the fastest safe policy and compilation.

    Args:
        model: optional; a built Keras model whose dense layers set the size
            of the probe (the median input and output widths of its
            `Dense` / `EinsumDense` kernels, over 1024 rows).
        probe: a `kmix.device.Probe` to decide from instead of measuring.

    Returns:
        A `Recommendation` (`policy`, `jit_compile`, `reasons`).

    Example:

    >>> rec = kmix.recommend()
    >>> print(rec)
    >>> model = kmix.autocast(build_model(), rec.policy)
    >>> with kmix.policy_scope(rec.policy):
    ...     model.compile(optimizer=kmix.wrap("adamw"), loss="mse", jit_compile=rec.jit_compile)
    """
    if probe is None:
        probe = device.probe(None if model is None else model_shape(model))
    return decide(probe, device.gpus(), device.cpu_features(), device.onednn_enabled())


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
    """The recommendation for measured figures and device facts (pure; see the module docstring).

    Args:
        probe: a `kmix.device.Probe` (or anything with its `rate` and `best`).
        gpus: `kmix.device.gpus()`: dicts with `name`, `compute_capability`.
        cpu: `kmix.device.cpu_features()`.
        onednn: whether oneDNN is on (None: unknown).

    Returns:
        A `Recommendation`.
    """
    f32, f32_jit = probe.best("float32")
    bf16, bf16_jit = probe.best("bfloat16")
    f16, f16_jit = probe.best("float16")
    half = "bfloat16" if bf16 * FLOAT16_MARGIN >= f16 else "float16"
    rate = bf16 if half == "bfloat16" else f16
    dtype = half if rate >= MIN_SPEEDUP * f32 else "float32"
    tf_rate, xla_rate = probe.rate(dtype, False), probe.rate(dtype, True)
    jit = xla_rate >= tf_rate
    reasons = [_facts_line(gpus, cpu, onednn)]
    reasons.append(
        f"Measured on {probe.device} ({_shape(probe)}), GFLOP/s as tf.function / XLA: "
        + "; ".join(f"{d} {_g(probe.rate(d, False))} / {_g(probe.rate(d, True))}" for d in device.DTYPES)
        + "."
    )
    if dtype == "float32":
        reasons.append(
            f"No half dtype is {MIN_SPEEDUP}x faster than float32 here (best: {half} {_g(rate)} "
            f"against {_g(f32)}): float32, which has no rounding or overflow to manage."
        )
    elif dtype == "bfloat16":
        reasons.append(
            f"bfloat16 runs {bf16 / f32:.2f}x float32's best{_vs_float16(bf16, f16)}: O1 with bfloat16 "
            "(float32's range: no loss scaling; kmix.wrap keeps a fixed scale of 1 and still "
            "skips non-finite steps)."
        )
    else:
        reasons.append(
            f"float16 runs {f16 / f32:.2f}x float32's best and {f16 / max(bf16, 1e-9):.2f}x "
            "bfloat16's: O1 with float16, which needs loss scaling: compile with "
            "kmix.wrap(optimizer) and keep softmax and masks in float32 (kmix.autocast does)."
        )
    compiled = "XLA" if jit else "tf.function"
    other = "tf.function" if jit else "XLA"
    reasons.append(
        f"{dtype} is faster as {compiled} ({_g(max(tf_rate, xla_rate))} against {_g(min(tf_rate, xla_rate))} "
        f"as {other}): jit_compile={jit}." + _xla_note(dtype, jit, gpus, onednn)
    )
    policy = "float32" if dtype == "float32" else f"O1-{dtype}"
    return Recommendation(policy, jit, tuple(reasons), dtype == "float16", probe)


def _g(rate):
    """A rate in GFLOP/s as printed: whole numbers, or 2 significant digits below 10."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def _shape(probe):
    m, k, n = probe.shape
    return f"training step of an MLP x + gelu(x @ w1 + b1) @ w2, x {m}x{k}, w1 {k}x{n}"


def _vs_float16(bf16, f16):
    return f" and {bf16 / max(f16, 1e-9):.2f}x float16's"


def _xla_note(dtype, jit, gpus, onednn):
    if gpus or jit or dtype != "bfloat16" or not onednn:
        return ""
    return (" XLA:CPU does not use oneDNN's bfloat16 kernels (TensorFlow 2.21; "
            "--xla_cpu_use_onednn changes nothing), so bfloat16 wants the tf.function route.")


def _facts_line(gpus, cpu, onednn):
    if gpus:
        parts = []
        for gpu in gpus:
            cc = gpu["compute_capability"]
            cores = device.tensor_cores(cc)
            shown = "unknown" if cc is None else f"{cc[0]}.{cc[1]}"
            parts.append(f"{gpu['name']} (compute capability {shown}: float16 tensor cores "
                         f"{_yes(cores['float16'])}, bfloat16 {_yes(cores['bfloat16'])})")
        return "GPU: " + "; ".join(parts) + "."
    flags = ", ".join(f"{name.upper().replace('_BF16', '-BF16') if name == 'amx_bf16' else name.upper()} "
                      f"{_yes(cpu.get(name))}" for name in ("avx512_bf16", "amx_bf16", "avx512_fp16"))
    where = "" if cpu.get("source") else " (no /proc/cpuinfo: features unknown)"
    dnn = {True: "on", False: "off", None: "unknown"}[onednn]
    return f"CPU: {cpu.get('model', 'unknown')}{where}; {flags}; oneDNN {dnn}; no GPU."


def _yes(flag):
    return {True: "yes", False: "no", None: "unknown"}[flag]
