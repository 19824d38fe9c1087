"""Runs `tests.hub_coverage.check` on every keras-hub backbone of the zoo and writes a markdown table.

    python tools/hub_matrix.py [--only NAME ...] [--dtype bfloat16|float16] [--out docs/coverage.md] [--no-fit]

One progress line per (architecture, dtype) as it goes; each row runs in a
fresh `keras.backend.clear_session()`, and a crash of one row is recorded in
its row, never stopping the run. The page holds the date, the CPU (and
whether it has AVX512_BF16 / AMX-BF16), the TensorFlow / Keras / keras-hub
versions, the command, a table per dtype and a summary count.

Importable: `rows = run(["GemmaBackbone"], ["bfloat16"])`, `render(rows, command)`.
"""

import argparse
import datetime
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as tests/conftest.py: the same kernels on every CPU

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `tests` is a package of the repository, not installed

import keras  # noqa: E402
import keras_hub  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.hub_coverage import Row, check, first_line  # noqa: E402
from tests.hub_zoo import ZOO  # noqa: E402

DTYPES = ("bfloat16", "float16")


def cpu_facts():
    """`(model name, has avx512_bf16, has amx_bf16)` from /proc/cpuinfo (`("unknown", False, False)` elsewhere)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", False, False
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, "avx512_bf16" in flags, "amx_bf16" in flags


def run_one(name, half, fit=True):
    """`check(name, half, fit)` in a fresh session; a crash of the harness itself becomes the row's."""
    keras.backend.clear_session()
    try:
        return check(name, half, fit=fit)
    except Exception as error:  # noqa: BLE001  (one crash never stops the run)
        return Row(name, half, reference_crash=f"the check itself crashed: {first_line(error)}")


def run(names, dtypes=DTYPES, fit=True, progress=print):
    """Checks every name under every dtype, printing one line per row; the rows.

    Args:
        names: keys of `tests.hub_zoo.ZOO`.
        dtypes: half dtypes among `"bfloat16"`, `"float16"`.
        fit: also compare two epochs of `fit`.
        progress: called with each progress line (`None`: silent).

    Returns:
        A list of `tests.hub_coverage.Row`, dtype by dtype.
    """
    rows = []
    for half in dtypes:
        for name in names:
            started = time.perf_counter()
            row = run_one(name, half, fit)
            rows.append(row)
            if progress:
                progress(f"{name:24s} {half:9s} {time.perf_counter() - started:6.1f}s  {row.verdict()}")
                for failure in row.failures():
                    progress(f"    {failure}")
    return rows


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _error(value, crash):
    if crash:
        return "crash"
    return "-" if value is None else f"{value:.1e}"


def _fit(row):
    if row.reference_crash or row.kmix_crash:
        return "-"
    if row.fit_reference:
        return "no reference"
    if row.fit_crash:
        return "crash"
    if row.fit_losses is None:
        return "not run"
    verdict = "close" if all(map(_finite, row.fit_losses)) and row.fit_close() else "not close"
    kmix_losses = " → ".join(f"{loss:.3g}" for loss in row.fit_losses)
    f32_losses = " → ".join(f"{loss:.3g}" for loss in row.fit_losses32)
    return f"{verdict}: {kmix_losses} (f32 {f32_losses})"


def _finite(value):
    return value == value and abs(value) != float("inf")


