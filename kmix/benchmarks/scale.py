"""`python -m kmix bench scale`: what kmix's own calls cost at the size of the models users bring.

For each model (keras-hub GPT-2 124M, a GPT-2-medium-sized 355M backbone
and, with `--large`, a Llama-shaped 836M one; `--quick`: a tiny GPT-2), a
classifier on the backbone (its sequence output averaged, a `Dense` head);
with `--lora`, also a Qwen2 causal LM on the 0.5B layout with LoRA (rank 8)
on next-token labels; each call beside Keras's own equivalent:

| kmix                                  | Keras                                       |
|---------------------------------------|---------------------------------------------|
| `kmix.autocast(model, "O1-bfloat16")` | the model built under `mixed_bfloat16`      |
| `kmix.export(model, dir, sample=x)`   | `model.export(dir)`                         |
| `kmix.recommend(model, x, y)`         | one float32 `fit` step (compile, one batch) |

Each call runs in a fresh Python process (`--in-process`: all in this one,
the numbers then mix), which builds the model in float32 first. Its time is
the call's wall clock; its extra peak memory is the process's peak resident
set (`VmHWM`, reset through `/proc/self/clear_refs` just before the call)
over the resident set just before it; what it keeps is the resident set
once it returned over the one before it (both after `gc.collect()` and
`malloc_trim`). Both are shown as ratios: time to the
float32 build of the same model, memory to its float32 weights. The data
is one batch of `--batch-size` rows of `--seq` token ids.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from kmix._output import format_table, progress

MODELS = {  # keras-hub backbone class and arguments
    "tiny": ("GPT2Backbone", dict(vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=32,
                                  intermediate_dim=64, max_sequence_length=64)),
    "gpt2-124m": ("GPT2Backbone", dict(vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
                                       intermediate_dim=3072, max_sequence_length=1024)),
    "gpt2-355m": ("GPT2Backbone", dict(vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024,
                                       intermediate_dim=4096, max_sequence_length=1024)),
    "llama-836m": ("LlamaBackbone", dict(vocabulary_size=32000, num_layers=16, num_query_heads=32,
                                         num_key_value_heads=4, hidden_dim=2048, intermediate_dim=5632)),
    # A causal LM with LoRA (rank 8) on Qwen2's 0.5B layout: the fine-tune users bring most.
    "qwen2-0.5b-lora": ("Qwen2Backbone", dict(vocabulary_size=151936, num_layers=24, num_query_heads=14,
                                              num_key_value_heads=2, hidden_dim=896, intermediate_dim=4864,
                                              tie_word_embeddings=True)),
    "tiny-lora": ("Qwen2Backbone", dict(vocabulary_size=512, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                                        hidden_dim=64, intermediate_dim=128, tie_word_embeddings=True)),
}
DEFAULT_MODELS = ("gpt2-124m", "gpt2-355m")
LARGE_MODELS = ("llama-836m",)
CALLS = (  # (name, who, what it is beside)
    ("build", "Keras", "float32 build: the baseline"),
    ("mixed build", "Keras", "build under mixed_bfloat16"),
    ("autocast", "kmix", "kmix.autocast(model, 'O1-bfloat16')"),
    ("model.export", "Keras", "model.export(dir)"),
    ("export", "kmix", "kmix.export(model, dir, sample=x)"),
    ("fit step", "Keras", "one float32 fit step (compile + 1 batch)"),
    ("recommend", "kmix", "kmix.recommend(model, x, y)"),
)
HEADERS = ["model", "call", "by", "seconds", "x build", "extra peak GB", "x weights", "kept GB", "kept x weights"]


def build(name, policy="float32"):
    """The classifier on backbone `name`, built under `policy` (the global policy put back after)."""
    import keras
    import keras_hub

    cls, kwargs = MODELS[name]
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        backbone = getattr(keras_hub.models, cls)(**kwargs)
        if name.endswith("-lora"):
            backbone.enable_lora(rank=8)
            return keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
        inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
        pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs))
        logits = keras.layers.Dense(4, dtype="float32", name="head")(pooled)
        return keras.Model(inputs, logits, name=f"{name.replace('-', '_')}_classifier")
    finally:
        keras.config.set_dtype_policy(previous)


def batch(name, batch_size, seq):
    """One batch `(x, y)`: token ids below the vocabulary, a full padding mask, 4 classes."""
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = MODELS[name][1]["vocabulary_size"]
    ids = rng.integers(1, vocab, (batch_size, seq + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((batch_size, seq), "int32")}
    if name.endswith("-lora"):
        return x, ids[:, 1:]  # a causal LM: the next tokens
    return x, rng.integers(0, 4, (batch_size,))


def measure(call, name, batch_size, seq, budget_s):
    """Builds model `name` in float32, then times `call` and its extra peak memory; returns a dict."""
    import keras

    x, y = batch(name, batch_size, seq)
    before_build = _rss()
    _reset_peak()
    start = time.perf_counter()
    model = build(name)
    build_s = time.perf_counter() - start
    build_peak = _peak() - before_build
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    with tempfile.TemporaryDirectory() as tmp:
        run = _runner(call, model, name, x, y, batch_size, budget_s, tmp)
        if run is None:  # the build itself
            seconds, extra, kept = build_s, build_peak, None
        else:
            base = _settled_rss()
            _reset_peak()
            start = time.perf_counter()
            run()
            seconds, extra = time.perf_counter() - start, _peak() - base
            kept = _settled_rss() - base
    keras.config.set_dtype_policy("float32")
    return {"model": name, "call": call, "seconds": seconds, "build_s": build_s, "extra_bytes": extra,
            "kept_bytes": kept, "weight_bytes": weights, "parameters": model.count_params()}


def _settled_rss():
    """The resident set once Python's garbage and malloc's free pages are returned."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss()


