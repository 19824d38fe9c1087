"""Two `MultiWorkerMirroredStrategy` workers on 127.0.0.1 run examples/multi_worker.py.

An overflow in one worker's batch must skip the step on both workers: the
loss scale, the counters and the weights stay identical across workers, and
equal a run in which that step was left out on every worker. `model.fit` under
the same strategy is tested in test_multi_worker_fit.py.

One pair of worker processes runs both: each calls the example's `main` (its
command line, as a list) for the run with overflows and then for the reference
run, which saves a TensorFlow start-up per process. A process can set up the
cluster's strategy only once (a second `MultiWorkerMirroredStrategy` enables
collective ops again and can abort a collective its peer is still in), so the
second `main` gets the strategy the first one made.
"""

import json

import numpy as np

from tests.fault.processes import REPO, Worker, free_ports, report, run_all, worker_env

SCRIPT = REPO / "examples" / "multi_worker.py"
STEPS = 12
OVERFLOWS = [(3, 1), (7, 0)]  # (step, worker): each overflow is in one worker's data only
TIMEOUT = 180  # seconds for the pair; it takes 15-40 s on two CPU cores
# The worker program: examples/multi_worker.py's `main` once per command line given as JSON; every
# `MultiWorkerMirroredStrategy()` after the first is the first (a subclass, so isinstance holds).
RUN_EACH = f"""
import json, sys
import tensorflow as tf
sys.path.insert(0, {str(SCRIPT.parent)!r})
import multi_worker

class FirstStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    made = None

    def __new__(cls, *args, **kwargs):
        return cls.made or super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if FirstStrategy.made is None:
            super().__init__(*args, **kwargs)
            FirstStrategy.made = self

tf.distribute.MultiWorkerMirroredStrategy = FirstStrategy
for argv in json.loads(sys.argv[1]):
    multi_worker.main(argv)
"""


def run_pair(out, runs):
    """Starts two workers with their TF_CONFIG, each running the example's `main` for every
    `name -> args` in `runs`; returns (workers, exit codes, {name: both workers' .npz or None})."""
    out.mkdir()
    argvs = [[str(a) for a in ("--steps", STEPS, "--save", out / name, *args)] for name, args in runs.items()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    workers = []
    try:
        for index in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            workers.append(
                Worker(
                    ["-c", RUN_EACH, json.dumps(argvs)],
                    out / f"worker{index}.log",
                    worker_env(TF_CONFIG=json.dumps(tf_config)),
                )
            )
    finally:
        codes = run_all(workers, TIMEOUT)  # also kills the first if the second failed to start
    paths = {name: [out / name / f"worker{i}.npz" for i in range(2)] for name in runs}
    states = {name: [dict(np.load(p)) if p.exists() else None for p in files] for name, files in paths.items()}
    return workers, codes, states


def overflow_args():
    return [a for step, worker in OVERFLOWS for a in ("--overflow", f"{step}:{worker}")]


def assert_skipped_everywhere(states):
    """Both workers hold the same state, and it shows exactly the injected skips."""
    first, second = states
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=f"{key} differs across workers")
    last_overflow = max(step for step, _ in OVERFLOWS)
    assert int(first["skipped_steps"]) == len(OVERFLOWS)
    assert int(first["iterations"]) == STEPS - len(OVERFLOWS)
    assert int(first["good_steps"]) == STEPS - 1 - last_overflow
    assert float(first["loss_scale"]) == 2.0**15 * 0.5 ** len(OVERFLOWS)
    # Every variable's gradient was non-finite in both skipped steps (the inf is in the input).
    assert first["overflow_counts"].tolist() == [len(OVERFLOWS)] * len(first["overflow_counts"])


def test_overflow_on_one_worker_skips_the_step_on_both(tmp_path):
    # The reference: the same run with those steps left out on every worker, no overflow.
    drops = [a for step, _ in OVERFLOWS for a in ("--drop", step)]
    workers, codes, states = run_pair(tmp_path / "pair", {"overflow": overflow_args(), "reference": drops})
    assert codes == [0, 0], report(workers, codes)
    assert_skipped_everywhere(states["overflow"])

    overflow, reference = states["overflow"][0], states["reference"][0]
    assert int(reference["skipped_steps"]) == 0
    assert int(reference["iterations"]) == int(overflow["iterations"])
    weights = sorted(k for k in reference if k.startswith("weight_"))
    for key in weights:
        # Bitwise: the skipped run's scale ends 4x smaller, but scaling by a power of two
        # and unscaling in float32 is exact while no float16 gradient is subnormal.
        np.testing.assert_array_equal(overflow[key], reference[key], err_msg=key)
