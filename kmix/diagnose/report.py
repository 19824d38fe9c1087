"""`kmix.Diagnosis`: what `kmix.diagnose` found, as a table, one line per finding, and a PNG."""

import math
import os

import numpy as np

from kmix import _checks as checks
from kmix.diagnose import probe
from kmix.diagnose.data import first_line

MARGIN = 8.0  # the recommended scale keeps the largest gradient this far below the half maximum
_PER_BAR = 4  # bins of the histogram's 16 per octave grouped into one bar in the PNG


class LayerStats:
    """One layer's row of the diagnosis (statistics over every call and batch).

    Attributes:
        path, target: its place in the model (`"attention0/qkv"`), the name `kmix.autocast` accepts for it.
        class_name, calls: the layer's class, and how many times it ran.
        output, gradient: `TensorStats` of its float32 outputs and of the loss's gradients with respect to them.
        input_max: the largest finite |input| it received in float32.
        half_nonfinite, verdict: whether its output was non-finite in the half run only; words for the table.
    """

    def __init__(self, node):
        self.path, self.target, self.class_name = node.path, node.target, type(node.layer).__name__
        self.calls, self.input_max, self.half_nonfinite, self.verdict = 0, 0.0, False, ""
        self.output, self.gradient = probe.TensorStats(), probe.TensorStats()

    def __repr__(self):
        return f"LayerStats({self.path!r}, {self.class_name}, max|out|={self.output.max_abs:.3g}, {self.verdict})"


