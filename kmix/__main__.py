"""`python -m kmix demo | bench | doctor | diagnose`: kmix's command line."""

import argparse
import importlib
import os
import sys

BENCHES = {name: f"kmix.benchmarks.{name}" for name in (
    "allreduce", "gpu", "lora", "memory", "overhead", "predict", "profile", "recommend", "scale", "softmax", "train")}


def main(argv=None):
    """Parses `argv` and runs the chosen command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # `main` called from Python; see kmix/_startup.py
    parser = argparse.ArgumentParser(prog="python -m kmix",
                                     description="kmix: safe and fast mixed-precision training for Keras 3.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train the classic float16 NaN failure three ways", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False,  # NAME --help: its own
                           description="`python -m kmix bench NAME --help` describes each benchmark's options.")
    bench.add_argument("name", nargs="?", choices=sorted(BENCHES))
    sub.add_parser("doctor", help="versions, devices and the recommended policy", add_help=False)
    sub.add_parser("diagnose", help="why a float32 model would fail in float16 (--demo: the demo's model)",
                   add_help=False)
    known, rest = parser.parse_known_args(argv)
    if known.command == "bench":
        if known.name is None:
            bench.print_help()
            return 0 if {"-h", "--help"} & set(rest) else 2
        module = BENCHES[known.name]
    else:
        module = {"demo": "kmix.demo", "diagnose": "kmix.diagnose.cli", "doctor": "kmix.route.doctor"}[known.command]
    try:
        entry = importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        parser.error(f"'{' '.join(argv)}' is not available in this version of kmix")
    entry(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
