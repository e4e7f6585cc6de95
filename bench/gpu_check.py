"""The CUDA tier on a GPU machine, in one run: correctness first, then timings.

Run it on the device machine (one H200; Python 3.12 with torch 2.11, numpy, msgpack, no
network) with one call of the device tool's ``run``, the wheels it lacks carried from the
ignored folder ``.wheels/`` and the project as the working tree (``PYTHONPATH``, no install):

    run(carry=[".wheels"], timeout_s=420, command=
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        "--target /tmp/site .wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD "
        "PYTHONUNBUFFERED=1 || exit; timeout 150 python3 -m pytest -q -m gpu "
        "-p no:cacheprovider tests/test_cuda_segment.py tests/test_cuda_rows.py "
        "tests/e2e/test_cuda.py 2>&1 | tee $OUT/gpu_tests.txt | tail -25; "
        "timeout 240 python3 bench/gpu_check.py --out $OUT")

``.wheels/`` (4.9 MB, cp312 manylinux x86_64, each ``--no-deps``) was filled with

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .wheels pyzmq==27.3.0 tensordict==0.14.3 \
        orjson==3.13.0 pyvers==0.2.3 importlib_metadata==10.2.0 lazy-importer==0.1.0 \
        torchrl==0.14.1 hoptorch==0.1.4

(the machine has torch, numpy, msgpack, cloudpickle, packaging and zipp; no torch wheel is
carried). What comes back: ``gpu_tests.txt``, ``gpu_check.txt`` (the table) and
``gpu_check.json``. The tests keep the project's ``filterwarnings = error``: should a carried
package warn at import under torch 2.11, rerun them with ``-W default`` (the check script runs
after them either way). Locally, ``python bench/gpu_check.py --smoke`` runs the same steps on a CPU
buffer, small, with the GPU parts skipped: a check of the script, not of the tier.

Steps (about two minutes there; every process it starts is stopped, every folder removed):

1. a daemon ``start --device cuda`` (100k rows of 1 KiB: ``ep`` int64, ``t`` int32, ``obs``
   f32[256] with ``obs[t, j] = (ep*131 + t*7 + j) mod 65536``, so torn rows show);
2. two writer processes, one writing numpy episodes (host -> device through pinned staging),
   one writing CUDA tensors (device -> device), while a learner process samples rows and
   leased episodes and checks every one: on the GPU, whole, untorn, each episode view inside
   its mapping of the daemon's allocation (and its device pointer next to the daemon's);
3. the views are the daemon's memory, shown live: the learner keeps a view past its lease,
   the ring is overwritten from this process, and the kept view then shows the new rows;
4. timings of sample -> GPU batch, median over repetitions: the CUDA buffer's ``sample``;
   a CPU buffer's ``sample`` then ``.to("cuda")`` (pageable), and through a pinned staging
   batch; episodes copied into a GPU batch from a ``--pin-memory`` buffer's views, a plain
   CPU buffer's and the CUDA buffer's; TorchRL's ``LazyTensorStorage(device="cuda")``
   ``ReplayBuffer.sample()`` in-process. The table is printed last (and written to
   ``--out``/gpu_check.txt with the raw figures in gpu_check.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, and in the processes it spawns
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

LENGTH = 50  # rows per episode


class Sizes:
    def __init__(self, smoke: bool) -> None:
        self.dim = 16 if smoke else 256
        self.capacity = 5_000 if smoke else 100_000
        self.episodes = 20 if smoke else 1_200  # per writer: the ring laps while read
        self.learn_s = 3.0 if smoke else 12.0
        self.batches = (256,) if smoke else (256, 4096)
        self.iters = 20 if smoke else 200

    @property
    def schema(self) -> dict[str, Any]:
        return {
            "ep": {"dtype": "int64", "shape": []},
            "t": {"dtype": "int32", "shape": []},
            "obs": {"dtype": "float32", "shape": [self.dim]},
        }


def episode(ep: int, dim: int, device: str | None = None) -> dict[str, Any]:
    t = np.arange(LENGTH)
    obs = ((ep * 131 + t[:, None] * 7 + np.arange(dim)) % 65536).astype(np.float32)
    batch = {"ep": np.full(LENGTH, ep), "t": t.astype(np.int32), "obs": obs}
    if device is None:
        return batch
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


def bad_rows(ep: torch.Tensor, t: torch.Tensor, obs: torch.Tensor) -> int:
    j = torch.arange(obs.shape[-1], device=obs.device)
    want = ((ep[:, None] * 131 + t[:, None].long() * 7 + j) % 65536).to(obs.dtype)
    return int((obs != want).any(dim=1).sum())


# -- processes ------------------------------------------------------------------------------


class Daemon:
    """``shmbuffer-daemon start`` as a child, in this run's runtime and storage folders."""

    def __init__(self, run: Run, tag: str, args: list[str]) -> None:
        self.name = f"gpuchk-{tag}-{uuid.uuid4().hex[:6]}"
        self.log = run.runtime / f"{self.name}.log"
        argv = [
            sys.executable,
            "-m",
            "shmbuffer.cli",
            "start",
            "--name",
            self.name,
            "--capacity",
            str(run.sizes.capacity),
            "--unit",
            "episode",
            "--schema",
            str(run.schema_file),
            "--storage-dir",
            str(run.storage),
            "--seed",
            "0",
            *args,
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=run.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        record = run.runtime / f"{self.name}.json"
        while True:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(record.read_text()).get("pid") == self.proc.pid:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"daemon {tag} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _child(runtime: str, results: Any, fn: str, args: tuple[Any, ...]) -> None:
    os.environ["SHMBUFFER_RUNTIME_DIR"] = runtime
    try:
        results.put((fn, "ok", globals()[fn](*args)))
    except BaseException:
        results.put((fn, "error", traceback.format_exc()))


def writer_proc(name: str, wid: int, episodes: int, dim: int, on_gpu: bool) -> dict[str, Any]:
    """One writer: numpy episodes (host -> device), or CUDA tensors (device -> device)."""
    from shmbuffer import Writer

    device = "cuda" if on_gpu else None
    t0 = time.perf_counter()
    with Writer(name, timeout=30, batch_bytes=0 if on_gpu else 1 << 20) as writer:
        for i in range(episodes):
            writer.add_episode(episode(wid * 1_000_000 + i, dim, device))
        writer.flush()
        rows = writer.rows_committed
    return {"rows": rows, "seconds": time.perf_counter() - t0, "gpu_rows": on_gpu}


def learner_proc(name: str, seconds: float, expect: str, lap: Any, lapped: Any) -> dict[str, Any]:
    """Sample while the writers write; check every row and episode (see the docstring)."""
    from shmbuffer import Reader

    out: dict[str, Any] = dict.fromkeys(
        ["samples", "rows", "bad_rows", "off_device", "episodes", "broken_episodes"], 0
    )
    out["views_outside_mapping"] = 0
    with Reader(name, timeout=30) as reader:
        while reader.stats()["episodes"] < 16:
            time.sleep(0.05)
        reader.sample(1)  # attaches the segment (at the first call that needs rows)
        column = reader.segment.columns[("obs",)]
        base, end = column.data_ptr(), column.data_ptr() + column.numel() * column.element_size()
        row_bytes = column[0].numel() * column.element_size()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = reader.sample(256)
            out["samples"] += 1
            out["rows"] += 256
            out["off_device"] += sum(v.device.type != expect for v in batch.values())
            out["bad_rows"] += bad_rows(batch["ep"], batch["t"], batch["obs"])
            with reader.sample_episodes(8) as episodes:
                for ep in episodes:
                    out["episodes"] += 1
                    obs = ep["obs"]
                    ptr = obs.data_ptr()
                    inside = base <= ptr < end and (ptr - base) % row_bytes == 0
                    out["views_outside_mapping"] += not inside
                    out["off_device"] += obs.device.type != expect
                    whole = ep["t"].tolist() == list(range(LENGTH)) and len(ep["ep"].unique()) == 1
                    if not whole or bad_rows(ep["ep"], ep["t"], obs):
                        out["broken_episodes"] += 1
        out["resamples"] = reader.resamples
        if expect == "cuda":
            ipc = reader.segment.manifest["ipc"]
            out["daemon_ptr"] = hex(int(ipc["device_ptr"]))
            out["learner_ptr"] = hex(reader.segment.buffer.data_ptr())
        # liveness: keep a view past its lease, have the ring overwritten, look again
        with reader.sample_episodes(1) as episodes:
            kept_ep, kept_t, kept_obs = episodes[0]["ep"], episodes[0]["t"], episodes[0]["obs"]
            before = int(kept_ep[0])
        lap.set()
        if not lapped.wait(120):
            raise RuntimeError("the ring was not overwritten in 120 s")
        after = int(kept_ep[0])
        out["kept_view_ep_before"], out["kept_view_ep_after"] = before, after
        out["kept_view_shows_new_rows"] = (
            after != before and bad_rows(kept_ep, kept_t, kept_obs) == 0 and after >= 9_000_000
        )
    return out


# -- the run --------------------------------------------------------------------------------


class Run:
    def __init__(self, sizes: Sizes, smoke: bool) -> None:
        self.sizes = sizes
        self.smoke = smoke
        self.runtime = Path(tempfile.mkdtemp(prefix="gpuchk-", dir="/tmp"))
        self.storage = Path(f"/dev/shm/shmbuffer-gpuchk-{uuid.uuid4().hex[:8]}")
        self.schema_file = self.runtime / "schema.json"
        self.schema_file.write_text(json.dumps(sizes.schema))
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "SHMBUFFER_RUNTIME_DIR": str(self.runtime), "PYTHONPATH": path}
        os.environ["SHMBUFFER_RUNTIME_DIR"] = str(self.runtime)
        self.daemons: list[Daemon] = []
        self.checks: list[tuple[str, bool, str]] = []
        self.timings: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}

    def daemon(self, tag: str, args: list[str]) -> Daemon:
        d = Daemon(self, tag, args)
        self.daemons.append(d)
        return d

    def check(self, what: str, ok: bool, detail: Any = "") -> None:
        self.checks.append((what, bool(ok), str(detail)))
        print(f"[{'PASS' if ok else 'FAIL'}] {what} {detail}", flush=True)

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.storage, ignore_errors=True)


