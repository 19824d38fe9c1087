"""`kmix.Diagnosis`: what `kmix.diagnose` found, as a table, one line per finding, and a PNG."""

import math
import os
import re

from kmix import _checks as checks
from kmix.diagnose import probe

MARGIN_WORDS = "8x"  # core.MARGIN, in the findings' words


class LayerStats:
    """One layer's row of the diagnosis (statistics over every call and batch).

    Attributes:
        path: the layer's place in the model, `"attention0/qkv"`.
        target: the name `kmix.autocast(float32_layers=...)` accepts for it.
        class_name, calls: the layer's class, and how many times it ran.
        output, gradient: `TensorStats` of its float32 outputs and of the loss's gradients with respect to them.
        input_max: the largest finite |input| it received in float32.
        half_nonfinite: whether its output was non-finite in the half run (and finite in float32).
        verdict: a few words for the table.
    """

    def __init__(self, node):
        self.path, self.target, self.class_name = node.path, node.target, type(node.layer).__name__
        self.calls = 0
        self.output, self.gradient = probe.TensorStats(), probe.TensorStats()
        self.input_max = 0.0
        self.half_nonfinite = False
        self.verdict = ""

    def __repr__(self):
        return f"LayerStats({self.path!r}, {self.class_name}, max|out|={self.output.max_abs:.3g}, {self.verdict})"


