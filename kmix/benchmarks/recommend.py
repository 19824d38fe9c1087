"""`python -m kmix bench recommend`: is `kmix.recommend(model, x, y)` steady on a loaded machine?"""

import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np

import kmix
from kmix.benchmarks.common import (add_options, alternate, bench_parser, format_table, in_fresh_process, median,
                                    progress)
from kmix.benchmarks.gpt import PositionEmbedding
from kmix.route import facts, rule, timing, trials
from kmix.route.recommendation import decide_routes
from kmix.route.trials import label as _label

WITHIN = 1.05  # a pick within 5% of the fastest hand-timed route is a good one
ROUTES = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))  # (dtype, jit_compile)
SCENARIOS = {  # name -> ({route: true ms per step}, the noise: sigma of log(step / true step))
    "issue 35's encoder (bfloat16 2.3x), 34% noise": (dict(zip(ROUTES, (378.0, 420.0, 166.0, 400.0))), 0.34),
    "bfloat16 1.11x, 34% noise": (dict(zip(ROUTES, (100.0, 130.0, 90.0, 140.0))), 0.34),
    "XLA 4% slower, bfloat16 1.06x, 25% noise": (dict(zip(ROUTES, (100.0, 104.0, 94.3, 140.0))), 0.25),
    "bfloat16 level with float32, 34% noise": (dict(zip(ROUTES, (100.0, 130.0, 100.0, 140.0))), 0.34),
}