def fill(name: str, sizes: Sizes, first_ep: int, rows: int) -> None:
    from shmbuffer import Writer

    with Writer(name, timeout=30) as writer:
        for i in range(rows // LENGTH):
            writer.add_episode(episode(first_ep + i, sizes.dim))
        writer.flush()


def correctness(run: Run) -> None:
    """Steps 1-3 (see the docstring)."""
    sizes = run.sizes
    device = "cpu" if run.smoke else "cuda"
    d = run.daemon("gpu", [] if run.smoke else ["--device", "cuda"])
    run.facts["cuda_daemon"] = d.name
    ctx = mp.get_context("spawn")
    results, lap, lapped = ctx.Queue(), ctx.Event(), ctx.Event()
    jobs = [
        ("writer_proc", (d.name, 1, sizes.episodes, sizes.dim, False)),
        ("writer_proc", (d.name, 2, sizes.episodes, sizes.dim, not run.smoke)),
        ("learner_proc", (d.name, sizes.learn_s, device, lap, lapped)),
    ]
    procs = [
        ctx.Process(target=_child, args=(str(run.runtime), results, fn, args), daemon=True)
        for fn, args in jobs
    ]
    for proc in procs:
        proc.start()
    got: list[tuple[str, str, Any]] = []
    try:
        while len(got) < len(procs):
            writers_done = sum(fn == "writer_proc" for fn, _, _ in got)
            if lap.is_set() and not lapped.is_set() and writers_done == 2:
                # the writers are done: nothing but this writes over the kept view
                fill(d.name, sizes, 9_000_000, sizes.capacity)  # laps the whole ring
                lapped.set()
            try:
                got.append(results.get(timeout=0.2 if any(p.is_alive() for p in procs) else 10))
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"a worker died without a result: {got}") from None
            if any(status == "error" for _, status, _ in got):
                break
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    errors = [value for _, status, value in got if status == "error"]
    if errors:
        raise RuntimeError(errors[0])
    writers = [value for fn, _, value in got if fn == "writer_proc"]
    learner = next(value for fn, _, value in got if fn == "learner_proc")
    run.facts["writers"], run.facts["learner"] = writers, learner
    expected = 2 * sizes.episodes * LENGTH
    run.check(
        "writers committed every row",
        sum(w["rows"] for w in writers) == expected,
        [w["rows"] for w in writers],
    )
    run.check(
        "sampled rows all on the device and untorn",
        learner["off_device"] == 0 and learner["bad_rows"] == 0 and learner["rows"] > 0,
        f"{learner['rows']} rows in {learner['samples']} samples, {learner['resamples']} resampled",
    )
    run.check(
        "every leased episode whole",
        learner["broken_episodes"] == 0 and learner["episodes"] > 0,
        f"{learner['episodes']} episodes",
    )
    run.check(
        "episode views inside the learner's mapping of the daemon's allocation",
        learner["views_outside_mapping"] == 0,
        pointers(learner),
    )
    run.check(
        "a view kept past its lease shows the rows written over it (live memory)",
        learner["kept_view_shows_new_rows"],
        f"episode {learner['kept_view_ep_before']} -> {learner['kept_view_ep_after']}",
    )


