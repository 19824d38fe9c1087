"""`bench gpu`'s report: `report.md`, rewritten after every item and saying what runs, and `gpu.png`."""

import os
import time
from pathlib import Path

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks import memory
from kmix._output import markdown_table
from kmix.benchmarks.common import format_bytes as _bytes, ratio_bars

ROUTE_HEADERS = ["route", "stack", "XLA", "TF32", "ms/step", "spread", "fit overhead", "steps/round", "tokens/s",
                 "TFLOP/s", "peak mem", "speed x f32", "mem x f32", "loss", "skipped", "final scale",
                 "speed x f32 TF32 off"]
SPEED = ROUTE_HEADERS.index("speed x f32")
STACKS = {"keras": "keras", "recommended": "kmix.autocast"}


def _baseline(results, tf32):
    return next((r for r in results if "error" not in r and r["policy"] == "float32" and r["stack"] == "keras"
                 and r["jit_compile"] and r["tf32"] == tf32), None)


def route_rows(results):
    """The routes' table rows: ratios against Keras float32 under XLA with TF32 on, the last with TF32 off."""
    base, no_tf32, rows = _baseline(results, True), _baseline(results, False), []
    for r in results:
        head = [r["label"], STACKS.get(r["stack"], r["stack"]), "yes" if r["jit_compile"] else "no",
                "on" if r["tf32"] else "off"]
        if "error" in r:
            rows.append(head + ["failed"] + ["-"] * (len(ROUTE_HEADERS) - len(head) - 1))
            continue
        step = r["step_seconds"]
        mem = r["peak_bytes"] / base["peak_bytes"] if base and r["peak_bytes"] and base["peak_bytes"] else "n/a"
        rows.append(head + [
            step * 1e3, _percent(r["spread"]), _percent(r["overhead"]), r["steps"], round(r["tokens_per_second"]),
            r["tflops"], _bytes(r["peak_bytes"]), base["step_seconds"] / step if base else "n/a", mem, r["loss"],
            r["skipped"], f"{r['scale']:g}" if r["scale"] is not None else "-",
            no_tf32["step_seconds"] / step if no_tf32 else "n/a"])
    return rows


def route_line(r):
    """One route's figures on one line, printed as soon as it is measured."""
    where = f"{r['label']} ({STACKS.get(r['stack'], r['stack'])}, {'XLA' if r['jit_compile'] else 'no XLA'}, " \
            f"TF32 {'on' if r['tf32'] else 'off'})"
    if "error" in r:
        return f"route {where}: failed: {r['error']}"
    scale = f", final scale {r['scale']:g}" if r["scale"] is not None else ""
    return (f"route {where}: {r['step_seconds'] * 1e3:.4g} ms/step (spread {_percent(r['spread'])}, fit overhead "
            f"{_percent(r['overhead'])}, {r['steps']} steps a round), {r['tflops']:.3g} TFLOP/s, peak "
            f"{_bytes(r['peak_bytes'])}, loss {r['loss_first']:.4g} -> {r['loss']:.4g}, skipped {r['skipped']}{scale}")


def memory_line(r):
    """One memory configuration's figures on one line."""
    if "error" in r:
        return f"memory {r['name']}: failed: {r['error']}"
    return (f"memory {r['name']}: peak {_bytes(r['peak_bytes'])}, state {_bytes(r['state_bytes'])} "
            f"(memory_report: {_bytes(r['report_state_bytes'])}), {r['step_seconds'] * 1e3:.4g} ms/step")


