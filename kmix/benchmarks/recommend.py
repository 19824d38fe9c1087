"""`python -m kmix bench recommend`: is `kmix.recommend(model, x, y)` steady on a loaded machine?

The case of issue 35: a 2-block transformer encoder (d_model 256, seq 128,
`batch_size=16`) on a 2-core CPU with other work beside it. The benchmark
starts `--busy` processes that spin on the CPU, then `--runs` times starts a
fresh Python process that

1. calls `kmix.recommend(model, x, y, batch_size=16)` as a new user would
   (the probe picks the half dtypes, `budget_s` its default), and decides
   the same table again with the other tie rule (`tie="float32"`, which
   keeps float32 where the rounds cannot separate a half route from it);
2. hand-times every route recommend timed, in the same load: each built as
   the README builds it (`kmix.autocast` of a clone, compiled in
   `kmix.policy_scope` with `kmix.wrap` and the route's `jit_compile`),
   then `--hand-rounds` interleaved rounds of `--hand-steps`
   `train_on_batch` steps each, timed with a plain loop; the figure is the
   median round.

A pick counts as good when its hand-timed median is within 5% of the
fastest route's. The table shows each run's load average, the pick and its
rounds, whether the tie rule decided it, and both rules' picks against the
hand-timed fastest: how often each picks a slower route, and by how much.

`--simulate` measures the same on a model of the load instead, in a second:
`SCENARIOS` give each route a true step time, every step is that time
times log-normal noise, and recommend's rounds (`kmix.route.timing`, with
`kmix.route.rule.unsettled` asking for more) run on a simulated clock, 40
seeds each; both tie rules decide every seed's rounds.
"""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

from kmix._output import format_table, progress
from kmix.route import rule, timing, trials

WITHIN = 1.05  # a pick within 5% of the fastest hand-timed route is a good one
SPIN = "while True:\n    pass\n"
# name -> (true ms per step of each route (dtype, jit_compile), the noise: sigma of log(step / true step))
SCENARIOS = {
    "issue 35's encoder (bfloat16 2.3x), 34% noise": (
        {("float32", False): 378.0, ("float32", True): 420.0, ("bfloat16", False): 166.0, ("bfloat16", True): 400.0},
        0.34),
    "bfloat16 1.11x, 34% noise": (
        {("float32", False): 100.0, ("float32", True): 130.0, ("bfloat16", False): 90.0, ("bfloat16", True): 140.0},
        0.34),
    "XLA 4% slower, bfloat16 1.06x, 25% noise": (
        {("float32", False): 100.0, ("float32", True): 104.0, ("bfloat16", False): 94.3, ("bfloat16", True): 140.0},
        0.25),
    "bfloat16 level with float32, 34% noise": (
        {("float32", False): 100.0, ("float32", True): 130.0, ("bfloat16", False): 100.0, ("bfloat16", True): 140.0},
        0.34),
}


def build_encoder(blocks=2, d_model=256, heads=4, seq=128, vocab=1000, classes=2):
    """The issue's model: a transformer encoder classifier in float32, compiled as a user would (Adam).

    Token and (trained) position embeddings, `blocks` post-norm blocks of
    `keras.layers.MultiHeadAttention` and a GELU MLP (4 x `d_model`), mean
    pooling and a `classes`-way head.
    """
    import keras

    from kmix.benchmarks.gpt import PositionEmbedding

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


