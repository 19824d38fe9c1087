"""`bench gpu`'s report: the tables as markdown (`report.md`) and speed and memory against float32 (`gpu.png`)."""

from pathlib import Path

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks import memory
from kmix.benchmarks.common import format_table

ROUTE_HEADERS = ["route", "stack", "TF32", "ms/step", "tokens/s", "TFLOP/s", "peak mem", "speed x f32",
                 "mem x f32", "loss", "speed x f32 TF32 off"]


def route_rows(results):
    """The routes' table rows: ratios against float32 with TF32 on, and the speed against float32 with it off."""
    base = next((r for r in results if r["policy"] == "float32" and r["tf32"]), None)
    no_tf32 = next((r for r in results if r["policy"] == "float32" and not r["tf32"]), None)
    rows = []
    for r in results:
        speed = base["step_seconds"] / r["step_seconds"] if base else "n/a"
        mem = r["peak_bytes"] / base["peak_bytes"] if base and r["peak_bytes"] and base["peak_bytes"] else "n/a"
        rows.append([r["label"], r["stack"], "on" if r["tf32"] else "off", r["step_seconds"] * 1e3,
                     round(r["tokens_per_second"]), r["tflops"] if r["tflops"] is not None else "n/a",
                     _bytes(r["peak_bytes"]), speed, mem, r["loss"],
                     no_tf32["step_seconds"] / r["step_seconds"] if no_tf32 else "n/a"])
    return rows


def markdown_table(headers, rows):
    """A GitHub markdown table of `rows`, numbers written as `format_table` writes them."""
    return _markdown(*_split(format_table(headers, rows)))


def _markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def write_report(out, header, routes, route_size, mem, mem_size, demo_results, tests, skipped, seconds):
    """Writes `report.md` and `gpu.png` into `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"## Measured: {header}", "",
          f"`python -m kmix bench gpu`, {seconds:.0f} s in all. TensorFlow {tf.__version__}, Keras "
          f"{keras.__version__}, kmix {kmix.__version__}.", ""]
    md += ["### Training step, every route under XLA", ""]
    if routes:
        s = route_size
        md += [f"`bench train`'s GPT: {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, seq "
               f"{s['seq']}, batch {s['batch']}, vocab {s['vocab']}; AdamW; each route alone, the median of "
               f"{s['rounds']} rounds of {s['steps']} steps. Ratios against float32 with TF32 on (TensorFlow's "
               "default), and in the last column against float32 with TF32 off; kmix.autocast rows: `kmix.autocast(model, policy)` + `kmix.wrap` in "
               "`kmix.policy_scope(policy)`.", "", markdown_table(ROUTE_HEADERS, route_rows(routes)), ""]
    else:
        md += ["not run", ""]
    md += ["### Memory: float32, O1 and O2 under XLA", ""]
    if mem:
        s = mem_size
        md += [f"`bench memory`'s GPT: {s['layers']} blocks, d_model {s['d_model']}, seq {s['seq']}, batch "
               f"{s['batch']}, vocab {s['vocab']}; AdamW; peak over one optimizer step, state between steps.",
               "", markdown_table(memory.HEADERS, memory.format_rows(mem)), ""]
    else:
        md += ["not run", ""]
    md += ["### The float16 NaN demo", ""]
    if demo_results:
        from kmix.demo import format_results

        runs = {k: v for k, v in demo_results.items() if k != "plot"}
        md += [_markdown(*_split(format_results(runs, "mixed_float16"))), ""]
    else:
        md += ["not run", ""]
    md += ["### Tests marked gpu", "", f"`{' '.join(['pytest', *tests['command'][3:]]) if tests['command'] else 'pytest -m gpu'}`:"
           f" {tests['summary'] or 'no summary line'}", ""]
    if skipped:
        md += ["### Skipped for the time budget", ""] + [f"- {s}" for s in skipped] + [""]
    report = out / "report.md"
    report.write_text("\n".join(md))
    png = plot(routes, mem, out / "gpu.png", header)
    return str(report), png


def _split(table):
    """A `format_table` string back into `(headers, rows)` (the demo's table)."""
    lines = table.splitlines()
    widths = [len(c) for c in lines[1].split("  ")]

    def cells(line):
        row, pos = [], 0
        for w in widths:
            row.append(line[pos:pos + w].strip())
            pos += w + 2
        return row

    return cells(lines[0]), [cells(line) for line in lines[2:]]


def plot(routes, mem, path, title):
    """Saves speed (routes) and peak memory (memory configurations) against float32 as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = [
        (axes[0], [r["label"] for r in routes], [row[7] for row in route_rows(routes)],
         "training step speed / float32 (TF32 on), XLA"),
        (axes[1], [r["name"] for r in mem], [row[5] for row in memory.format_rows(mem)] if mem else [],
         "peak memory / float32, XLA"),
    ]
    for ax, names, values, label in panels:
        values = [v if isinstance(v, float) else 0.0 for v in values]
        if not values:
            ax.text(0.5, 0.5, "not run", ha="center", va="center")
            ax.set_title(label, fontsize=9)
            continue
        bars = ax.barh(range(len(names)), values, color="tab:blue")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set(xlim=(0, max(values) * 1.2 or 1.0))
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _bytes(n):
    if not n:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
