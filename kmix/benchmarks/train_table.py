"""`bench train`'s results shown: the rows with their ratios to Keras's default float32 compile, and the plot."""

from kmix.benchmarks.common import compiled, format_bytes as _bytes
from kmix.route import timing


def format_rows(results):
    """Table rows; the ratios are the first float32 Keras row's step time (peak memory) over each row's."""
    base = _baseline(results)
    return [[r["policy"], r["stack"], compiled(r["jit_compile"]), r["step_seconds"] * 1e3,
             round(r["tokens_per_second"]), "n/a" if r["tflops"] is None else r["tflops"], _bytes(r["peak_bytes"]),
             speedup(base, r) if base else "n/a",
             r["peak_bytes"] / base["peak_bytes"] if base and r["peak_bytes"] is not None and base["peak_bytes"]
             else "n/a"] for r in results]


def speedup(base, row):
    """`base`'s step time over `row`'s: round by round (the median ratio) within a phase, else of the medians."""
    paired = base.get("phase") is not None and base.get("phase") == row.get("phase")
    return timing.paired(base["rounds"], row["rounds"])[0] if paired else base["step_seconds"] / row["step_seconds"]


def control_line(results):
    """Whether the float32 Keras route, timed twice (`keras-again`), measured alike; "" without the control."""
    base, again = _baseline(results), _first(results, "keras-again")
    if base is None or again is None or base.get("phase") != again.get("phase") or base.get("phase") is None:
        return ""
    ratio, noise = timing.paired(base["rounds"], again["rounds"])
    held = abs(ratio - 1) <= noise
    return (f"control: the float32 Keras route, built and timed twice, measures {ratio:.3f}x itself round by "
            f"round (noise {noise:.1%}): " + ("the same within the noise; the ratios above hold." if held else
                                             "NOT the same within the noise: the machine's speed changed "
                                             "during the run; rerun it on a quieter machine."))


def summary_line(results):
    """The `recommend(model)` row against Keras's default float32 compile and the fastest row."""
    row, base = _first(results, "recommend(model)"), _baseline(results)
    if row is None:
        return ""
    fastest = min(results, key=lambda r: r["step_seconds"])
    against_base = f"{speedup(base, row):.2f}x Keras's default float32 compile, " if base else ""
    return (f"kmix.recommend(model) chose {row['policy']}, {compiled(row['jit_compile'])}: {against_base}"
            f"{speedup(fastest, row):.2f}x the fastest row ({row_label(fastest)}) in this table.")


def headline(results):
    """The plot's title: the `recommend(model)` row's (else `recommended`'s, else the fastest's) speed, in a line."""
    base, fastest = _baseline(results), min(results, key=lambda r: r["step_seconds"])
    row = _first(results, "recommend(model)") or _first(results, "recommended")
    if row is None:
        name, row = f"The fastest route: {row_label(fastest)}", fastest
    else:
        who = "kmix.recommend(model)" if row["stack"] == "recommend(model)" else "kmix.recommend()"
        name = f"{who} picks {row['policy']}, {compiled(row['jit_compile'])}"
    if base is None:
        return f"{name}: {row['tokens_per_second']:,.0f} items/s"
    versus = "" if row is fastest else f" ({speedup(fastest, row):.2f}x the fastest route)"
    return f"{name}: {speedup(base, row):.2f}x the speed of Keras's default float32{versus}"


def row_label(row):
    """`"mixed_bfloat16, kmix, XLA"`: a row's policy, stack and compilation."""
    return f"{row['policy']}, {row['stack']}, {compiled(row['jit_compile'])}"


def plot(results, path, subtitle=""):
    """Saves `figure(results, subtitle)` as a PNG at `path`; returns `path`."""
    import matplotlib.pyplot as plt

    fig = figure(results, subtitle)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def figure(results, subtitle=""):
    """Each route's speed against Keras's default float32 compile (and peak memory where known), one bar each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    base = _baseline(results)
    ratios = [speedup(base, r) if base else r["tokens_per_second"] for r in results]
    has_memory = all(r["peak_bytes"] is not None for r in results)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(15 if has_memory else 10, 2.2 + 0.4 * len(results)),
                             squeeze=False, sharey=True, layout="constrained")
    colors = {"float32": "tab:blue", "mixed_float16": "tab:orange", "mixed_bfloat16": "tab:green",
              "O1-bfloat16": "tab:green", "O1-float16": "tab:orange"}
    color = ["0.6" if r is base else colors.get(r["policy"], "tab:purple") for r in results]
    edges = ["black" if r["stack"] in ("recommended", "recommend(model)") else "none" for r in results]
    y = list(range(len(results)))[::-1]  # the table's first row on top
    ax = axes[0, 0]
    ax.barh(y, ratios, color=color, edgecolor=edges, linewidth=2)
    for yi, ratio, r in zip(y, ratios, results):
        text = f"{ratio:.2f}x" + (" (baseline)" if r is base else "") if base else f"{ratio:,.0f}"
        ax.text(ratio, yi, " " + text, va="center", fontsize=9)
    if base:
        ax.axvline(1.0, color="0.3", linestyle="--", linewidth=1)
    ax.set(xlim=(0, max(ratios) * 1.22),
           xlabel="speed x Keras's default float32 compile (its step time / this route's)" if base else "items / s")
    ax.set_yticks(y, [row_label(r) for r in results], fontsize=9)
    shown = [("0.6", "none", "Keras's default float32 (baseline)"), ("tab:blue", "none", "float32"),
             ("tab:green", "none", "bfloat16"), ("tab:orange", "none", "float16"),
             ("white", "black", "picked by kmix.recommend")]
    fig.legend(handles=[Patch(facecolor=c, edgecolor=e, linewidth=2, label=t) for c, e, t in shown],
               loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    ax.set_title(subtitle, loc="left", fontsize=9, color="0.25")
    if has_memory:
        peak = [r["peak_bytes"] / 2**30 for r in results]
        axes[0, 1].barh(y, peak, color=color, edgecolor=edges, linewidth=2)
        for yi, gib in zip(y, peak):
            axes[0, 1].text(gib, yi, f" {gib:.2f} GiB", va="center", fontsize=9)
        axes[0, 1].set(xlim=(0, max(peak) * 1.25), title="peak device memory", xlabel="GiB")
    fig.suptitle(headline(results), fontsize=12, fontweight="bold")
    return fig


def _baseline(results):
    return next((r for r in results if r["policy"] == "float32" and r["stack"] == "keras"), None)


def _first(results, stack):
    return next((r for r in results if r["stack"] == stack), None)

