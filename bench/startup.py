"""How long a fresh process takes to make a Reader, and to get its first batch:

    .venv/bin/python -m bench.startup [--runs 5]

Starts a daemon (``shmbuffer.cli start``, 1,000 rows of obs f32[8]) with a scratch runtime
folder and a storage folder on /dev/shm, stores 500 rows, then runs ``--runs`` fresh
interpreters one after another. Each times its steps from its first line (the interpreter's own
start is not counted): ``from shmbuffer import Reader`` and ``Reader(name)`` (construct),
``len(reader)`` (a look: one round trip), and the first ``sample(256)`` (the attach: the schema,
the segment mapped, and whatever the first rows need imported), and notes which of torch,
tensordict and numba it had imported after each. Prints the median and range of each step
over the runs. The daemon and both folders are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

NAME = "bench-startup"
STEPS = ("construct", "look", "first sample")

PROBE = """
import json, sys, time
t0 = time.perf_counter()

def heavy():
    return sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tensordict', 'numba'})

from shmbuffer import Reader
reader = Reader(sys.argv[1], timeout=30)
t1 = time.perf_counter()
seen = {'construct': heavy()}
len(reader)
t2 = time.perf_counter()
seen['look'] = heavy()
reader.sample(256)
t3 = time.perf_counter()
seen['first sample'] = heavy()
reader.close()
print(json.dumps({'seconds': [t1 - t0, t2 - t1, t3 - t2], 'imported': seen}))
"""


def start_daemon(env: dict[str, str], storage: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "shmbuffer.cli", "start", "--name", NAME]
    argv += ["--capacity", "1000", "--unit", "transition", "--storage-dir", storage]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fill(deadline: float) -> None:
    """500 rows, through a Writer that retries until the daemon answers."""
    import torch

    from shmbuffer import DaemonUnavailableError, Writer

    while True:
        try:
            writer = Writer(NAME, timeout=5)
            break
        except DaemonUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with writer:
        writer.extend({"obs": torch.randn(500, 8)})


def probe(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="sbstart-", dir="/tmp")
    storage = f"/dev/shm/shmbuffer-bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "SHMBUFFER_RUNTIME_DIR": runtime}
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime  # for fill(), in this process
    daemon = start_daemon(env, storage)
    try:
        fill(time.monotonic() + 120)
        runs = [probe(env) for _ in range(args.runs)]
    finally:
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    print(f"seconds per step of a fresh process, {args.runs} runs (median [min-max]):")
    for i, step in enumerate(STEPS):
        got = [run["seconds"][i] for run in runs]
        imported = runs[-1]["imported"][step]
        print(
            f"  {step:13s} {statistics.median(got):7.3f} [{min(got):.3f}-{max(got):.3f}]"
            f"  imported after it: {', '.join(imported) or 'none of torch, tensordict, numba'}"
        )
    total = [sum(run["seconds"]) for run in runs]
    low, high = min(total), max(total)
    print(f"  {'to a batch':13s} {statistics.median(total):7.3f} [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