def build_encoder(blocks=2, d_model=256, heads=4, seq=128, vocab=1000, classes=2):
    """The issue's model: a post-norm transformer encoder classifier in float32, compiled with Adam."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = PositionEmbedding()(keras.layers.Embedding(vocab, d_model)(tokens))
    for _ in range(blocks):
        h = keras.layers.MultiHeadAttention(heads, d_model // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + h)
        h = keras.layers.Dense(4 * d_model, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d_model)(h))
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(classes)(x))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def hand_time(model, x, y, routes, rounds, steps):
    """Seconds per step of each route, `{(policy, jit_compile): [one per round]}`, timed with a plain loop."""
    built = {}
    for policy, jit in routes:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        placed = kmix.autocast(clone, policy)
        with kmix.policy_scope(policy):
            placed.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss=model.loss, jit_compile=jit)
        built[(policy, jit)] = lambda m=placed: [m.train_on_batch(x, y) for _ in range(steps)]
    # Three warm-up steps each at least: the trace (or XLA compile), the optimizer's build, one more.
    times = alternate(built, rounds, warmup=max(1, math.ceil(3 / steps)), rotate=True)
    return {route: [t / steps for t in seconds] for route, seconds in times.items()}


def trial(size, batch_size, budget_s, hand_rounds, hand_steps, probe_shape=None, dtypes=None):
    """One run: recommend (`probe_shape`, `dtypes`: None as a user gets them), the other tie rule, hand timing."""
    model, rng = build_encoder(**size), np.random.default_rng(0)
    x = rng.integers(0, size["vocab"], (4 * batch_size, size["seq"])).astype("int32")
    y = rng.integers(0, size["classes"], 4 * batch_size).astype("int32")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    begin = time.perf_counter()
    kwargs = {} if budget_s is None else {"budget_s": budget_s}  # None: recommend's own
    probe = None if probe_shape is None else kmix.device.probe(tuple(probe_shape), budget=0.02)
    rec = kmix.recommend(model, x, y, batch_size=batch_size, verbose=False, probe=probe,
                         dtypes=None if dtypes is None else tuple(dtypes), **kwargs)
    seconds, table = time.perf_counter() - begin, rec.table
    if table is None:  # the budget could not cover one route: nothing was timed on the model to score
        raise SystemExit(f"bench recommend: {rec.reasons[-1]}")
    strict = decide_routes(table, rec.probe, facts.gpus(), facts.cpu_features(), facts.onednn_enabled(), tie="float32")
    routes = [(r.policy, r.jit_compile) for r in table.routes]
    # A pick the budget left untimed (the probe's route) is hand-timed too, so that it can be scored.
    routes += [pick for pick in {(rec.policy, rec.jit_compile), (strict.policy, strict.jit_compile)}
               if pick not in routes]
    hand = hand_time(model, x[:batch_size], y[:batch_size], routes, hand_rounds, hand_steps)
    timed = list(zip(routes, table.routes))  # the routes recommend timed
    return {"load": load, "pick": [rec.policy, rec.jit_compile], "strict_pick": [strict.policy, strict.jit_compile],
            "tie": any("tie rule" in reason for reason in rec.reasons),
            "rounds": {_label(route): len(r.seconds) for route, r in timed},
            "recommend_ms": {_label(route): median(r.seconds) * 1e3 for route, r in timed},
            "hand_ms": {_label(route): median(v) * 1e3 for route, v in hand.items()}, "seconds": seconds}


def score(run):
    """`{rule: pick's hand-timed step / the fastest's}` for the recommended rule and the other."""
    fastest = min(run["hand_ms"].values())
    return {tie: run["hand_ms"][_label(run[key])] / fastest
            for tie, key in (("median", "pick"), ("float32", "strict_pick"))}


def summarize(runs, budget_s=30.0):
    """The table's rows and the closing lines: how often each tie rule is within 5%, and its cost."""
    rows, lines = [], []
    for i, run in enumerate(runs, 1):
        s, fastest, rounds = score(run), min(run["hand_ms"], key=run["hand_ms"].get), sorted(run["rounds"].values())
        call = f"{run['seconds']:.1f} ({run['seconds'] / budget_s:.2f}x)" if "seconds" in run else "n/a"
        rows.append([i, "n/a" if run["load"] is None else f"{run['load']:.1f}", _label(run["pick"]),
                     f"{rounds[0]}-{rounds[-1]}", "yes" if run["tie"] else "no", fastest, s["median"],
                     "yes" if s["median"] <= WITHIN else "NO", _label(run["strict_pick"]), s["float32"], call])
    for tie in rule.TIES:
        costs = [score(run)[tie] for run in runs]
        slower = [c for c in costs if c > WITHIN]
        worst = f"; slower in {len(slower)}, by {(max(slower) - 1):.0%} at worst" if slower else ""
        lines.append(f"tie={tie!r}{' (recommend default)' if tie == 'median' else ''}: within {WITHIN - 1:.0%} of "
                     f"the fastest hand-timed route in {len(costs) - len(slower)} of {len(runs)} runs{worst}; "
                     f"mean cost {(sum(costs) / len(costs) - 1):+.1%}.")
    return rows, lines


HEADERS = ["run", "load", "recommended", "rounds", "tie", "fastest (hand)", "x fastest", "within 5%",
           "tie='float32' pick", "x fastest", "call s (x budget_s)"]


