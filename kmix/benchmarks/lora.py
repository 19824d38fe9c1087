"""`python -m kmix bench lora`: a LoRA fine-tune of a keras-hub causal LM, kmix beside Keras's mixed_bfloat16.

The job users bring most: a keras-hub causal LM (`Qwen2CausalLM`, the 0.5B
layout by default), `backbone.enable_lora(rank=8)`, AdamW, next-token loss.
Two routes on the same weights:

| route | how                                                                                   |
|-------|---------------------------------------------------------------------------------------|
| keras | built under `keras.config.set_dtype_policy("mixed_bfloat16")`, `compile(AdamW)`       |
| kmix  | built in float32, `kmix.autocast(lm, "O1-bfloat16")`, `compile(kmix.wrap(AdamW))`     |

Three measurements, each in a fresh process:

- **step**: both models in one process, `train_on_batch` interleaved (keras,
  kmix, keras, ...) after a warm-up; the median step of each and their
  ratio (load on the machine slows both alike);
- **run keras / run kmix**: one route's whole run (build, place, compile,
  `--steps` fit steps): the process's peak resident set, and for kmix what
  `autocast` and `export` (and, with `--recommend`, `recommend`) keep once
  they return (resident set after `gc.collect()` and `malloc_trim`), beside
  the float32 weights.
"""

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from kmix._output import format_table, progress

LAYOUTS = {  # Qwen2Backbone arguments
    "tiny": dict(vocabulary_size=512, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
                 intermediate_dim=128, tie_word_embeddings=True),
    "qwen2-45m": dict(vocabulary_size=32000, num_layers=6, num_query_heads=8, num_key_value_heads=2,
                      hidden_dim=512, intermediate_dim=1536, tie_word_embeddings=True),
    "qwen2-0.5b": dict(vocabulary_size=151936, num_layers=24, num_query_heads=14, num_key_value_heads=2,
                       hidden_dim=896, intermediate_dim=4864, tie_word_embeddings=True),
}
RANK = 8


def build(layout, route):
    """The LoRA causal LM on `layout` for `route` ("keras" or "kmix"), compiled; the global policy put back."""
    import keras
    import keras_hub

    import kmix

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16" if route == "keras" else "float32")
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.Qwen2Backbone(**LAYOUTS[layout])
        backbone.enable_lora(rank=RANK)
        lm = keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
    finally:
        keras.config.set_dtype_policy(previous)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if route == "keras":
        lm.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss)
        return lm, {}
    start = time.perf_counter()
    kmix.autocast(lm, "O1-bfloat16")
    placed_s = time.perf_counter() - start
    with kmix.policy_scope("O1-bfloat16"):
        lm.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(1e-4)), loss=loss)
    return lm, {"autocast_s": placed_s}