class Diagnosis:
    """What `kmix.diagnose` found: where a float32 model would fail in half precision, and the fixes.

    Attributes:
        policy: the `kmix.Policy` that was checked.
        first_nonfinite_layer: the path of the first layer (in call order) whose output is non-finite under
            `policy` although finite in float32 (fed by finite inputs where one is); None when all stay finite.
        float32_layers: names of layers to keep in float32, as `kmix.autocast(float32_layers=...)` takes them.
        recommended_scale: the initial loss scale: the largest power of two keeping the largest gradient 8x
            below the half maximum (1.0 under bfloat16; None when no gradient was nonzero).
        recommended_policy: a `kmix.Policy`: `mixed_bfloat16` where activations overflow float16 and the device
            has bfloat16 hardware; O1 where some layer must stay float32; else `policy`.
        findings: one line per finding, each naming the layer and the fix.
        half_error: `(layer path, exception)` when the model raised under `policy`, else None.
        layers: a `LayerStats` row per layer that ran, in call order.
        weight_gradients, histogram: `{variable path: TensorStats}` of the weight gradients, and the
            `Log2Histogram` of every nonzero float32 gradient value.
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
        self.losses, self.batches, self.half_error = losses, batches, half_error
        self._reasons, self._bfloat16 = reasons, bfloat16_available
        self._limits = probe.HALF_RANGES[policy.compute_dtype]
        self.findings = self._findings()

    def underflow_fraction(self, scale=1.0):
        """The fraction of nonzero gradient values that flush to zero in the half dtype at `scale` (0 once cast).

        Exact for powers of two, within 1/16 of an octave otherwise; 0.0 when no gradient was nonzero.

        Args:
            scale: the loss scale, > 0.
        """
        scale = checks.real("scale", scale, low=0.0, low_open=True)
        return self.histogram.fraction_below(math.log2(self._limits.min_subnormal) - 1 - math.log2(scale))

    def overflow_fraction(self, scale=1.0):
        """The fraction of nonzero gradient values beyond the half maximum at `scale` (inf once cast), to 1/16 octave.

        Args:
            scale: the loss scale, > 0.
        """
        scale = checks.real("scale", scale, low=0.0, low_open=True)
        return self.histogram.fraction_above(math.log2(self._limits.max) - math.log2(scale))

    def _findings(self):
        half, limit, policy = self.policy.compute_dtype, self._limits.max, self.policy.name
        rows = {row.path: row for row in self.layers}
        lines = []
        if any(not math.isfinite(v) for v in self.losses):
            lines.append("The loss is non-finite in float32 already: not a precision problem. Check the "
                         "data, the labels and the learning rate before mixed precision.")
        if self.first_nonfinite_layer is not None:
            row = rows[self.first_nonfinite_layer]
            line = (f"{row.path} ({row.class_name}) is the first layer whose output is non-finite under "
                    f"{policy} although finite in float32.")
            if row.path not in self._reasons:
                line += (" Its inputs were already non-finite: an operation between layers (a keras.ops node) "
                         "overflowed before it. Fix: do that computation inside a layer kept in float32, or train "
                         "in bfloat16.")
            lines.append(line)
        for path, (reason, mask) in self._reasons.items():
            row, name = rows[path], f"{path} ({rows[path].class_name})"
            keep, island = f"keep {row.target} in float32", f"keep {row.target} in float32 (a float32 island)"
            finite = mask and math.isfinite(mask[0][0])
            constant = (f"a constant of {mask[0][0]:g}, beyond {half}'s +-{limit:g}," if finite
                        else f"a constant that is -inf in {half} (a number beyond +-{limit:g}, such as -1e9)")
            if reason == "error":
                e = self.half_error[1]
                lines.append(f"{name} raises under {policy} ({type(e).__name__}: {first_line(e)}): it mixes "
                             f"dtypes, such as a float32 constant or tensor in {half} math. Fix: create them with "
                             f"x.dtype (keras.ops.cast(c, x.dtype)), or {keep}. The half run stopped there.")
            elif reason == "mask" and mask[1]:
                lines.append(f"{name}: {constant} feeds a softmax: a hand-written additive mask; (1 - mask) * -inf "
                             "is NaN at every kept position. Fix: pass the boolean mask to kmix.layers.MaskedSoftmax "
                             f"(or kmix.layers.MultiHeadAttention's attention_mask), or {keep}.")
            elif reason == "mask":
                lines.append(f"{name}: {constant} is used inside it. Fix: {keep}, or use a constant within range.")
            elif reason == "inside":
                lines.append(f"{name}: its inputs are finite but its output is not: a value computed inside it "
                             f"exceeds {half}'s {limit:g}. Fix: {island}, or train in bfloat16.")
            elif reason == "output":
                lines.append(f"{name}: outputs reach {row.output.max_abs:.3g} in float32, beyond {half}'s {limit:g} "
                             f"({probe.percent(row.output.fraction(row.output.overflow))} of values). Fix: "
                             f"{island}, or train in bfloat16.")
            else:
                lines.append(f"{name}: its inputs reach {row.input_max:.3g}, beyond {half}'s {limit:g}, and it "
                             f"would cast them to {half}. Fix: {keep} as well.")
        if self.float32_layers:
            lines.append(f"Float32 islands: kmix.autocast(model, 'O1', float32_layers={self.float32_layers!r}), "
                         "or kmix.layers.WithPolicy(layer, 'float32') where the model is built.")
        return lines + [self._gradient_finding(), self._policy_finding()]

    def _gradient_finding(self):
        if self.recommended_scale is None:
            return "Gradients: none was nonzero, so no loss scale can be recommended."
        gmax = max([r.gradient.max_abs for r in self.layers] + [w.max_abs for w in self.weight_gradients.values()])
        at_one = probe.percent(self.underflow_fraction(1.0), zero="none")
        if self.policy.compute_dtype == "bfloat16":
            return (f"Gradients: {at_one} of the nonzero values flush to zero in bfloat16, whose range is "
                    "float32's: no loss scaling needed (scale 1); kmix.wrap still skips non-finite steps.")
        scale = self.recommended_scale
        return (f"Gradients: {at_one} of the nonzero values flush to zero in float16 at scale 1 (largest "
                f"|g| {gmax:.3g}). Initial scale 2^{int(math.log2(scale))} = {scale:g} leaves "
                f"{probe.percent(self.underflow_fraction(scale), zero='none')} flushing and keeps the largest "
                f"{MARGIN:g}x below 65504. Fix: kmix.wrap(optimizer, initial_scale={scale:g}"
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

    def __str__(self):
        half = self.policy.compute_dtype
        headers = ["layer", "class", "max |out|", f"out > {half}", "out -> 0", "max |grad|", "grad -> 0", "verdict"]
        body = [[r.path, r.class_name, f"{r.output.max_abs:.3g}", probe.percent(r.output.fraction(r.output.overflow)),
                 probe.percent(r.output.fraction(r.output.underflow)),
                 f"{r.gradient.max_abs:.3g}" if r.gradient.size else "-",
                 probe.percent(r.gradient.fraction(r.gradient.underflow)) if r.gradient.size else "-", r.verdict]
                for r in self.layers]
        widths = [max(len(str(row[i])) for row in [headers] + body) for i in range(len(headers))]
        table = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in [headers] + body]
        table.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([f"kmix.diagnose: model {self.model_name!r}, {self.batches} batch(es), float32 vs "
                          f"{self.policy.name}; fractions of values beyond {half}'s range (>) and flushed to zero "
                          "(-> 0)", ""] + table + ["", "Findings:"] + [f"- {f}" for f in self.findings])

    def __repr__(self):
        return (f"Diagnosis(model={self.model_name!r}, policy={self.policy.name!r}, "
                f"first_nonfinite_layer={self.first_nonfinite_layer!r}, float32_layers={self.float32_layers!r}, "
                f"recommended_scale={self.recommended_scale!r}, recommended_policy={self.recommended_policy.name!r})")

    def plot(self, path):
        """Saves the PNG at `path` (returned): gradients against the half ranges, max |activation| per layer."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`path` must be a file path (a str or os.PathLike) for the PNG. Received: path={path!r} "
                            f"(of type {type(path).__name__}).")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_grad, ax_act) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.1, 1]})
        _gradients(ax_grad, self)
        _activations(ax_act, self)
        fig.suptitle(f"kmix.diagnose: {self.model_name}, float32 vs {self.policy.name}", fontsize=12)
        longest = max([len(_short(r.path)) for r in self.layers] + [4])
        fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=min(0.12 + 0.0075 * longest, 0.34), wspace=0.15)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _gradients(ax, d):
    half, hist = d.policy.compute_dtype, d.histogram
    limits = probe.HALF_RANGES[half]
    counts, edges = hist.counts.reshape(-1, _PER_BAR).sum(axis=1), hist.edges[::_PER_BAR]
    total = max(int(counts.sum()), 1)
    share = 100.0 * counts / total
    flush = math.log2(limits.min_subnormal) - 1
    low_normal, high = math.log2(limits.min_normal), math.log2(limits.max)
    used = np.nonzero(counts)[0]
    shift = math.log2(d.recommended_scale) if d.recommended_scale else 0.0
    if used.size:
        lo = min(edges[used[0]], edges[used[0]] + shift, flush) - 4
        hi = max(edges[used[-1] + 1], edges[used[-1] + 1] + shift, high) + 4
    else:
        lo, hi = flush - 10, high + 4
    lo, hi = max(lo, hist.LOW), min(hi, hist.HIGH)
    ax.axvspan(lo, flush, color="tab:red", alpha=0.10, label=f"flushes to zero in {half}")
    # Values in [2^-25, 2^-24) round up to the smallest subnormal: they survive too.
    ax.axvspan(flush, low_normal, color="tab:orange", alpha=0.18, label=f"{half} subnormal")
    ax.axvspan(low_normal, high, color="tab:green", alpha=0.10, label=f"{half} normal range")
    ax.axvspan(high, hi, color="tab:red", alpha=0.25, label=f"overflows {half} (> {limits.max:.5g})")
    width = _PER_BAR / hist.BINS_PER_OCTAVE
    ax.bar(edges[:-1], share, width=width, align="edge", color="tab:blue", alpha=0.8,
           label=f"float32 gradients, scale 1 ({probe.percent(d.underflow_fraction(1.0), '0%')} flush)")
    if d.recommended_scale and shift:
        flushed = probe.percent(d.underflow_fraction(d.recommended_scale), "0%")
        ax.stairs(share, edges + shift, color="black", linewidth=1.2,
                  label=f"x recommended scale 2^{shift:g} ({flushed} flush)")
        if used.size:
            peak = int(np.argmax(share))
            x0, y0 = edges[peak] + width / 2, share[peak]
            ax.annotate("", xy=(x0 + shift, y0 * 1.04), xytext=(x0, y0 * 1.04),
                        arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, max(share.max() * 1.7 if total > 1 else 1.0, 1.0))  # room for the legend
    ax.set(title=f"gradients (activations and weights): {total:,} nonzero values",
           xlabel="log2 |gradient|", ylabel="% of nonzero values")
    ax.legend(fontsize=8, loc="upper left", ncol=2, framealpha=0.9)