def main(argv=None):
    """Runs the benchmark; prints the table and the summary; returns `{"runs": [...], "summary": [...]}`."""
    parser = bench_parser("recommend", __doc__)
    add_options(parser, runs=(10, "fresh processes, each one recommend"),
                busy=(2, "processes spinning on the CPU meanwhile"))
    parser.add_argument("--budget", type=float, default=None, help="recommend's budget_s; default its own (30)")
    add_options(parser, blocks=(2, "encoder blocks"), d_model=(256, "model width"), seq=(128, "sequence length"),
                batch_size=(16, "recommend's batch_size"), hand_rounds=(15, "hand-timed interleaved rounds"),
                hand_steps=(3, "steps per hand-timed round"))
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every run's figures here")
    add_options(parser, simulate="no timing: the tie rules on simulated loaded rounds (SCENARIOS), in seconds",
                quick="a smoke test: 1 run, 1 busy process, a 1-block d 16 seq 8 encoder, budget 2 s, a tiny probe")
    args = parser.parse_args(argv)
    if args.simulate:
        return {"simulation": print_simulation()}
    if args.quick:
        args.runs, args.busy, args.blocks, args.d_model, args.seq = 1, 1, 1, 16, 8
        args.budget, args.hand_rounds, args.hand_steps, args.batch_size = 2.0, 3, 1, 4
    size = {"blocks": args.blocks, "d_model": args.d_model, "heads": 4 if args.d_model % 4 == 0 else 1,
            "seq": args.seq, "vocab": 1000, "classes": 2}
    spec = {"size": size, "batch_size": args.batch_size, "budget_s": args.budget, "hand_rounds": args.hand_rounds,
            "hand_steps": args.hand_steps, "probe_shape": (64, 16, 32) if args.quick else None}
    busy = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(args.busy)]
    runs = []
    try:
        for i in range(1, args.runs + 1):
            progress(f"bench recommend: run {i}/{args.runs} in a fresh process, {args.busy} busy beside it")
            runs.append(in_fresh_process("kmix.benchmarks.recommend", "trial", spec))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    cpu = kmix.device.cpu_features()["model"]
    print(f"kmix.recommend(model, x, y, batch_size={args.batch_size}) on a {args.blocks}-block encoder, d_model "
          f"{args.d_model}, seq {args.seq}; {args.runs} fresh runs with {args.busy} busy processes beside them; "
          f"CPU {cpu}, {os.cpu_count()} cores; {datetime.date.today().isoformat()}")
    rows, lines = summarize(runs, 30.0 if args.budget is None else args.budget)
    print(format_table(HEADERS, rows))
    print("load: the 1-minute load average as the run began. x fastest: the pick's hand-timed median step "
          "over the fastest route's. tie: the reasons say the tie rule decided.", *lines, sep="\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "runs": runs}, indent=1))
    return {"runs": runs, "summary": lines}


def simulate(true_ms, sigma, seed, budget_s=8.0):
    """recommend's rounds on a simulated clock, each step `true_ms[route] * exp(normal(0, sigma))`."""
    rng, now = np.random.default_rng(seed), [0.0]

    def step(route):
        now[0] += true_ms[route] * 1e-3 * math.exp(rng.normal(0.0, sigma))

    return timing.run_rounds({route: (lambda r=route: step(r)) for route in true_ms}, dict.fromkeys(true_ms, 1),
                             budget_s, min_rounds=trials.MIN_ROUNDS, max_rounds=trials.MAX_ROUNDS,
                             more=lambda rounds: rule.unsettled(rounds, False), clock=lambda: now[0])


def print_simulation(seeds=40):
    """The `--simulate` table: per scenario and tie rule, how often within 5%, the mean and worst cost."""
    rows = []
    for name, (true_ms, sigma) in SCENARIOS.items():
        runs, fastest = [simulate(true_ms, sigma, seed) for seed in range(seeds)], min(true_ms.values())
        counts = [max(len(v) for v in rounds.values()) for rounds in runs]
        for tie in rule.TIES:  # the pick's true step over the fastest's, one per seed
            c = [true_ms[rule.choose(rounds, False, 1.0, 1.0, tie=tie).route] / fastest for rounds in runs]
            rows.append([name, tie, f"{sum(x <= WITHIN for x in c)}/{len(c)}", f"{sum(c) / len(c) - 1:+.1%}",
                         f"{max(c) - 1:+.0%}", f"{min(counts)}-{max(counts)}"])
    print(f"Simulated load: every step is its true time x exp(normal(0, sigma)); {seeds} seeds per scenario; "
          f"rounds as kmix.recommend runs them (at least {trials.MIN_ROUNDS}, more while unsettled, at most "
          f"{trials.MAX_ROUNDS}, 8 s of rounds).")
    print(format_table(["scenario", "tie rule", "within 5%", "mean cost", "worst", "rounds"], rows))
    return rows