def pointers(learner: dict[str, Any]) -> str:
    """The daemon's and the learner's device pointer of the allocation, and whether equal
    (each process maps an IPC allocation where its driver chooses: equal is not required)."""
    ours, theirs = learner.get("learner_ptr"), learner.get("daemon_ptr")
    if ours is None:
        return "(no device pointers: a CPU buffer)"
    same = "the same device pointer" if ours == theirs else "mapped at another address"
    return f"daemon {theirs}, learner {ours}: {same}"


def timed(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    for _ in range(max(3, iters // 10)):
        fn()
    laps = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        laps.append(time.perf_counter() - t0)
    laps.sort()
    return {
        "median_us": statistics.median(laps) * 1e6,
        "p10_us": laps[len(laps) // 10] * 1e6,
        "p90_us": laps[len(laps) * 9 // 10] * 1e6,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timings(run: Run) -> None:
    """Step 4 (see the docstring). A path that cannot run is a row with its error."""
    from shmbuffer import Reader

    sizes = run.sizes
    gpu = "cpu" if run.smoke else "cuda"
    cpu = run.daemon("cpu", [])
    fill(cpu.name, sizes, 0, sizes.capacity)
    names = {"cuda": run.facts.get("cuda_daemon"), "cpu": cpu.name}
    if not run.smoke:
        pinned = run.daemon("pinned", ["--pin-memory"])
        fill(pinned.name, sizes, 0, sizes.capacity)
        names["pinned"] = pinned.name
    row_bytes = 8 + 4 + 4 * sizes.dim
    readers: dict[str, Any] = {}
    for kind, name in names.items():
        try:
            readers[kind] = Reader(name)
            readers[kind].sample(8)  # attached (and page-locked) before anything is timed
        except Exception as exc:
            readers[kind] = f"{type(exc).__name__}: {exc}"[:200]
    try:
        if not isinstance(readers.get("pinned", ""), str):
            run.check(
                "the --pin-memory reader's rows are page-locked",
                readers["pinned"].segment.columns[("obs",)].is_pinned(),
            )
        for b in sizes.batches:
            paths = sample_paths(readers, b, gpu)
            paths.update(episode_paths(readers, b, gpu))
            paths.update(torchrl_path(sizes, b, gpu))
            for label, (fn, rows) in paths.items():
                try:
                    figures = timed(fn, sizes.iters if b <= 256 else sizes.iters // 2)
                except Exception as exc:  # one path failing must not hide the others
                    figures = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                figures.update(path=label, batch=b, rows=rows)
                if "median_us" in figures:
                    figures["GB_s"] = rows * row_bytes / (figures["median_us"] * 1e-6) / 1e9
                run.timings.append(figures)
                print(f"  timed {label} B={b}: {figures}", flush=True)
    finally:
        for reader in readers.values():
            if not isinstance(reader, str):
                reader.close()


def _reader(readers: dict[str, Any], kind: str) -> Any:
    """The reader of ``kind``, or raise the error that kept it from connecting."""
    reader = readers[kind]
    if isinstance(reader, str):
        raise RuntimeError(reader)
    return reader


def sample_paths(readers: dict[str, Any], b: int, gpu: str) -> dict[str, Any]:
    stage: dict[str, torch.Tensor] = {}
    target: dict[str, torch.Tensor] = {}

    def from_cuda() -> None:
        _reader(readers, "cuda").sample(b)  # gathered on the GPU, synchronised on return

    def pageable() -> None:
        _reader(readers, "cpu").sample(b).to(gpu)
        sync()

    def staged() -> None:
        batch = _reader(readers, "cpu").sample(b)
        for key, value in batch.items():
            if key not in stage:
                stage[key] = torch.empty_like(value, pin_memory=gpu == "cuda")
                target[key] = torch.empty_like(value, device=gpu)
            stage[key].copy_(value)
            target[key].copy_(stage[key], non_blocking=True)
        sync()

    def gather_alone() -> None:  # the GPU's part of from_cuda: no daemon, no stamps
        from shmbuffer.storage import cuda_rows

        reader = _reader(readers, "cuda")
        cuda_rows.gather_columns(reader.segment.columns, np.random.randint(0, 1000, b))

    def round_trip() -> None:  # the daemon's part: a ping over the same connection
        _reader(readers, "cuda").conn.call("ping")

    return {
        "CUDA buffer: sample() (GPU gather)": (from_cuda, b),
        "  of which the GPU gather alone": (gather_alone, b),
        "  of which a daemon round trip (ping)": (round_trip, 0),
        "CPU buffer: sample().to(cuda)": (pageable, b),
        "CPU buffer: sample() -> pinned staging -> cuda": (staged, b),
    }


def episode_paths(readers: dict[str, Any], b: int, gpu: str) -> dict[str, Any]:
    n = max(1, b // LENGTH)
    batches: dict[str, dict[str, torch.Tensor]] = {}

    def into_batch(kind: str) -> Callable[[], None]:
        def go() -> None:
            with _reader(readers, kind).sample_episodes(n) as episodes:
                for i, ep in enumerate(episodes):
                    for key, view in ep.items():
                        out = batches.setdefault(key, {})
                        if b not in out:
                            out[b] = torch.empty(
                                (n * LENGTH, *view.shape[1:]), dtype=view.dtype, device=gpu
                            )
                        out[b][i * LENGTH : (i + 1) * LENGTH].copy_(view, non_blocking=True)
                sync()  # before the lease goes (the Reader also settles the stream)

        return go

    paths = {
        "CUDA buffer: episode views -> GPU batch": (into_batch("cuda"), n * LENGTH),
        "CPU buffer: episode views -> GPU batch": (into_batch("cpu"), n * LENGTH),
    }
    if "pinned" in readers:
        label = "--pin-memory buffer: episode views -> GPU batch"
        paths[label] = (into_batch("pinned"), n * LENGTH)
    return paths


_torchrl: dict[str, Any] = {}


def torchrl_path(sizes: Sizes, b: int, gpu: str) -> dict[str, Any]:
    """TorchRL's LazyTensorStorage on the GPU, filled once with the same rows, in-process."""
    try:
        if "rb" not in _torchrl:
            from tensordict import TensorDict
            from torchrl.data import LazyTensorStorage, ReplayBuffer

            rb = ReplayBuffer(storage=LazyTensorStorage(sizes.capacity, device=gpu))
            rows = [episode(i, sizes.dim) for i in range(sizes.capacity // LENGTH)]
            data = {k: torch.from_numpy(np.concatenate([r[k] for r in rows])) for k in rows[0]}
            rb.extend(TensorDict(data, batch_size=[len(data["ep"])]).to(gpu))
            _torchrl["rb"] = rb
    except Exception as exc:
        _torchrl["rb"] = None
        _torchrl["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rb = _torchrl["rb"]
    label = f"TorchRL LazyTensorStorage(device={gpu!r}).sample()"
    if rb is None:

        def unavailable() -> None:
            raise RuntimeError(_torchrl["error"])

        return {label: (unavailable, b)}

    def go() -> None:
        rb.sample(b)
        sync()

    return {label: (go, b)}


def table(run: Run) -> str:
    lines = [
        "",
        "sample -> GPU batch (median of repetitions; rows of "
        f"{8 + 4 + 4 * run.sizes.dim} B; p10-p90 in brackets)",
        f"{'path':<52} {'batch':>6} {'rows':>6} {'median us':>10} {'p10-p90 us':>17} {'GB/s':>7}",
    ]
    for t in run.timings:
        if "median_us" not in t:
            lines.append(f"{t['path']:<52} {t['batch']:>6} {t['rows']:>6}  {t['error']}")
            continue
        spread = f"{t['p10_us']:.0f}-{t['p90_us']:.0f}"
        lines.append(
            f"{t['path']:<52} {t['batch']:>6} {t['rows']:>6} {t['median_us']:>10.1f} "
            f"{spread:>17} {t['GB_s']:>7.2f}"
        )
    passed = sum(ok for _, ok, _ in run.checks)
    lines.append(f"checks: {passed}/{len(run.checks)} passed")
    lines += [f"  FAIL {what}: {detail}" for what, ok, detail in run.checks if not ok]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(
            gpu=props.name, cuda=torch.version.cuda, free_gb=free / 1e9, total_gb=total / 1e9
        )
    for module in ("zmq", "tensordict", "torchrl"):
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:
            info[module] = f"missing: {exc}"
    return info


@contextlib.contextmanager
def section(run: Run, what: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        run.check(f"{what} ran", False, traceback.format_exc()[-1500:])
    finally:
        print(f"-- {what}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu_check.txt and gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="small, on a CPU buffer, no GPU")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here: run this on a GPU machine (or --smoke for a CPU check)")
        return 2
    t0 = time.perf_counter()
    info = machine()
    print(json.dumps(info), flush=True)
    run = Run(Sizes(args.smoke), args.smoke)
    try:
        with section(run, "correctness (daemon, two writers, a learner)"):
            correctness(run)
        with section(run, "timings"):
            timings(run)
    finally:
        run.close()
    text = table(run) + f"\ntotal {time.perf_counter() - t0:.0f} s"
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.txt").write_text(text + "\n")
        record = {"machine": info, "checks": run.checks, "timings": run.timings, **run.facts}
        (out / "gpu_check.json").write_text(json.dumps(record, indent=2, default=str))
    print(text, flush=True)
    return 0 if all(ok for _, ok, _ in run.checks) and run.checks else 1


if __name__ == "__main__":
    sys.exit(main())