class Diagnosis:
    """What `kmix.diagnose` found: where a float32 model would fail in half precision, and the fixes.

    Attributes:
        policy: the `kmix.Policy` that was checked.
        first_nonfinite_layer: the path of the first layer (in call order)
            whose output is non-finite under `policy` although finite in
            float32 (fed by finite inputs where one is); None when all stay finite.
        float32_layers: names of layers to keep in float32, as
            `kmix.autocast(model, level, float32_layers=...)` accepts them.
        recommended_scale: the initial loss scale: the largest power of two
            keeping the largest gradient 8x below the half maximum (1.0
            under bfloat16; None when no gradient was nonzero).
        recommended_policy: a `kmix.Policy`: `mixed_bfloat16` where
            activations overflow float16 and the device has bfloat16
            hardware; O1 where some layer must stay float32; else `policy`.
        findings: one line per finding, each naming the layer and the fix.
        half_error: `(layer path, exception)` when the model raised under `policy`, else None.
        layers: a `LayerStats` row per layer that ran, in call order.
        weight_gradients: `{variable path: TensorStats}` of the weight gradients.
        histogram: the `Log2Histogram` of every nonzero float32 gradient value.
        losses: the float32 loss of each batch.

    Example:

    >>> d = kmix.diagnose(model, x, y)
    >>> print(d)
    >>> d.underflow_fraction(1.0), d.underflow_fraction(d.recommended_scale)
    >>> d.plot("diagnosis.png")
    """

    def __init__(self, model_name, policy, layers, weight_gradients, histogram, first_nonfinite_layer,
                 float32_layers, reasons, recommended_scale, recommended_policy, losses, batches,
                 bfloat16_available, half_error=None):
        self.model_name, self.policy, self.layers = model_name, policy, layers
        self.weight_gradients, self.histogram = weight_gradients, histogram
        self.first_nonfinite_layer, self.float32_layers = first_nonfinite_layer, float32_layers
        self.recommended_scale, self.recommended_policy = recommended_scale, recommended_policy
        self.losses, self.batches = losses, batches
        self._reasons, self._bfloat16 = reasons, bfloat16_available
        self.half_error = half_error
        self._limits = probe.HALF_RANGES[policy.compute_dtype]
        self.findings = self._findings()

    def underflow_fraction(self, scale=1.0):
        """The fraction of nonzero gradient values that flush to zero in the half dtype at `scale` (0 once cast).

        Exact for powers of two, within 1/16 of an octave otherwise.

        Args:
            scale: the loss scale, > 0.

        Returns:
            A fraction in [0, 1] (0.0 when no gradient was nonzero).
        """
        scale = checks.real("scale", scale, low=0.0, low_open=True)
        return self.histogram.fraction_below(math.log2(self._limits.min_subnormal) - 1 - math.log2(scale))

    def overflow_fraction(self, scale=1.0):
        """The fraction of nonzero gradient values beyond the half maximum at `scale` (inf once cast).

        Args:
            scale: the loss scale, > 0.

        Returns:
            A fraction in [0, 1], resolved to 1/16 of an octave.
        """
        scale = checks.real("scale", scale, low=0.0, low_open=True)
        return self.histogram.fraction_above(math.log2(self._limits.max) - math.log2(scale))

    # --------------------------------------------------------------- findings
    def _findings(self):
        half, limit = self.policy.compute_dtype, self._limits.max
        rows = {row.path: row for row in self.layers}
        lines = []
        if any(not math.isfinite(v) for v in self.losses):
            lines.append("The loss is non-finite in float32 already: not a precision problem. Check the "
                         "data, the labels and the learning rate before mixed precision.")
        if self.first_nonfinite_layer is not None:
            row = rows[self.first_nonfinite_layer]
            line = (f"{row.path} ({row.class_name}) is the first layer whose output is non-finite under "
                    f"{self.policy.name} although finite in float32.")
            if row.path not in self._reasons:
                line += (" Its inputs were already non-finite: an operation between layers (a keras.ops "
                         "node) overflowed before it. Fix: do that computation inside a layer kept in "
                         "float32, or train in bfloat16.")
            lines.append(line)
        for path, (reason, mask) in self._reasons.items():
            row, name = rows[path], f"{path} ({rows[path].class_name})"
            if mask and math.isfinite(mask[0][0]):
                constant = f"a constant of {mask[0][0]:g}, beyond {half}'s +-{limit:g},"
            else:
                constant = f"a constant that is -inf in {half} (a number beyond +-{limit:g}, such as -1e9)"
            if reason == "error":
                e = self.half_error[1]
                message = _first_line(e)
                lines.append(
                    f"{name} raises under {self.policy.name} ({type(e).__name__}: {message}): it mixes "
                    f"dtypes, such as a float32 constant or tensor in {half} math. Fix: create them with "
                    f"x.dtype (keras.ops.cast(c, x.dtype)), or keep {row.target} in float32. The half "
                    "run stopped there.")
            elif reason == "mask" and mask[1]:
                lines.append(
                    f"{name}: {constant} feeds a softmax: a hand-written additive mask; (1 - mask) * -inf "
                    "is NaN at every kept position. Fix: pass the boolean mask to kmix.layers.MaskedSoftmax "
                    f"(or kmix.layers.MultiHeadAttention's attention_mask), or keep {row.target} in float32.")
            elif reason == "mask":
                lines.append(f"{name}: {constant} is used inside it. Fix: keep {row.target} in float32, or "
                             "use a constant within range.")
            elif reason == "inside":
                lines.append(f"{name}: its inputs are finite but its output is not: a value computed inside "
                             f"it exceeds {half}'s {limit:g}. Fix: keep {row.target} in float32 (a float32 "
                             "island), or train in bfloat16.")
            elif reason == "output":
                lines.append(
                    f"{name}: outputs reach {row.output.max_abs:.3g} in float32, beyond {half}'s {limit:g} "
                    f"({probe.percent(row.output.fraction(row.output.overflow))} of values). Fix: keep "
                    f"{row.target} in float32 (a float32 island), or train in bfloat16.")
            else:
                lines.append(f"{name}: its inputs reach {row.input_max:.3g}, beyond {half}'s {limit:g}, and "
                             f"it would cast them to {half}. Fix: keep {row.target} in float32 as well.")
        if self.float32_layers:
            lines.append(f"Float32 islands: kmix.autocast(model, 'O1', float32_layers={self.float32_layers!r}), "
                         "or kmix.layers.WithPolicy(layer, 'float32') where the model is built.")
        lines.append(self._gradient_finding())
        lines.append(self._policy_finding())
        return lines

    def _gradient_finding(self):
        if self.recommended_scale is None:
            return "Gradients: none was nonzero, so no loss scale can be recommended."
        gmax = max([r.gradient.max_abs for r in self.layers] + [w.max_abs for w in self.weight_gradients.values()])
        at_one = _share(self.underflow_fraction(1.0))
        if self.policy.compute_dtype == "bfloat16":
            return (f"Gradients: {at_one} of the nonzero values flush to zero in bfloat16, whose range is "
                    "float32's: no loss scaling needed (scale 1); kmix.wrap still skips non-finite steps.")
        scale = self.recommended_scale
        return (f"Gradients: {at_one} of the nonzero values flush to zero in float16 at scale 1 (largest "
                f"|g| {gmax:.3g}). Initial scale 2^{int(math.log2(scale))} = {scale:g} leaves "
                f"{_share(self.underflow_fraction(scale))} flushing and keeps the largest "
                f"{MARGIN_WORDS} below 65504. Fix: kmix.wrap(optimizer, initial_scale={scale:g}"
                f"{', min_scale=%g' % scale if scale < 1 else ''}).")

    def _policy_finding(self):
        rec = self.recommended_policy
        if any(not math.isfinite(v) for v in self.losses):
            return ("Recommended policy: none yet: the float32 loss is non-finite, so the half-precision "
                    "run shows nothing to compare. Fix the float32 loss first, then diagnose again.")
        if rec.compute_dtype == "bfloat16" and self.policy.compute_dtype == "float16":
            return ("Recommended policy: mixed_bfloat16. Activations overflow float16, and the device has "
                    "bfloat16 hardware; bfloat16 has float32's range.")
        if self.float32_layers:
            overflow = any(r in ("output", "input", "inside") for r, _ in self._reasons.values())
            device = "" if not overflow or self._bfloat16 or self.policy.compute_dtype == "bfloat16" else (
                " (bfloat16, float32's range, would avoid the overflow, but this device has no bfloat16 "
                "hardware: no GPU tensor cores of compute capability 8.0+, no CPU AVX512_BF16 / AMX-BF16)")
            return f"Recommended policy: {rec.name} with the float32 layers above{device}."
        return (f"Nothing alarming: no layer overflows {self.policy.compute_dtype} and every output stays "
                f"finite under {self.policy.name}. Recommended policy: {rec.name} with kmix.wrap.")

    # ------------------------------------------------------------------ table
    def __str__(self):
        half = self.policy.compute_dtype
        headers = ["layer", "class", "max |out|", f"out > {half}", "out -> 0", "max |grad|", "grad -> 0", "verdict"]
        body = []
        for r in self.layers:
            grad = r.gradient
            body.append([r.path, r.class_name, f"{r.output.max_abs:.3g}",
                         probe.percent(r.output.fraction(r.output.overflow)),
                         probe.percent(r.output.fraction(r.output.underflow)),
                         f"{grad.max_abs:.3g}" if grad.size else "-",
                         probe.percent(grad.fraction(grad.underflow)) if grad.size else "-", r.verdict])
        widths = [max(len(str(row[i])) for row in [headers] + body) for i in range(len(headers))]
        lines = [f"kmix.diagnose: model {self.model_name!r}, {self.batches} batch(es), float32 vs "
                 f"{self.policy.name}; fractions of values beyond {half}'s range (>) and flushed to zero (-> 0)",
                 ""]
        for i, row in enumerate([headers] + body):
            lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += ["", "Findings:"] + [f"- {f}" for f in self.findings]
        return "\n".join(lines)

    def __repr__(self):
        return (f"Diagnosis(model={self.model_name!r}, policy={self.policy.name!r}, "
                f"first_nonfinite_layer={self.first_nonfinite_layer!r}, float32_layers={self.float32_layers!r}, "
                f"recommended_scale={self.recommended_scale!r}, recommended_policy={self.recommended_policy.name!r})")

    def plot(self, path):
        """Saves a PNG: the gradient histogram against the half ranges, and max |activation| per layer.

        Args:
            path: the PNG's path.

        Returns:
            `path`.
        """
        from kmix.diagnose.plot import plot_diagnosis

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"`path` must be a file path (a str or os.PathLike) for the PNG. Received: path={path!r} "
                f"(of type {type(path).__name__})."
            )
        return plot_diagnosis(self, path)


def _first_line(error):
    """The informative line of an exception's message (Keras puts its own line and ANSI codes first)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("Exception encountered when calling")]
    return (useful or lines or [type(error).__name__])[0][:200]


def _share(fraction):
    """A fraction in words: "none", "<0.01%", "3.1%"."""
    return "none" if fraction == 0 else probe.percent(fraction)


