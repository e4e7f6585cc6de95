"""TorchRL's own replay-buffer tests, run with ``shmbuffer.torchrl`` substituted.

TorchRL's wheel does not ship its tests: fetch ``test/rb/`` of ``pytorch/rl`` at the commit
closest to the installed torchrl and point ``SHMBUFFER_TORCHRL_TESTS`` at that folder. Then

    SHMBUFFER_TORCHRL_TESTS=/path/to/rl/test/rb pytest -m peers tests/peers -s

runs the files in ``FILES`` (``SHMBUFFER_TORCHRL_FILES``, comma-separated, picks others) in a
pytest of their own with :mod:`tests.peers._torchrl_swap` loaded, which swaps TorchRL's
storages, writers and prioritized sampler for the adapters, one daemon per storage. Without
the folder the test skips (CI has no copy); with it, it is still behind ``-m peers``: it
starts a daemon for each of about 2,000 of its 2,700 tests.

It prints the counts, and, from a second run of the same files with nothing swapped
(``tests.peers._torchrl_native``: TorchRL's own storages, no daemon), how many of the tests
that pass there pass here. It fails if a test that ran on a daemon storage failed in a way no
entry of ``DIFFERENCES`` accounts for: each entry is a difference ``docs/torchrl.md`` states
(its ``doc`` phrase must be in that file), so a new kind of failure is either a defect of the
adapters or a difference to document.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torchrl", reason="the harness needs the [torchrl] extra")

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    "test_composable.py",
    "test_rb_core.py",
    "test_storages.py",
    "test_writers.py",
    "test_samplers.py",
    "test_prioritized.py",
]
DOCS = ROOT / "docs" / "torchrl.md"

#: (doc phrase, pattern): a failure whose message (or node id, for assertions that say
#: nothing) matches ``pattern`` is the documented difference under the heading holding
#: ``doc`` in docs/torchrl.md.
DIFFERENCES: list[tuple[str, str]] = [
    ("**Rows of one schema.**", r"missing keys|is not in the schema"),
    ("**A batch with no keys.**", r"a batch with no keys"),
    (
        "**Cells of a two-dimensional storage.**",
        r"inplace_writing_ndim|read_write_all_in_order_matches_full_slice_ndim2",
    ),
    (
        "**TorchRL's own in-place machinery.**",
        r"update_at_|boundary_cache_invalidated_across_processes",
    ),
    (
        "**Prefetch queues in a state dict.**",
        r"prefetch_state_dict|prefetch_without_replacement_roundtrip|"
        r"load_state_dict_waits_for_in_flight",
    ),
    ("**ConsumingSampler.**", r"ConsumingSampler|TestReplayBufferConsumption"),
    ("**More than one dimension here.**", r"one- or two-dimensional"),
    (
        "**TorchRL's writers.**",
        r"rows at the ring's pointer|DaemonStorage.set takes|no attribute '_generation'|"
        r"index_generation|TestWriterGeneration",
    ),
    (
        "**TorchRL's prioritized samplers.**",
        r"_total_shape|'(Prioritized|Daemon)Sampler' object "
        r"has no attribute|does not have an attribute alpha|test_prb\[|test_prb_rng|"
        r"anchor_distribution_unchanged|routes_to_multidimensional_anchors",
    ),
    (
        "**Features of TorchRL's storage classes.**",
        r"MemmapStorageCleanup|no attribute '(_backend|cleanup|_auto_cleanup)'|existsok|"
        r"lazystack|test_storage_dumps_loads\[False-(tensor|pytree)|test_slice_sampler_errors|"
        r"test_requires_tensordict_storage|TensorStorage._init\(\)|rows are read to the CPU",
    ),
    ("**Non-tensor data.**", r"str values .*cannot be stored"),
    ("**torch.compile.**", r"_dynamo|recompile|fullgraph"),
    ("**Mutation revision.**", r"mutation_revision"),
    ("**Write notifications.**", r"PromptGroupSampler::test_(shared_storage_update|plain_list)"),
    ("**Autograd.**", r"prefetch_autograd"),
    ("**TorchRL's process sharing.**", r"TestMultiProc::"),
]

pytestmark = [pytest.mark.peers, pytest.mark.timeout(4 * 3600)]


def _tests_dir() -> Path:
    where = os.environ.get("SHMBUFFER_TORCHRL_TESTS")
    if not where:
        pytest.skip("SHMBUFFER_TORCHRL_TESTS is not set (a copy of pytorch/rl's test/rb)")
    folder = Path(where)
    if not (folder / "_rb_common.py").exists():
        pytest.skip(f"{folder} holds no copy of pytorch/rl's test/rb (no _rb_common.py)")
    return folder


def classify(record: dict[str, str]) -> str | None:
    """The doc phrase of the difference a failure is, or None."""
    text = f"{record['message']}\n{record['test']}"
    for doc, pattern in DIFFERENCES:
        if re.search(pattern, text):
            return doc
    return None


def run_suite(folder: Path, files: list[str], report: Path, plugin: str = "_torchrl_swap") -> None:
    runtime = Path(tempfile.mkdtemp(prefix="sbtrl-", dir="/tmp"))
    storage = Path(f"/dev/shm/shmbuffer-trl-{uuid.uuid4().hex[:10]}")
    env = dict(os.environ)
    env.update(
        SHMBUFFER_RUNTIME_DIR=str(runtime),
        SHMBUFFER_TORCHRL_STORAGE_DIR=str(storage),
        SHMBUFFER_TORCHRL_REPORT=str(report),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        RL_WARNINGS="0",
    )
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *files,
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                f"tests.peers.{plugin}",
                "-o",
                "addopts=",
                "--timeout",
                "120",
            ],
            cwd=folder,
            env=env,
            timeout=4 * 3600,
            check=False,
            stdout=subprocess.DEVNULL,
        )
    finally:
        subprocess.run(["rm", "-rf", str(runtime), str(storage)], check=False)


def test_torchrl_replay_buffer_suite_on_the_adapters(tmp_path: Path) -> None:
    folder = _tests_dir()
    files = os.environ.get("SHMBUFFER_TORCHRL_FILES", ",".join(FILES)).split(",")
    files = [name for name in files if (folder / name).exists()]
    report = tmp_path / "report.jsonl"
    run_suite(folder, files, report)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    on_daemon = [r for r in records if r["daemon"]]
    counts = collections.Counter(r["outcome"] for r in on_daemon)
    failed = [r for r in on_daemon if r["outcome"] == "failed"]
    by_difference = collections.Counter(classify(r) for r in failed)
    print(f"\nTorchRL tests run: {len(records)}; on a daemon storage: {len(on_daemon)}")
    print(f"  passed {counts['passed']}, failed {counts['failed']}, skipped {counts['skipped']}")
    for doc, count in by_difference.most_common():
        print(f"  {count:5d}  {doc or 'NOT A DOCUMENTED DIFFERENCE'}")
    # The yardstick: the same tests on TorchRL's own storages (nothing swapped, no daemon).
    native_report = tmp_path / "native.jsonl"
    run_suite(folder, files, native_report, plugin="_torchrl_native")
    native = {
        r["test"]: r["outcome"] for r in map(json.loads, native_report.read_text().splitlines())
    }
    passing = [r for r in records if native.get(r["test"]) == "passed"]
    kept = sum(r["outcome"] == "passed" for r in passing)
    print(
        f"  of the {len(passing)} that pass on TorchRL's own storages, {kept} pass here "
        f"({100 * kept / max(1, len(passing)):.1f}%)"
    )
    docs = DOCS.read_text()
    assert [doc for doc, _ in DIFFERENCES if doc not in docs] == []
    unexplained = [f"{r['test']}: {r['message']}" for r in failed if classify(r) is None]
    assert not unexplained, "\n".join(unexplained)
