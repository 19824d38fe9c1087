"""Would `TF_ENABLE_ONEDNN_OPTS=1` be faster here? Measured in two workers (TensorFlow reads it as it starts).

    >>> result = compare()
    >>> result.ratio, result.noise     # > 1 + noise: oneDNN on is faster
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

from kmix.route import timing
from kmix.route.facts import onednn_enabled
from kmix.route.probe import mlp_tensors, step_functions

CONFIGS = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))
SHAPE = (1024, 512, 2048)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """oneDNN on against off on the probe's step.

    Attributes:
        on, off: `{(dtype, jit_compile): [seconds per round]}` per setting.
        best_on, best_off: each setting's fastest configuration (median).
        ratio, noise: `kmix.route.timing.paired(best_off, best_on)` (above 1 + noise: on is faster).
        shape, seconds: the probe's `(m, k, n)`; how long it took, the workers' start included.
        enabled: `{"on": bool, "off": bool}`: whether each worker did run with oneDNN.
    """

    on: dict
    off: dict
    best_on: tuple
    best_off: tuple
    ratio: float
    noise: float
    shape: tuple
    seconds: float
    enabled: dict

    @property
    def faster(self):
        """Whether oneDNN on is faster beyond the noise."""
        return self.ratio > 1 + self.noise

    def gflops(self, setting, config):
        """GFLOP/s of `config` under `setting` ("on" or "off"), from its median round."""
        m, k, n = self.shape
        return 12 * m * k * n / timing.median(getattr(self, setting)[config]) / 1e9


def compare(shape=SHAPE, rounds=7, timeout=300):
    """Times the probe's step with oneDNN on and off, in two workers, interleaved; returns a `Comparison`."""
    start, workers = time.perf_counter(), {setting: _start(setting, shape) for setting in ("on", "off")}
    try:
        enabled = {setting: _read(worker, timeout)["ready"] for setting, worker in workers.items()}
        times = {setting: {config: [] for config in CONFIGS} for setting in workers}
        for r in range(rounds):
            for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
                worker = workers[setting]
                worker.stdin.write("round\n")
                worker.stdin.flush()
                for key, seconds in _read(worker, timeout).items():
                    dtype, jit = key.split(":")
                    times[setting][(dtype, jit == "xla")].append(seconds)
    finally:
        for worker in workers.values():
            _stop(worker)
    best = {s: min(CONFIGS, key=lambda c: timing.median(times[s][c])) for s in times}
    ratio, noise = timing.paired(times["off"][best["off"]], times["on"][best["on"]])
    return Comparison(times["on"], times["off"], best["on"], best["off"], ratio, noise, tuple(shape),
                      time.perf_counter() - start, enabled)


def _start(setting, shape):
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1" if setting == "on" else "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    code = f"from kmix.route import onednn; onednn.serve({tuple(shape)!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _read(worker, timeout):
    begin = time.perf_counter()
    line = worker.stdout.readline()
    if not line:
        raise RuntimeError(f"the oneDNN worker stopped (exit status {worker.wait(timeout)}) after "
                           f"{time.perf_counter() - begin:.0f} s")
    return json.loads(line)


def _stop(worker):
    if worker.poll() is None:
        try:
            worker.stdin.write("quit\n")
            worker.stdin.flush()
            worker.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            worker.kill()
            worker.wait()


def serve(shape):
    """The worker: builds the step per configuration, then times one call of each per "round" line."""
    tensors = mlp_tensors(shape, {dtype for dtype, _ in CONFIGS})
    calls = {f"{dtype}:{'xla' if jit else 'tf'}": functools.partial(lambda f, a: f(*a).numpy(), fn, tensors[dtype])
             for (dtype, jit), fn in step_functions(CONFIGS).items()}
    for call in list(calls.values()) * 2:  # trace, and warm up
        call()
    print(json.dumps({"ready": onednn_enabled()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps({key: timing.seconds(call) for key, call in calls.items()}), flush=True)