def table(rows):
    """The markdown table of `rows` (one dtype), with notes giving each error's first line."""
    lines = [
        "| architecture | Keras: error | Keras: reload | kmix: half layers | kmix: error | kmix: reload | kmix: fit "
        "| kmix's verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for row in rows:
        keras_reload = "-" if row.keras_reload is None else ("crash" if row.keras_reload.status == "crash"
                                                             else str(row.keras_reload))
        kmix_reload = "-" if row.kmix_reload is None else ("crash" if row.kmix_reload.status == "crash"
                                                           else str(row.kmix_reload))
        cells = [
            row.name, _error(row.keras_error, row.keras_crash), keras_reload,
            "-" if row.kmix_layers is None else "{} of {}".format(*row.kmix_layers),
            _error(row.kmix_error, row.kmix_crash or row.reference_crash), kmix_reload, _fit(row), row.verdict(),
        ]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        notes.extend(f"- {row.name}: {message}" for message in _messages(row))
    if notes:
        lines += ["", "Notes (first lines of errors, kmix's warnings, failing criteria):", ""]
        lines += [_cell(note) for note in notes]
    return "\n".join(lines)


def _messages(row):
    messages = []
    if row.keras_crash:
        messages.append(f"plain Keras crashes: {row.keras_crash}")
    if row.keras_reload is not None and row.keras_reload.status == "crash":
        messages.append(f"plain Keras's reload crashes: {row.keras_reload.message}")
    if row.keras_fit_crash:
        messages.append(f"plain Keras's fit crashes: {row.keras_fit_crash}")
    if row.kmix_layers is not None and row.kmix_layers[0] == 0:
        messages.append("kmix places no layer in half: the model runs in float32")
    messages.extend(f"kmix warns: {warning.splitlines()[0][:300]}" for warning in row.kmix_warnings)
    if row.kmix_reload is not None and row.kmix_reload.status == "crash":
        messages.append(f"kmix's reload crashes: {row.kmix_reload.message}")
    messages.extend(f"fails: {failure}" for failure in row.failures())
    return messages


def summary(rows):
    """`"N of M pass; kmix worse than plain Keras on K (names)."`"""
    passed = sum(not row.failures() for row in rows)
    worse = [row.name for row in rows if row.worse_than_keras()]
    text = f"{passed} of {len(rows)} pass; kmix worse than plain Keras on {len(worse)}"
    text += f" ({', '.join(worse)})." if worse else "."
    timed = sorted((row.seconds["autocast"], row.name) for row in rows if "autocast" in row.seconds)
    if timed:
        median = timed[len(timed) // 2][0]
        text += f" kmix.autocast's own time: median {median:.2f} s, longest {timed[-1][0]:.2f} s ({timed[-1][1]})."
    return text


def render(rows, command):
    """The whole markdown page: the machine, the versions, the command, a table and a summary per dtype."""
    model, avx512_bf16, amx_bf16 = cpu_facts()
    lines = [
        "# keras-hub backbones under plain Keras mixed precision and kmix.autocast",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- CPU: {model} (avx512_bf16: {'yes' if avx512_bf16 else 'no'}, amx_bf16: {'yes' if amx_bf16 else 'no'}); "
        f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')}",
        f"- TensorFlow {tf.__version__}, Keras {keras.__version__}, keras-hub {keras_hub.__version__}",
        f"- command: `{command}`",
        "",
        "Each architecture is built tiny (`tests/hub_zoo`) and compared from the same float32 weights "
        "(`tests/hub_coverage.py`): error = max |y - y32| / max |y32| over float outputs; reload = a `.keras` "
        "save and `load_model` predicting bitwise what the model predicted; fit = two applied steps on one batch "
        "(kmix's losses against float32's); half layers = the layers kmix.autocast's table places in half "
        "(for the record). kmix passes with an error <= 5e-2 (bfloat16) / 1e-2 (float16) "
        "or <= 1.5x plain Keras's; an exact reload (where plain Keras's own reload is not exact, the reload "
        "kmix's warning advises must be); and a fit close to float32's (the loss scale's skipped steps "
        "left out).",
    ]
    for half in DTYPES:
        chosen = [row for row in rows if row.half == half]
        if chosen:
            lines += ["", f"## {half}", "", table(chosen), "", summary(chosen)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    """The command line; returns the exit status (0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="architectures (keys of tests.hub_zoo.ZOO)")
    parser.add_argument("--dtype", choices=DTYPES, help="one half dtype (both by default)")
    parser.add_argument("--out", default="docs/coverage.md", help="the markdown page to write")
    parser.add_argument("--no-fit", action="store_true", help="skip the two epochs of fit")
    args = parser.parse_args(argv)
    names = args.only or sorted(ZOO)
    unknown = [name for name in names if name not in ZOO]
    if unknown:
        parser.error(f"--only names no architecture of the zoo: {', '.join(unknown)}. Known: {', '.join(sorted(ZOO))}.")
    rows = run(names, (args.dtype,) if args.dtype else DTYPES, fit=not args.no_fit, progress=print)
    command = "python tools/hub_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    page = render(rows, command.strip())
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    for half in DTYPES:
        chosen = [row for row in rows if row.half == half]
        if chosen:
            print(f"{half}: {summary(chosen)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