def batch(layout, batch_size, seq, seed=0):
    """Token ids and padding mask, and the next tokens as labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, LAYOUTS[layout]["vocabulary_size"], size=(batch_size, seq + 1)).astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones((batch_size, seq), "int32")}, ids[:, 1:]


def measure_step(layout, batch_size, seq, rounds, warmup=2):
    """Both routes in this process, `train_on_batch` interleaved: the step times of each (seconds)."""
    x, y = batch(layout, batch_size, seq)
    models = {route: build(layout, route)[0] for route in ("keras", "kmix")}
    for _ in range(warmup):
        for model in models.values():
            model.train_on_batch(x, y)
    times = {route: [] for route in models}
    losses = {}
    for _ in range(rounds):
        for route, model in models.items():
            start = time.perf_counter()
            result = model.train_on_batch(x, y)  # keras-hub's CausalLM.compile adds an accuracy metric
            losses[route] = float(result[0] if isinstance(result, (list, tuple)) else result)
            times[route].append(time.perf_counter() - start)
    return {"times": times, "losses": losses}


def measure_run(layout, route, batch_size, seq, steps, with_recommend=False):
    """One route's whole run in this process: peak resident set, and what kmix's calls keep."""
    import numpy as np

    import kmix

    x, y = batch(layout, batch_size, seq)
    start_rss = _rss()
    out = {"route": route}
    if route == "kmix":
        import keras
        import keras_hub

        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.Qwen2Backbone(**LAYOUTS[layout])
        backbone.enable_lora(rank=RANK)
        lm = keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
        out["weight_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in lm.weights)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if with_recommend:
            out["recommend_kept"] = _kept(lambda: kmix.recommend(lm, x, y, loss=loss, batch_size=batch_size,
                                                                 budget_s=60, verbose=False))
        out["autocast_kept"] = _kept(lambda: kmix.autocast(lm, "O1-bfloat16"))
        with kmix.policy_scope("O1-bfloat16"):
            lm.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(1e-4)), loss=loss)
    else:
        lm, _ = build(layout, route)
        out["weight_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in lm.weights)
    start = time.perf_counter()
    history = lm.fit(x, y, batch_size=batch_size, epochs=steps, verbose=0)
    out["fit_s"] = time.perf_counter() - start
    out["loss"] = float(history.history["loss"][-1])
    out["peak_bytes"] = _peak() - start_rss
    if route == "kmix":
        with tempfile.TemporaryDirectory() as tmp:
            base = _settled_rss()
            _reset_peak()
            start = time.perf_counter()
            kmix.export(lm, os.path.join(tmp, "served"), sample=x, verbose=False)
            out["export_s"] = time.perf_counter() - start
            out["export_peak"] = _peak() - base
            out["export_kept"] = _settled_rss() - base
    return out


def _kept(call):
    base = _settled_rss()
    call()
    return _settled_rss() - base


def _settled_rss():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _rss()


def _rss():
    from kmix.benchmarks.scale import _rss as rss

    return rss()


def _peak():
    from kmix.benchmarks.scale import _peak as peak

    return peak()


def _reset_peak():
    from kmix.benchmarks.scale import _reset_peak as reset

    reset()


def _in_subprocess(kind, args):
    """Runs `measure_<kind>(**args)` in a fresh Python process; its JSON result."""
    code = ("import json, sys; from kmix.benchmarks import lora; "
            f"print('KMIX-RESULT ' + json.dumps(lora.measure_{kind}(**json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("KMIX-RESULT "):
            return json.loads(line[len("KMIX-RESULT "):])
    raise RuntimeError(f"bench lora: the {kind} process failed:\n{done.stderr[-3000:]}")


def report(step, runs, args):
    """The markdown report: the step ratio table and the memory table."""
    gb = 1e9
    keras_step = statistics.median(step["times"]["keras"])
    kmix_step = statistics.median(step["times"]["kmix"])
    lines = [f"# bench lora ({datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores)", "",
             f"Qwen2CausalLM `{args.layout}` with LoRA rank {RANK}, batch {args.batch_size} x {args.seq} tokens.", "",
             format_table(["route", "median step ms", "x keras", "rounds", "last loss"], [
                 ["keras mixed_bfloat16", f"{keras_step * 1e3:.1f}", "1.00", len(step["times"]["keras"]),
                  f"{step['losses']['keras']:.4f}"],
                 ["kmix O1-bfloat16", f"{kmix_step * 1e3:.1f}", f"{kmix_step / keras_step:.3f}",
                  len(step["times"]["kmix"]), f"{step['losses']['kmix']:.4f}"]]), ""]
    weights = runs["keras"]["weight_bytes"]
    rows = []
    for route, run in runs.items():
        rows.append([route, f"{run['peak_bytes'] / gb:.2f}", f"{run['peak_bytes'] / runs['keras']['peak_bytes']:.3f}",
                     f"{run['fit_s']:.1f}", f"{run['loss']:.4f}"])
    lines += [f"Whole run ({args.steps} fit steps), float32 weights {weights / gb:.2f} GB:", "",
              format_table(["route", "peak GB", "x keras", "fit s", "last loss"], rows), ""]
    kmix_run = runs["kmix"]
    kept = [["autocast", kmix_run["autocast_kept"]], ["export", kmix_run["export_kept"]]]
    if "recommend_kept" in kmix_run:
        kept.append(["recommend", kmix_run["recommend_kept"]])
    lines += ["What kmix's calls keep once they return (resident set after gc):", "",
              format_table(["call", "kept GB", "x weights"],
                           [[c, f"{k / gb:+.3f}", f"{k / weights:+.3f}"] for c, k in kept]),
              "", f"export: {kmix_run['export_s']:.1f} s, peak {kmix_run['export_peak'] / gb:.2f} GB "
              f"({kmix_run['export_peak'] / weights:.2f}x the weights)."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kmix bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen2-0.5b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved steps per route for the step ratio")
    parser.add_argument("--steps", type=int, default=4, help="fit steps of each whole run")
    parser.add_argument("--recommend", action="store_true", help="also measure what recommend keeps")
    parser.add_argument("--quick", action="store_true", help="the tiny layout, 3 rounds, 2 steps")
    parser.add_argument("--out", default="kmix-out/bench-lora.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.layout, args.rounds, args.steps = "tiny", 3, 2
    for name, value in (("--batch-size", args.batch_size), ("--seq", args.seq), ("--rounds", args.rounds),
                        ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{name} must be >= 1. Received: {value}")
    progress(f"bench lora: the step, interleaved ({args.layout}, {args.rounds} rounds)")
    step = _in_subprocess("step", dict(layout=args.layout, batch_size=args.batch_size, seq=args.seq,
                                       rounds=args.rounds))
    runs = {}
    for route in ("keras", "kmix"):
        progress(f"bench lora: the whole {route} run")
        runs[route] = _in_subprocess("run", dict(layout=args.layout, route=route, batch_size=args.batch_size,
                                                 seq=args.seq, steps=args.steps,
                                                 with_recommend=args.recommend and route == "kmix"))
    text = report(step, runs, args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