def _runner(call, model, name, x, y, batch_size, budget_s, tmp):
    """The call to measure, as a function of nothing (None: the build, measured as it happens)."""
    import keras

    import kmix

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if call == "build":
        return None
    if call == "mixed build":
        return lambda: build(name, "mixed_bfloat16")
    if call == "autocast":
        return lambda: kmix.autocast(model, "O1-bfloat16")
    if call == "model.export":
        return lambda: model.export(os.path.join(tmp, "keras"), format="tf_saved_model", verbose=False)
    if call == "export":
        return lambda: kmix.export(model, os.path.join(tmp, "kmix"), sample=x, verbose=False)
    model.compile(optimizer="adam", loss=loss)
    if call == "fit step":
        return lambda: model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    if call == "recommend":
        return lambda: kmix.recommend(model, x, y, batch_size=batch_size, budget_s=budget_s, verbose=False)
    raise ValueError(f"`call` must be one of {[c for c, _, _ in CALLS]}. Received: call={call!r}")


def _rss():
    return _status("VmRSS")


def _peak():
    return _status("VmHWM")


def _status(field):
    """A field of `/proc/self/status` in bytes (0 where there is none: not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak():
    """Resets the process's peak resident set to the current one (Linux: `clear_refs` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run(models, calls=None, batch_size=4, seq=128, budget_s=30.0, fresh=True, verbose=True):
    """Measures every call on every model; returns the result dicts (each from a fresh process unless `fresh=False`)."""
    say = progress if verbose else (lambda message: None)
    results = []
    for name in models:
        for call in calls or [c for c, _, _ in CALLS]:
            say(f"bench scale: {name}: {call}")
            spec = dict(call=call, name=name, batch_size=batch_size, seq=seq, budget_s=budget_s)
            results.append(_in_subprocess(spec) if fresh else measure(**spec))
            say("bench scale: " + "  ".join(str(v) for v in rows(results[-1:])[0]))  # each row as it comes
    return results


def _in_subprocess(spec):
    code = ("import json\nfrom kmix.benchmarks.scale import measure\n"
            f"print('RESULT ' + json.dumps(measure(**json.loads({json.dumps(spec)!r}))), flush=True)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"model": spec["name"], "call": spec["call"], "error": tail[:200]}


def rows(results):
    """The table's rows: each call's time and extra peak, and their ratios to the build and the weights."""
    who = {c: by for c, by, _ in CALLS}
    table = []
    for r in results:
        if "error" in r:
            table.append([r["model"], r["call"], who.get(r["call"], ""), "failed", r["error"], "", "", "", ""])
            continue
        kept = r.get("kept_bytes")
        table.append([r["model"], r["call"], who[r["call"]], f"{r['seconds']:.1f}",
                      f"{r['seconds'] / max(r['build_s'], 1e-9):.2f}", f"{r['extra_bytes'] / 2**30:.2f}",
                      f"{r['extra_bytes'] / max(r['weight_bytes'], 1):.2f}",
                      "" if kept is None else f"{kept / 2**30:+.3f}",
                      "" if kept is None else f"{kept / max(r['weight_bytes'], 1):+.3f}"])
    return table


def main(argv=None):
    """Runs the benchmark and prints the table; returns the result dicts."""
    parser = argparse.ArgumentParser(prog="python -m kmix bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                        help=f"default: {' '.join(DEFAULT_MODELS)} (with --large: and {' '.join(LARGE_MODELS)})")
    parser.add_argument("--large", action="store_true", help="add the Llama-shaped 836M backbone (~3.3 GB float32)")
    parser.add_argument("--lora", action="store_true", help="add Qwen2's 0.5B layout as a causal LM with LoRA")
    parser.add_argument("--calls", nargs="+", choices=[c for c, _, _ in CALLS], default=None, help="default: all")
    parser.add_argument("--batch-size", type=int, default=4, help="rows of the batch; default 4")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row; default 128")
    parser.add_argument("--budget", type=float, default=30.0, help="recommend's budget_s; default 30")
    parser.add_argument("--in-process", action="store_true", help="every call in this process (figures mix)")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, seq 16, budget 2 s: seconds")
    args = parser.parse_args(argv)
    models = args.models or (list(DEFAULT_MODELS) + (list(LARGE_MODELS) if args.large else [])
                             + (["qwen2-0.5b-lora"] if args.lora else []))
    if args.quick:
        models, args.seq, args.budget = ["tiny"], 16, 2.0
    results = run(models, args.calls, args.batch_size, args.seq, args.budget, fresh=not args.in_process)
    day = datetime.date.today().isoformat()
    print(f"kmix bench scale, {day}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.1f}; batch {args.batch_size} x {args.seq} tokens, recommend budget_s "
          f"{args.budget:g}; {'one process' if args.in_process else 'a fresh process per call'}")
    print(format_table(HEADERS, rows(results)))
    print("x build: the call's seconds over the float32 build's (in its own process); x weights: its extra peak "
          "resident memory over the model's float32 weights; kept: the resident set after the call returned "
          "(after gc and malloc_trim) over the one before it.")
    return results


if __name__ == "__main__":
    main()
