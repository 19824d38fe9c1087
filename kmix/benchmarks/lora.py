"""`python -m kmix bench lora`: a LoRA fine-tune of a keras-hub causal LM, kmix beside Keras's mixed_bfloat16."""

import datetime
import os
import tempfile
import time
from pathlib import Path

import keras
import numpy as np

import kmix
from kmix.benchmarks.common import (add_options, alternate, bench_parser, check_sizes, cost_of, format_table, host,
                                    in_fresh_process, kept_by, median, peak_rss, progress, rss, token_batch)

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

    with kmix.policy_scope(policy):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.Qwen2Backbone(**LAYOUTS[layout])
        backbone.enable_lora(rank=RANK)
        return keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)


def build(layout, route, kept=None, recommend_on=None):
    """The LoRA causal LM on `layout` for `route`, compiled; `kept` gets what kmix's calls keep."""
    lm = lora_lm(layout, "mixed_bfloat16" if route == "keras" else "float32")
    loss, kept = keras.losses.SparseCategoricalCrossentropy(from_logits=True), {} if kept is None else kept
    if route == "keras":
        lm.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss)
        return lm
    if recommend_on:
        x, y, batch_size = recommend_on
        kept["recommend"] = kept_by(lambda: kmix.recommend(lm, x, y, loss=loss, batch_size=batch_size, budget_s=60,
                                                           verbose=False))
    kept["autocast"] = kept_by(lambda: kmix.autocast(lm, "O1-bfloat16"))
    with kmix.policy_scope("O1-bfloat16"):
        lm.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(1e-4)), loss=loss)
    return lm


def measure_step(layout, batch_size, seq, rounds, warmup=2):
    """Both routes in this process, `train_on_batch` alternating: `{"times": {route: [s]}, "losses": ...}`."""
    x, y = token_batch(np.random.default_rng(0), LAYOUTS[layout]["vocabulary_size"], batch_size, seq, low=1)
    losses = {}

    def step(route, model):
        result = model.train_on_batch(x, y)  # keras-hub's CausalLM.compile adds an accuracy metric
        losses[route] = float(result[0] if isinstance(result, (list, tuple)) else result)

    models = {route: build(layout, route) for route in ("keras", "kmix")}
    times = alternate({route: (lambda r=route, m=model: step(r, m)) for route, model in models.items()}, rounds, warmup)
    return {"times": times, "losses": losses}


def measure_run(layout, route, batch_size, seq, steps, with_recommend=False):
    """One route's whole run in this process: peak resident set, and what kmix's calls keep."""
    x, y = token_batch(np.random.default_rng(0), LAYOUTS[layout]["vocabulary_size"], batch_size, seq, low=1)
    start_rss, kept = rss(), {}
    lm = build(layout, route, kept, (x, y, batch_size) if with_recommend else None)
    out = {"route": route, "weight_bytes": sum(int(np.prod(v.shape)) * 4 for v in lm.weights),
           **{f"{call}_kept": k for call, k in kept.items()}}
    start = time.perf_counter()
    history = lm.fit(x, y, batch_size=batch_size, epochs=steps, verbose=0)
    out.update(fit_s=time.perf_counter() - start, loss=float(history.history["loss"][-1]),
               peak_bytes=peak_rss() - start_rss)
    if route == "kmix":
        with tempfile.TemporaryDirectory() as tmp:
            out["export_s"], out["export_peak"], out["export_kept"] = cost_of(
                lambda: kmix.export(lm, os.path.join(tmp, "served"), sample=x, verbose=False))
    return out


def report(step, runs, args):
    """The markdown report: the step ratio table and the memory table."""
    gb, times, keras_step = 1e9, step["times"], median(step["times"]["keras"])
    lines = [f"# bench lora ({datetime.date.today()}, {host()})", "",
             f"Qwen2CausalLM `{args.layout}` with LoRA rank {RANK}, batch {args.batch_size} x {args.seq} tokens.", "",
             format_table(["route", "median step ms", "x keras", "rounds", "last loss"], [
                 [label, f"{median(times[r]) * 1e3:.1f}", "1.00" if r == "keras" else
                  f"{median(times[r]) / keras_step:.3f}", len(times[r]), f"{step['losses'][r]:.4f}"]
                 for r, label in (("keras", "keras mixed_bfloat16"), ("kmix", "kmix O1-bfloat16"))]), ""]
    weights, kmix_run = runs["keras"]["weight_bytes"], runs["kmix"]
    rows = [[route, f"{run['peak_bytes'] / gb:.2f}", f"{run['peak_bytes'] / runs['keras']['peak_bytes']:.3f}",
             f"{run['fit_s']:.1f}", f"{run['loss']:.4f}"] for route, run in runs.items()]
    kept = [[c, kmix_run[f"{c}_kept"]] for c in ("autocast", "export", "recommend") if f"{c}_kept" in kmix_run]
    lines += [f"Whole run ({args.steps} fit steps), float32 weights {weights / gb:.2f} GB:", "",
              format_table(["route", "peak GB", "x keras", "fit s", "last loss"], rows), "",
              "What kmix's calls keep once they return (resident set after gc):", "",
              format_table(["call", "kept GB", "x weights"],
                           [[c, f"{k / gb:+.3f}", f"{k / weights:+.3f}"] for c, k in kept]),
              "", f"export: {kmix_run['export_s']:.1f} s, peak {kmix_run['export_peak'] / gb:.2f} GB "
              f"({kmix_run['export_peak'] / weights:.2f}x the weights)."]
    return "\n".join(lines)


def main(argv=None):
    """Runs the three measurements, prints the report and writes it to `--out`; returns 0."""
    parser = bench_parser("lora", __doc__)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen2-0.5b")
    add_options(parser, batch_size=(1, "rows of the batch"), seq=(64, "tokens per row"),
                rounds=(8, "interleaved steps per route for the step ratio"), steps=(4, "fit steps of each whole run"),
                recommend="also measure what recommend keeps", quick="the tiny layout, 3 rounds, 2 steps",
                out=("kmix-out/bench-lora.md", "where the report is written"))
    args = parser.parse_args(argv)
    if args.quick:
        args.layout, args.rounds, args.steps = "tiny", 3, 2
    check_sizes(parser, args, quick={})  # the sizes must be >= 1
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
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0
