"""`python -m kmix bench lora`: a LoRA fine-tune of a keras-hub causal LM, kmix beside Keras's mixed_bfloat16.

`Qwen2CausalLM` with `enable_lora(rank=8)`, built under `mixed_bfloat16` (keras) or in float32 and placed
by `kmix.autocast(lm, "O1-bfloat16")` (kmix). Each measurement runs in a fresh process: the step, both
models interleaved; and each route's whole run, with its peak resident set and what kmix's calls keep.
"""

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time

import keras
import numpy as np

import kmix
from kmix.benchmarks.common import (alternate, format_table, in_fresh_process, kept_by, peak_rss, progress,
                                    reset_peak_rss, rss, settled_rss)

LAYOUTS = {  # Qwen2Backbone arguments
    "tiny": dict(vocabulary_size=512, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
                 intermediate_dim=128, tie_word_embeddings=True),
    "qwen2-45m": dict(vocabulary_size=32000, num_layers=6, num_query_heads=8, num_key_value_heads=2,
                      hidden_dim=512, intermediate_dim=1536, tie_word_embeddings=True),
    "qwen2-0.5b": dict(vocabulary_size=151936, num_layers=24, num_query_heads=14, num_key_value_heads=2,
                       hidden_dim=896, intermediate_dim=4864, tie_word_embeddings=True),
}
RANK = 8


def lora_lm(layout, policy):
    """The LoRA causal LM on `layout`, built under `policy` (the global policy put back after)."""
    import keras_hub

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.Qwen2Backbone(**LAYOUTS[layout])
        backbone.enable_lora(rank=RANK)
        return keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
    finally:
        keras.config.set_dtype_policy(previous)


def build(layout, route):
    """The LoRA causal LM on `layout` for `route` ("keras" or "kmix"), compiled, and `{"autocast_s": ...}`."""
    lm = lora_lm(layout, "mixed_bfloat16" if route == "keras" else "float32")
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
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, LAYOUTS[layout]["vocabulary_size"], size=(batch_size, seq + 1)).astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones((batch_size, seq), "int32")}, ids[:, 1:]


def measure_step(layout, batch_size, seq, rounds, warmup=2):
    """Both routes in this process, `train_on_batch` alternating: `{"times": {route: [s]}, "losses": ...}`."""
    x, y = batch(layout, batch_size, seq)
    losses = {}

    def step(route, model):
        result = model.train_on_batch(x, y)  # keras-hub's CausalLM.compile adds an accuracy metric
        losses[route] = float(result[0] if isinstance(result, (list, tuple)) else result)

    models = {route: build(layout, route)[0] for route in ("keras", "kmix")}
    times = alternate({route: (lambda r=route, m=model: step(r, m)) for route, model in models.items()}, rounds,
                      warmup)
    return {"times": times, "losses": losses}


def measure_run(layout, route, batch_size, seq, steps, with_recommend=False):
    """One route's whole run in this process: peak resident set, and what kmix's calls keep."""
    x, y = batch(layout, batch_size, seq)
    start_rss = rss()
    out = {"route": route}
    if route == "kmix":

        lm = lora_lm(layout, "float32")
        out["weight_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in lm.weights)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if with_recommend:
            out["recommend_kept"] = kept_by(lambda: kmix.recommend(lm, x, y, loss=loss, batch_size=batch_size,
                                                                 budget_s=60, verbose=False))
        out["autocast_kept"] = kept_by(lambda: kmix.autocast(lm, "O1-bfloat16"))
        with kmix.policy_scope("O1-bfloat16"):
            lm.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(1e-4)), loss=loss)
    else:
        lm, _ = build(layout, route)
        out["weight_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in lm.weights)
    start = time.perf_counter()
    history = lm.fit(x, y, batch_size=batch_size, epochs=steps, verbose=0)
    out["fit_s"] = time.perf_counter() - start
    out["loss"] = float(history.history["loss"][-1])
    out["peak_bytes"] = peak_rss() - start_rss
    if route == "kmix":
        with tempfile.TemporaryDirectory() as tmp:
            base = settled_rss()
            reset_peak_rss()
            start = time.perf_counter()
            kmix.export(lm, os.path.join(tmp, "served"), sample=x, verbose=False)
            out["export_s"] = time.perf_counter() - start
            out["export_peak"] = peak_rss() - base
            out["export_kept"] = settled_rss() - base
    return out


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
    rows = [[route, f"{run['peak_bytes'] / gb:.2f}", f"{run['peak_bytes'] / runs['keras']['peak_bytes']:.3f}",
             f"{run['fit_s']:.1f}", f"{run['loss']:.4f}"] for route, run in runs.items()]
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
    """Runs the three measurements, prints the report and writes it to `--out`; returns 0."""
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
    for name in ("batch_size", "seq", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    progress(f"bench lora: the step, interleaved ({args.layout}, {args.rounds} rounds)")
    step = in_fresh_process("kmix.benchmarks.lora", "measure_step", dict(
        layout=args.layout, batch_size=args.batch_size, seq=args.seq, rounds=args.rounds))
    runs = {}
    for route in ("keras", "kmix"):
        progress(f"bench lora: the whole {route} run")
        runs[route] = in_fresh_process("kmix.benchmarks.lora", "measure_run", dict(
            layout=args.layout, route=route, batch_size=args.batch_size, seq=args.seq, steps=args.steps,
            with_recommend=args.recommend and route == "kmix"))
    text = report(step, runs, args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        print(text, file=f)
    print(text)
    return 0