def data(rows, seq=128, vocab=1000, classes=2):
    """Random tokens and labels, `(x, y)`."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, (rows, seq)).astype("int32"), rng.integers(0, classes, rows).astype("int32")


def hand_time(model, x, y, routes, rounds, steps):
    """Seconds per step of each route, `{(policy, jit_compile): [one per round]}`, timed with a plain loop."""
    import keras

    import kmix

    built = {}
    for policy, jit in routes:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        placed = kmix.autocast(clone, policy)
        with kmix.policy_scope(policy):
            placed.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss=model.loss, jit_compile=jit)
        for _ in range(3):  # the trace (or XLA compile), the optimizer's build, one more
            placed.train_on_batch(x, y)
        built[(policy, jit)] = placed
    seconds = {route: [] for route in built}
    order = list(built)
    for r in range(rounds):
        for route in order[r % len(order):] + order[:r % len(order)]:
            begin = time.perf_counter()
            for _ in range(steps):
                built[route].train_on_batch(x, y)
            seconds[route].append((time.perf_counter() - begin) / steps)
    return seconds


def trial(size, batch_size, budget_s, hand_rounds, hand_steps, probe_shape=None, dtypes=None):
    """One fresh run: recommend, the other tie rule on its table, and the hand-timed routes. A dict.

    `probe_shape`: the probe's `(m, k, n)` (None: recommend's default probe, as a user gets it);
    `dtypes`: recommend's (None: the probe chooses, as for a user).
    """
    import statistics

    import kmix
    from kmix.route import facts
    from kmix.route.recommendation import decide_routes

    model = build_encoder(**size)
    x, y = data(4 * batch_size, size["seq"], size["vocab"], size["classes"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    begin = time.perf_counter()
    kwargs = {} if budget_s is None else {"budget_s": budget_s}
    if probe_shape is not None:
        kwargs["probe"] = kmix.device.probe(tuple(probe_shape), budget=0.02)
    if dtypes is not None:
        kwargs["dtypes"] = tuple(dtypes)
    rec = kmix.recommend(model, x, y, batch_size=batch_size, verbose=False, **kwargs)
    seconds = time.perf_counter() - begin
    table = rec.table
    if table is None:  # the budget could not cover one route: nothing was timed on the model to score
        raise SystemExit(f"bench recommend: {rec.reasons[-1]}")
    strict = decide_routes(table, rec.probe, facts.gpus(), facts.cpu_features(), facts.onednn_enabled(),
                           tie="float32")
    routes = [(r.policy, r.jit_compile) for r in table.routes]
    # A pick the budget left untimed (the probe's route) is hand-timed too, so that it can be scored.
    routes += [pick for pick in {(rec.policy, rec.jit_compile), (strict.policy, strict.jit_compile)}
               if pick not in routes]
    hand = hand_time(model, x[:batch_size], y[:batch_size], routes, hand_rounds, hand_steps)
    return {
        "load": load,
        "pick": [rec.policy, rec.jit_compile],
        "strict_pick": [strict.policy, strict.jit_compile],
        "tie": any("tie rule" in reason for reason in rec.reasons),
        "rounds": {_label(route): len(r.seconds) for route, r in zip(routes, table.routes)},  # timed ones only
        "recommend_ms": {_label(route): statistics.median(r.seconds) * 1e3 for route, r in zip(routes, table.routes)},
        "hand_ms": {_label(route): statistics.median(v) * 1e3 for route, v in hand.items()},
        "seconds": seconds,
    }


def _label(route):
    policy, jit = route
    return f"{policy}, {'XLA' if jit else 'tf.function'}"


def score(run):
    """`{rule: pick's hand-timed step / the fastest's}` for the recommended rule and the other."""
    fastest = min(run["hand_ms"].values())
    return {tie: run["hand_ms"][_label(run[key])] / fastest for tie, key in (("median", "pick"), ("float32", "strict_pick"))}


def summarize(runs):
    """The table's rows and the closing lines: how often each tie rule is within 5%, and its cost."""
    rows, lines = [], []
    for i, run in enumerate(runs, 1):
        s = score(run)
        fastest = min(run["hand_ms"], key=run["hand_ms"].get)
        rounds = sorted(run["rounds"].values())
        rows.append([i, "n/a" if run["load"] is None else f"{run['load']:.1f}", _label(run["pick"]),
                     f"{rounds[0]}-{rounds[-1]}", "yes" if run["tie"] else "no", fastest,
                     s["median"], "yes" if s["median"] <= WITHIN else "NO", _label(run["strict_pick"]),
                     s["float32"]])
    for tie in rule.TIES:
        costs = [score(run)[tie] for run in runs]
        good = sum(c <= WITHIN for c in costs)
        slower = [c for c in costs if c > WITHIN]
        worst = f"; slower in {len(slower)}, by {(max(slower) - 1):.0%} at worst" if slower else ""
        lines.append(f"tie={tie!r}{' (recommend default)' if tie == 'median' else ''}: within "
                     f"{WITHIN - 1:.0%} of the fastest hand-timed route in {good} of {len(runs)} runs{worst}; "
                     f"mean cost {(sum(costs) / len(costs) - 1):+.1%}.")
    return rows, lines


HEADERS = ["run", "load", "recommended", "rounds", "tie", "fastest (hand)", "x fastest", "within 5%",
           "tie='float32' pick", "x fastest"]


