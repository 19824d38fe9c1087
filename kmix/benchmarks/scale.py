"""`python -m kmix bench scale`: what kmix's own calls cost at the size of the models users bring."""

import datetime
import os
import tempfile
import time

import keras
import numpy as np

import kmix
from kmix.benchmarks.common import (add_options, bench_parser, cost_of, format_table, host, in_fresh_process,
                                    peak_rss, progress, rss, token_batch)
from kmix.benchmarks.lora import LAYOUTS, lora_lm

MODELS = {  # keras-hub backbone class and arguments
    "tiny": ("GPT2Backbone", dict(vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=32,
                                  intermediate_dim=64, max_sequence_length=64)),
    "gpt2-124m": ("GPT2Backbone", dict(vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
                                       intermediate_dim=3072, max_sequence_length=1024)),
    "gpt2-355m": ("GPT2Backbone", dict(vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024,
                                       intermediate_dim=4096, max_sequence_length=1024)),
    "llama-836m": ("LlamaBackbone", dict(vocabulary_size=32000, num_layers=16, num_query_heads=32,
                                         num_key_value_heads=4, hidden_dim=2048, intermediate_dim=5632)),
    # Causal LMs with LoRA (rank 8), `bench lora`'s: on Qwen2's 0.5B layout, the fine-tune users bring most.
    "qwen2-0.5b-lora": ("Qwen2Backbone", LAYOUTS["qwen2-0.5b"]),
    "tiny-lora": ("Qwen2Backbone", LAYOUTS["tiny"]),
}
DEFAULT_MODELS = ("gpt2-124m", "gpt2-355m")
LARGE_MODELS = ("llama-836m",)
CALLS = {"build": "Keras", "mixed build": "Keras", "predict": "Keras", "autocast": "kmix", "model.export": "Keras",
         "export": "kmix", "fit step": "Keras", "recommend": "kmix"}  # who makes each call; the float32 build: baseline
HEADERS = ["model", "call", "by", "seconds", "x build", "extra peak GB", "x weights", "kept GB", "kept x weights"]


def build(name, policy="float32"):
    """The classifier on backbone `name`, built under `policy` (the global policy put back after)."""
    import keras_hub

    if name.endswith("-lora"):
        return lora_lm(name[:-len("-lora")], policy)
    cls, kwargs = MODELS[name]
    with kmix.policy_scope(policy):
        keras.utils.set_random_seed(0)
        backbone = getattr(keras_hub.models, cls)(**kwargs)
        inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
        pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs))
        logits = keras.layers.Dense(4, dtype="float32", name="head")(pooled)
        return keras.Model(inputs, logits, name=f"{name.replace('-', '_')}_classifier")


def measure(call, name, batch_size, seq, budget_s):
    """Builds model `name` in float32, then times `call` and its extra peak memory; returns a dict."""
    rng = np.random.default_rng(0)
    x, y = token_batch(rng, MODELS[name][1]["vocabulary_size"], batch_size, seq, low=1)  # -lora: the next tokens
    y = rng.integers(0, 4, (batch_size,)) if not name.endswith("-lora") else y  # the classifier's 4 classes
    before_build = rss()
    peak_rss(reset=True)
    start = time.perf_counter()
    model = build(name)
    seconds = build_s = time.perf_counter() - start
    extra, kept = max(0, peak_rss() - before_build), None  # max: the kernel folds its RSS counters lazily
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    with tempfile.TemporaryDirectory() as tmp:
        if call in ("fit step", "recommend"):
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        runners = calls_on(model, name, x, y, batch_size, budget_s, tmp)
        if call not in runners:
            raise ValueError(f"`call` must be one of {list(runners)}. Received: call={call!r}")
        if runners[call] is not None:
            seconds, extra, kept = cost_of(runners[call])
    keras.config.set_dtype_policy("float32")
    return {"model": name, "call": call, "seconds": seconds, "build_s": build_s, "extra_bytes": extra,
            "kept_bytes": kept, "weight_bytes": weights, "parameters": model.count_params()}


