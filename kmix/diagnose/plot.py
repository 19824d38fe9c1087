"""The diagnosis as a PNG: gradients against the half ranges, and max |activation| per layer."""

import math

import numpy as np

from kmix.diagnose import probe

_PER_BAR = 4  # bins of the histogram's 16 per octave grouped into one bar


def plot_diagnosis(diagnosis, path):
    """Draws `diagnosis` (a `kmix.Diagnosis`) into the PNG at `path`; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_grad, ax_act) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.1, 1]})
    _gradients(ax_grad, diagnosis)
    _activations(ax_act, diagnosis)
    fig.suptitle(f"kmix.diagnose: {diagnosis.model_name}, float32 vs {diagnosis.policy.name}", fontsize=12)
    longest = max([len(_short(r.path)) for r in diagnosis.layers] + [4])
    fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=min(0.12 + 0.0075 * longest, 0.34), wspace=0.15)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _gradients(ax, d):
    half = d.policy.compute_dtype
    limits = probe.HALF_RANGES[half]
    hist = d.histogram
    counts = hist.counts.reshape(-1, _PER_BAR).sum(axis=1)
    edges = hist.edges[::_PER_BAR]
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
    ax.bar(edges[:-1], share, width=1.0 / (hist.BINS_PER_OCTAVE / _PER_BAR), align="edge",
           color="tab:blue", alpha=0.8,
           label=f"float32 gradients, scale 1 ({_pct(d.underflow_fraction(1.0))} flush)")
    if d.recommended_scale and shift:
        ax.stairs(share, edges + shift, color="black", linewidth=1.2,
                  label=f"x recommended scale 2^{shift:g} ({_pct(d.underflow_fraction(d.recommended_scale))} flush)")
        if used.size:
            peak = int(np.argmax(share))
            x0, y0 = edges[peak] + 0.5 / (hist.BINS_PER_OCTAVE / _PER_BAR), share[peak]
            ax.annotate("", xy=(x0 + shift, y0 * 1.04), xytext=(x0, y0 * 1.04),
                        arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, max(share.max() * 1.7 if total > 1 else 1.0, 1.0))  # room for the legend
    ax.set(title=f"gradients (activations and weights): {total:,} nonzero values",
           xlabel="log2 |gradient|", ylabel="% of nonzero values")
    ax.legend(fontsize=8, loc="upper left", ncol=2, framealpha=0.9)


def _activations(ax, d):
    half = d.policy.compute_dtype
    limit = probe.HALF_RANGES[half].max
    rows = d.layers
    xs = np.arange(len(rows))
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
    if len(path) <= width:
        return path
    tail = path[-width:]
    return "..." + (tail[tail.index("/"):] if "/" in tail[:-3] else tail)


def _pct(fraction):
    text = probe.percent(fraction)
    return text if text.endswith("%") else text + "%"