def main(argv=None):
    """Runs the benchmark; prints the table and the summary; returns `{"runs": [...], "summary": [...]}`."""
    parser = argparse.ArgumentParser(prog="python -m kmix bench recommend", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="fresh processes, each one recommend; default 10")
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile; default 2")
    parser.add_argument("--budget", type=float, default=None, help="recommend's budget_s; default its own (30)")
    parser.add_argument("--blocks", type=int, default=2, help="encoder blocks; default 2")
    parser.add_argument("--d-model", type=int, default=256, help="model width; default 256")
    parser.add_argument("--seq", type=int, default=128, help="sequence length; default 128")
    parser.add_argument("--batch-size", type=int, default=16, help="recommend's batch_size; default 16")
    parser.add_argument("--hand-rounds", type=int, default=15, help="hand-timed interleaved rounds; default 15")
    parser.add_argument("--hand-steps", type=int, default=3, help="steps per hand-timed round; default 3")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every run's figures here")
    parser.add_argument("--simulate", action="store_true",
                        help="no timing: the tie rules on simulated loaded rounds (SCENARIOS), in seconds")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 run, 1 busy process, a 1-block d 16 seq 8 encoder, budget 2 s, "
                        "a tiny probe")
    args = parser.parse_args(argv)
    if args.simulate:
        return {"simulation": print_simulation()}
    if args.quick:
        args.runs, args.busy, args.blocks, args.d_model, args.seq = 1, 1, 1, 16, 8
        args.budget, args.hand_rounds, args.hand_steps, args.batch_size = 2.0, 3, 1, 4
    size = {"blocks": args.blocks, "d_model": args.d_model, "heads": 4 if args.d_model % 4 == 0 else 1,
            "seq": args.seq, "vocab": 1000, "classes": 2}
    spec = json.dumps({"size": size, "batch_size": args.batch_size, "budget_s": args.budget,
                       "hand_rounds": args.hand_rounds, "hand_steps": args.hand_steps,
                       "probe_shape": (64, 16, 32) if args.quick else None})
    code = ("import json, sys\nfrom kmix.benchmarks.recommend import trial\n"
            f"print('RESULT ' + json.dumps(trial(**json.loads({spec!r}))), flush=True)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    runs = []
    try:
        for i in range(1, args.runs + 1):
            progress(f"bench recommend: run {i}/{args.runs} in a fresh process, {args.busy} busy beside it")
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not found:
                raise RuntimeError(f"run {i} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
            runs.append(json.loads(found[-1][len("RESULT "):]))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    cpu = _cpu_model()
    print(f"kmix.recommend(model, x, y, batch_size={args.batch_size}) on a {args.blocks}-block encoder, d_model "
          f"{args.d_model}, seq {args.seq}; {args.runs} fresh runs with {args.busy} busy processes beside them; "
          f"CPU {cpu}, {os.cpu_count()} cores; {datetime.date.today().isoformat()}")
    rows, lines = summarize(runs)
    print(format_table(HEADERS, rows))
    print("load: the 1-minute load average as the run began. x fastest: the pick's hand-timed median step "
          "over the fastest route's. tie: the reasons say the tie rule decided.")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "args": vars(args), "runs": runs}, f, indent=1)
    return {"runs": runs, "summary": lines}


def simulate(true_ms, sigma, seed, budget_s=8.0):
    """recommend's rounds on a simulated clock: `{route: [seconds per step, one per round]}`.

    Args:
        true_ms: `{(dtype, jit_compile): milliseconds per step}`.
        sigma: each step takes its true time times `exp(normal(0, sigma))`.
        seed: the noise's seed.
        budget_s: the seconds of rounds (compiling is not simulated).
    """
    import numpy as np

    rng, now = np.random.default_rng(seed), [0.0]

    def step(route):
        def call():
            now[0] += true_ms[route] * 1e-3 * math.exp(rng.normal(0.0, sigma))
        return call

    return timing.run_rounds({route: step(route) for route in true_ms}, {route: 1 for route in true_ms}, budget_s,
                             min_rounds=trials.MIN_ROUNDS, max_rounds=trials.MAX_ROUNDS,
                             more=lambda rounds: rule.unsettled(rounds, False), clock=lambda: now[0])


def simulated_costs(true_ms, sigma, seeds=40):
    """`{tie rule: [the pick's true step over the fastest's, one per seed]}` and the rounds' counts."""
    fastest = min(true_ms.values())
    costs, counts = {tie: [] for tie in rule.TIES}, []
    for seed in range(seeds):
        rounds = simulate(true_ms, sigma, seed)
        counts.append(max(len(v) for v in rounds.values()))
        for tie in rule.TIES:
            costs[tie].append(true_ms[rule.choose(rounds, False, 1.0, 1.0, tie=tie).route] / fastest)
    return costs, counts


def print_simulation(seeds=40):
    """The `--simulate` table: per scenario and tie rule, how often within 5%, the mean and worst cost."""
    rows = []
    for name, (true_ms, sigma) in SCENARIOS.items():
        costs, counts = simulated_costs(true_ms, sigma, seeds)
        for tie in rule.TIES:
            c = costs[tie]
            rows.append([name, tie, f"{sum(x <= WITHIN for x in c)}/{len(c)}", f"{sum(c) / len(c) - 1:+.1%}",
                         f"{max(c) - 1:+.0%}", f"{min(counts)}-{max(counts)}"])
    print(f"Simulated load: every step is its true time x exp(normal(0, sigma)); {seeds} seeds per scenario; "
          f"rounds as kmix.recommend runs them (at least {trials.MIN_ROUNDS}, more while unsettled, at most "
          f"{trials.MAX_ROUNDS}, 8 s of rounds).")
    print(format_table(["scenario", "tie rule", "within 5%", "mean cost", "worst", "rounds"], rows))
    return rows


def _cpu_model():
    from kmix.route.facts import cpu_features

    return cpu_features()["model"]
