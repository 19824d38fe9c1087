"""Helpers for tests that run Python worker processes: start, wait with a deadline, kill.

A worker's output goes to a file (a pipe nobody reads can fill and block the
worker). Every wait has a deadline, and `stop` kills whatever is still
running, so a test that fails or times out leaves no process behind.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def worker_env(**extra):
    """The environment for a worker: kmix importable, quiet TensorFlow, CPU only."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the figures compared are CPU figures
    env.update(extra)
    return env


def free_ports(count):
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Worker:
    """One `python` subprocess whose stdout and stderr go to `log`."""

    def __init__(self, args, log, env):
        self.log = Path(log)
        self._file = open(self.log, "w")
        self.process = subprocess.Popen(
            [sys.executable, *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=self._file,
            stderr=subprocess.STDOUT,
        )

    def kill(self):
        """SIGKILL if still running; reaps the process."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._file.close()

    def output(self, tail=4000):
        """The end of what the worker printed, TensorFlow's start-up noise left out."""
        noise = ("WARNING: All log", "I0000", "E0000", "W0000", "To enable the following")
        lines = [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if not line.startswith(noise)
        ]
        text = "\n".join(lines)
        return text if tail is None else text[-tail:]


def run_all(workers, timeout):
    """Waits for every worker (at most `timeout` seconds in all); kills them all in the end.

    As soon as one worker fails the others are killed too: a multi-worker peer
    whose partner died would otherwise wait for it until the deadline.

    Returns:
        The exit codes, None for a worker that had to be killed.
    """
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [w.process.poll() for w in workers]
            failed = any(c not in (None, 0) for c in codes)
            if None not in codes or failed or time.monotonic() >= deadline:
                return codes
            time.sleep(0.2)
    finally:
        for w in workers:
            w.kill()


def report(workers, codes):
    """A failure message: each worker's exit code and the end of its output."""
    return "\n".join(
        f"--- worker {i}: exit code {c} ({w.log})\n{w.output()}"
        for i, (w, c) in enumerate(zip(workers, codes))
    )
