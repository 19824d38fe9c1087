"""The demo's results as text: the table, the sentences that say what it shows, and the figure's title."""

import math

from kmix._output import format_table


def format_results(results, policy):
    """The results as the demo's table (a string)."""
    return format_table(*results_table(results, policy))


def results_table(results, policy):
    """The demo's table as `(headers, rows)`."""
    names = {"float32": "float32", "naive": f"{policy}, -1e9 mask", "kmix": f"{policy}, kmix"}
    rows = [[names[run], number(r["final_loss"]), f"{r['accuracy']:.3f}",
             r["skipped_steps"] if r["final_scale"] is not None else "-",
             number(r["final_scale"]) if r["final_scale"] is not None else "-", f"{r['seconds']:.1f} s",
             r["first_nan_step"] if r["first_nan_step"] is not None else "none"] for run, r in results.items()]
    return ["run", "final loss", "accuracy", "skipped steps", "final scale", "time", "first NaN step"], rows


def summarize(results, policy):
    """A few sentences saying what the table shows."""
    f32, naive, ours = results["float32"], results["naive"], results["kmix"]
    if naive["first_nan_step"] is not None:
        scale = "" if naive["final_scale"] is None else f"; the loss scale fell to {naive['final_scale']:g}"
        first = (f"{policy} with the hand-written -1e9 mask: the loss is NaN from step {naive['first_nan_step']}, "
                 f"{naive['skipped_steps']} of {len(naive['losses'])} steps skipped{scale}.")
    else:
        first = (f"{policy} with the hand-written -1e9 mask stayed finite: -1e9 fits in "
                 f"{'bfloat16 (float32 range)' if 'bfloat16' in policy else 'this dtype'}.")
    return "\n".join([first, f"{policy} with kmix: final loss {number(ours['final_loss'])}, accuracy "
                            f"{ours['accuracy']:.3f}; float32: {number(f32['final_loss'])}, {f32['accuracy']:.3f}.",
                      "Times are this machine's, for a model too small to show speed; `python -m kmix doctor` "
                      "measures the fastest safe route here and `python -m kmix bench train` compares every route."])


def number(value):
    """A loss or scale as printed: 4 significant digits; None, NaN and inf as they are."""
    return str(value) if value is None or not math.isfinite(value) else f"{value:.4g}"


def headline(results, policy):
    """The figure's title: what the three runs show, in one line."""
    f32, naive, ours = results["float32"], results["naive"], results["kmix"]
    left = f"{policy} with a -1e9 mask: " + (
        f"NaN from step {naive['first_nan_step']}" if naive["first_nan_step"] is not None else "stays finite")
    finite = ours["first_nan_step"] is None and math.isfinite(ours["final_loss"])
    right = (f"trains like float32 (held-out loss {number(ours['final_loss'])} vs {number(f32['final_loss'])})"
             if finite else f"NaN from step {ours['first_nan_step']}")
    return f"{left}; with kmix: {right}"