def calls_on(model, name, x, y, batch_size, budget_s, tmp):
    """Each call of the table on `model` as a function of nothing (None: the build, which `measure` times)."""
    return {"build": None, "mixed build": lambda: build(name, "mixed_bfloat16"),
            "predict": lambda: model.predict(x, verbose=0), "autocast": lambda: kmix.autocast(model, "O1-bfloat16"),
            "model.export": lambda: model.export(os.path.join(tmp, "keras"), format="tf_saved_model", verbose=False),
            "export": lambda: kmix.export(model, os.path.join(tmp, "kmix"), sample=x, verbose=False),
            "fit step": lambda: model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0),
            "recommend": lambda: kmix.recommend(model, x, y, batch_size=batch_size, budget_s=budget_s, verbose=False)}


def run(models, calls=None, batch_size=4, seq=128, budget_s=30.0, fresh=True, verbose=True):
    """Measures every call on every model; returns the result dicts (each from a fresh process with `fresh`)."""
    say = progress if verbose else (lambda message: None)
    results = []
    for name in models:
        for call in calls or CALLS:
            say(f"bench scale: {name}: {call}")
            spec = dict(call=call, name=name, batch_size=batch_size, seq=seq, budget_s=budget_s)
            try:
                results.append(in_fresh_process("kmix.benchmarks.scale", "measure", spec) if fresh else measure(**spec))
            except RuntimeError as error:  # the call's own failure in its process (out of memory, ...): its row says so
                if not fresh:
                    raise
                results.append({"model": name, "call": call, "error": str(error).strip().splitlines()[-1][:200]})
            say("bench scale: " + "  ".join(str(v) for v in rows(results[-1:])[0]))  # each row as it comes
    return results


def rows(results):
    """The table's rows: each call's time and extra peak, and their ratios to the build and the weights."""
    table = []
    for r in results:
        kept, weights, head = r.get("kept_bytes"), max(r.get("weight_bytes", 1), 1), [r["model"], r["call"]]
        table.append(head + [CALLS.get(r["call"], "")] + (["failed", r["error"], "", "", "", ""] if "error" in r else [
            f"{r['seconds']:.1f}", f"{r['seconds'] / max(r['build_s'], 1e-9):.2f}", f"{r['extra_bytes'] / 2**30:.2f}",
            f"{r['extra_bytes'] / weights:.2f}",
            *(["", ""] if kept is None else [f"{kept / 2**30:+.3f}", f"{kept / weights:+.3f}"])]))
    return table


def main(argv=None):
    """Runs the benchmark and prints the table; returns the result dicts."""
    parser = bench_parser("scale", __doc__)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help=f"default: {' '.join(DEFAULT_MODELS)} (with --large: and {' '.join(LARGE_MODELS)})")
    parser.add_argument("--large", action="store_true", help="add the Llama-shaped 836M backbone (~3.3 GB float32)")
    parser.add_argument("--lora", action="store_true", help="add Qwen2's 0.5B layout as a causal LM with LoRA")
    parser.add_argument("--calls", nargs="+", choices=list(CALLS), default=None, help="default: all")
    add_options(parser, batch_size=(4, "rows of the batch"), seq=(128, "tokens per row"),
                budget=(30.0, "recommend's budget_s"), in_process="every call in this process (figures mix)",
                quick="a tiny GPT-2, seq 16, budget 2 s: seconds")
    args = parser.parse_args(argv)
    models = args.models or (list(DEFAULT_MODELS) + (list(LARGE_MODELS) if args.large else [])
                             + (["qwen2-0.5b-lora"] if args.lora else []))
    if args.quick:
        models, args.seq, args.budget = ["tiny"], 16, 2.0
    results = run(models, args.calls, args.batch_size, args.seq, args.budget, fresh=not args.in_process)
    print(f"kmix bench scale, {datetime.date.today().isoformat()}, {host()}; load {os.getloadavg()[0]:.1f}; batch "
          f"{args.batch_size} x {args.seq} tokens, recommend budget_s {args.budget:g}; "
          f"{'one process' if args.in_process else 'a fresh process per call'}")
    print(format_table(HEADERS, rows(results)))
    print("x build: the call's seconds over the float32 build's (in its own process); x weights: its extra peak "
          "resident memory over the model's float32 weights; kept: the resident set after the call returned "
          "(after gc and malloc_trim) over the one before it.")
    return results
