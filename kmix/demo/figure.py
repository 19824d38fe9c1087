"""The demo's figure: every run's loss per step and both mixed runs' loss scales, under a title stating the result."""

import numpy as np

from kmix.demo.report import headline


def plot_results(results, policy, path):
    """Saves `figure(results, policy)` as a PNG at `path`; returns `path`."""
    import matplotlib.pyplot as plt

    fig = figure(results, policy)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(results, policy):
    """The demo's matplotlib figure: every run's loss per step, kmix's loss scale and the naive run's (Keras's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ours, ax_naive) = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    labels = {"float32": "float32", "naive": f"{policy}, -1e9 mask", "kmix": f"{policy}, kmix"}
    colors = {"float32": "tab:blue", "naive": "tab:red", "kmix": "tab:green"}
    finite_losses = []
    for run, r in results.items():
        losses = np.asarray(r["losses"], dtype=float)
        steps = np.arange(1, len(losses) + 1)
        finite = np.isfinite(losses)
        if finite.any():
            finite_losses.append(losses[finite])
            # float32 wide and underneath: where kmix tracks it exactly, both stay visible.
            wide = run == "float32"
            ax_loss.plot(steps, np.where(finite, losses, np.nan), color=colors[run], label=labels[run],
                         linewidth=3 if wide else 1, alpha=0.5 if wide else 1.0, zorder=1 if wide else 2)
        if r["first_nan_step"] is not None:
            always = "" if finite.any() else " on (no finite loss: no line)"
            ax_loss.axvline(r["first_nan_step"], color=colors[run], linestyle=":", linewidth=2,
                            label=f"{labels[run]}: NaN from step {r['first_nan_step']}{always}")
    if finite_losses:
        ax_loss.set_ylim(0, max(v.max() for v in finite_losses) * 1.15)  # room for the legend
    ax_loss.set(title="training loss per step", xlabel="step", ylabel="loss")
    ax_loss.legend(fontsize=8, loc="upper right")
    _plot_kmix_scale(ax_ours, results["kmix"], colors["kmix"], labels["kmix"])
    _plot_naive_scale(ax_naive, results["naive"], colors["naive"], labels["naive"])
    fig.suptitle(headline(results, policy), fontsize=12, fontweight="bold")
    fig.tight_layout()
    return fig


def _plot_kmix_scale(ax, r, color, label):
    scales = np.asarray(r["scales"], dtype=float)
    steps = np.arange(1, len(scales) + 1)
    ax.set(title="kmix: loss scale (kmix.wrap)", xlabel="step", ylabel="loss scale")
    if not len(scales):
        return
    ax.step(steps, scales, where="post", color=color, label=label)
    drops = steps[1:][scales[1:] < scales[:-1]]
    if len(drops):
        ax.plot(drops, scales[drops - 1], "v", color="black", markersize=5,
                label=f"overflow: step skipped, scale halved ({len(drops)}x)")
    ax.set_yscale("log", base=2)
    low, high = np.log2(scales[scales > 0].min()), np.log2(scales.max())
    ax.set_ylim(2 ** (np.floor(low) - 2), 2 ** (np.ceil(high) + 2))
    ax.text(0.02, 0.04, f"{r['skipped_steps']} of {len(scales)} steps skipped; final scale "
            f"{r['final_scale']:g}", transform=ax.transAxes, fontsize=8)
    ax.legend(fontsize=8, loc="upper right")


def _plot_naive_scale(ax, r, color, label):
    scales = np.asarray(r["scales"], dtype=float)
    ax.set(title="naive run: Keras's loss scale", xlabel="step", ylabel="loss scale (log)")
    if not len(scales):
        ax.text(0.5, 0.5, "no loss scale (not float16)", ha="center", transform=ax.transAxes)
        return
    steps = np.arange(1, len(scales) + 1)
    ax.plot(steps, np.where(scales > 0, scales, np.nan), color=color, label=label)
    ax.set_yscale("log")
    ax.set_xlim(0, len(scales) + 1)
    note = f"{r['skipped_steps']} of {len(scales)} steps skipped" + (
        ",\nthe scale halved on each" if r["skipped_steps"] == len(scales) else "")
    if (scales <= 0).any():
        zero = int(np.argmax(scales <= 0)) + 1
        ax.axvline(zero, color=color, linestyle=":", label=f"scale 0 (below float32's range) from step {zero}")
    ax.text(0.98, 0.04, note, transform=ax.transAxes, fontsize=8, ha="right")
    ax.legend(fontsize=8, loc="upper right")