class Report:
    """What `bench gpu` has measured so far, written to `out`/report.md by `save`."""

    def __init__(self, out, header, sizes):
        self.out, self.header, self.sizes, self.path = Path(out), header, sizes, str(Path(out) / "report.md")
        self.routes, self.memory, self.tests, self.demo, self.skipped, self.notes = [], [], None, None, [], []
        self.running, self.seconds, self.start = None, None, time.perf_counter()  # running: now; seconds: once ended

    def at(self, running):
        """Records what runs now (None: nothing) and saves."""
        self.running = running
        self.save()

    def save(self, plot=False):
        """Writes `report.md` (beside, then moved into place) and, with `plot`, `gpu.png`; returns its path or None."""
        self.out.mkdir(parents=True, exist_ok=True)
        partial = self.out / "report.md.partial"
        partial.write_text(self.markdown(), encoding="utf-8")
        os.replace(partial, self.path)
        return draw(self.routes, self.memory, self.out / "gpu.png", self.header) if plot else None

    def markdown(self):
        """The report as markdown."""
        state = (f"{self.seconds:.0f} s in all" if self.seconds is not None else f"**still running** after "
                 f"{time.perf_counter() - self.start:.0f} s, at: {self.running or 'between items'}")
        md = [f"## Measured: {self.header}", "", f"`python -m kmix bench gpu`, {state}. TensorFlow {tf.__version__}, "
              f"Keras {keras.__version__}, kmix {kmix.__version__}.", ""]
        md += self._tests() + self._routes() + self._memory() + self._demo()
        if self.notes:
            md += ["### Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        if self.skipped:
            md += ["### Skipped for the time budget", ""] + [f"- {s}" for s in self.skipped] + [""]
        return "\n".join(md)

    def _tests(self):
        md, t = ["### Tests marked gpu", ""], self.tests
        if t is None:
            return md + ["not run", ""]
        command = " ".join(["pytest", *t["command"][3:]]) if t["command"] else "pytest -m gpu"
        md += [f"`{command}`: {t['summary']}", ""]
        if t["running"]:
            md += [f"Running when the time ran out: `{t['running']}`.", ""]
        if t["outcomes"]:
            rows = [[test, outcome, f"{s:.1f}" if s is not None else "-"] for test, outcome, s in t["outcomes"]]
            md += [markdown_table(["test", "outcome", "seconds"], rows), ""]
        if t["tail"] and t["returncode"] != 0:
            md += [f"The log's last lines (all of it: `{t['log']}`):", "", "```", t["tail"], "```", ""]
        return md

    def _routes(self):
        s = self.sizes["routes"]
        return _section("### Training step, every route", self.routes, "label", (
            f"`bench train`'s GPT: {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, seq "
            f"{s['seq']}, batch {s['batch']}, vocab {s['vocab']}; AdamW; each route alone, the median of "
            f"{s['rounds']} rounds, each of enough steps to last about {s['round_s']:g} s (`steps/round`). Ratios "
            "against Keras float32 under XLA with TF32 on (TensorFlow's default), the last column against it with "
            "TF32 off; kmix.autocast rows: `kmix.autocast(model, policy)` + `kmix.wrap` in "
            "`kmix.policy_scope(policy)`. The columns: docs/benchmarks.md, \"GPU: `python -m kmix bench gpu`\"."),
            markdown_table(ROUTE_HEADERS, route_rows(self.routes)))

    def _memory(self):
        s, done = self.sizes["memory"], [r for r in self.memory if "error" not in r]
        return _section("### Memory: float32, O1 and O2 under XLA", self.memory, "name", (
            f"`bench memory`'s GPT: {s['layers']} blocks, d_model {s['d_model']}, seq {s['seq']}, batch "
            f"{s['batch']}, vocab {s['vocab']}; AdamW; peak over one optimizer step, state between steps."),
            done and markdown_table(memory.HEADERS, memory.format_rows(done)))

    def _demo(self):
        if self.demo is None:
            return []
        from kmix.demo.report import results_table

        table = results_table({k: v for k, v in self.demo.items() if k != "plot"}, "mixed_float16")
        return ["### The float16 NaN demo", "", markdown_table(*table), ""]


def _section(title, rows, key, intro, table):
    """A report section: `intro`, `table` (if any) and each failed row; "not run" without rows."""
    if not rows:
        return [title, "", "not run", ""]
    failed = [f"- {r[key]} failed: `{r['error']}`" for r in rows if "error" in r]
    return [title, "", intro, ""] + ([table, ""] if table else []) + failed + ([""] if failed else [])


def draw(routes, mem, path, title):
    """Saves speed (routes) and peak memory (memory rows) against float32 as a PNG; returns its path."""
    routes, mem = ([r for r in rows if "error" not in r] for rows in (routes, mem))
    return ratio_bars([([r["label"] for r in routes], [row[SPEED] for row in route_rows(routes)],
                        "training step speed / Keras float32 (XLA, TF32 on)"),
                       ([r["name"] for r in mem], [row[5] for row in memory.format_rows(mem)],
                        "peak memory / float32, XLA")], path, title)


def _percent(x):
    return "-" if x is None else f"{x:.1%}"
