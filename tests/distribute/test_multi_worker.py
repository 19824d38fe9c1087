"""Two `MultiWorkerMirroredStrategy` workers on 127.0.0.1 run examples/multi_worker.py.

An overflow in one worker's batch must skip the step on both workers: the
loss scale, the counters and the weights stay identical across workers, and
equal a run in which that step was left out on every worker. `model.fit` under
the same strategy is tested in test_multi_worker_fit.py.
"""

import json

import numpy as np

from tests.fault.processes import REPO, Worker, free_ports, report, run_all, worker_env

SCRIPT = REPO / "examples" / "multi_worker.py"
STEPS = 12
OVERFLOWS = [(3, 1), (7, 0)]  # (step, worker): each overflow is in one worker's data only
TIMEOUT = 180  # seconds for a pair of workers; a pair takes 15-40 s on two CPU cores


def run_pair(tmp_path, name, *args):
    """Starts two workers with their TF_CONFIG; returns (workers, exit codes, their .npz)."""
    out = tmp_path / name
    out.mkdir()
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    workers = []
    try:
        for index in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            workers.append(
                Worker(
                    [SCRIPT, "--steps", STEPS, "--save", out, *args],
                    out / f"worker{index}.log",
                    worker_env(TF_CONFIG=json.dumps(tf_config)),
                )
            )
    finally:
        codes = run_all(workers, TIMEOUT)  # also kills the first if the second failed to start
    states = [dict(np.load(p)) if p.exists() else None for p in (out / "worker0.npz", out / "worker1.npz")]
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
    workers, codes, states = run_pair(tmp_path, "overflow", *overflow_args())
    assert codes == [0, 0], report(workers, codes)
    assert_skipped_everywhere(states)

    # The reference: the same run with those steps left out on every worker, no overflow.
    drops = [a for step, _ in OVERFLOWS for a in ("--drop", step)]
    ref_workers, ref_codes, ref_states = run_pair(tmp_path, "reference", *drops)
    assert ref_codes == [0, 0], report(ref_workers, ref_codes)
    reference = ref_states[0]
    assert int(reference["skipped_steps"]) == 0
    assert int(reference["iterations"]) == int(states[0]["iterations"])
    weights = sorted(k for k in reference if k.startswith("weight_"))
    for key in weights:
        # Bitwise: the skipped run's scale ends 4x smaller, but scaling by a power of two
        # and unscaling in float32 is exact while no float16 gradient is subnormal.
        np.testing.assert_array_equal(states[0][key], reference[key], err_msg=key)