def _activations(ax, d):
    half, rows = d.policy.compute_dtype, d.layers
    limit, xs = probe.HALF_RANGES[half].max, np.arange(len(rows))
    values = np.array([max(r.output.max_abs, 1e-30) for r in rows])
    flagged = np.array([r.path in d._reasons for r in rows], bool)
    downstream = np.array([r.half_nonfinite for r in rows], bool) & ~flagged
    fine = ~flagged & ~downstream
    ax.axhline(limit, color="tab:red", linestyle="--", label=f"{half} max {limit:.5g}")
    ax.scatter(xs[fine], values[fine], s=22, color="tab:blue", label="max |output| in float32", zorder=3)
    if downstream.any():
        ax.scatter(xs[downstream], values[downstream], s=30, facecolors="none", edgecolors="tab:orange",
                   zorder=3, label=f"non-finite in {half} from upstream")
    if flagged.any():
        ax.scatter(xs[flagged], values[flagged], s=45, color="tab:red", marker="D", zorder=4,
                   label="needs float32 (see the findings)")
        for i in np.nonzero(flagged)[0]:
            ax.annotate(probe.VERDICTS[d._reasons[rows[i].path][0]], xy=(xs[i], values[i]), xytext=(4, -12),
                        textcoords="offset points", fontsize=7, color="tab:red")
    if d.first_nonfinite_layer is not None:
        i = next(i for i, r in enumerate(rows) if r.path == d.first_nonfinite_layer)
        ax.annotate(f"first non-finite in {half}:\n{rows[i].path}", xy=(xs[i], values[i]),
                    xytext=(0.25, 0.93), textcoords="axes fraction", ha="center", va="top", fontsize=9,
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})
    ax.set_yscale("log")
    top = max(values.max() if values.size else 1.0, limit)
    ax.set_ylim(min(values.min() if values.size else 1.0, 1e-2) / 3, top * 1e4)  # room for the legend
    step = max(1, math.ceil(len(rows) / 40))
    ax.set_xticks(xs[::step])
    ax.set_xticklabels([_short(rows[i].path) for i in xs[::step]], rotation=60, ha="right", fontsize=7)
    ax.set(title="largest |activation| per layer, in call order", ylabel="max |output| (float32 run)")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)


def _short(path, width=30):
    """A layer path cut to its last `width` characters, on a `/` where possible."""
    tail = path[-width:]
    return path if len(path) <= width else "..." + (tail[tail.index("/"):] if "/" in tail[:-3] else tail)
