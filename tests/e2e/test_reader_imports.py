"""What a fresh process imports to make a Reader and to use it: a Reader connects, says hello and
answers ``stats()``, ``len()`` and ``close()`` with neither torch nor tensordict imported (a tool
that attaches to look pays for neither); the first call that touches rows imports torch (the
schema's dtypes, the segment's tensors) and the first that returns a TensorDict imports
tensordict. Import lists, not timings: the figures are ``python -m bench.startup``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import torch

from shmbuffer import Writer

PROBE = """
import json, sys

def heavy():
    return sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'tensordict', 'numba'})

from shmbuffer import Reader
seen = {'imported': heavy()}
reader = Reader(sys.argv[1], timeout=10)
seen['constructed'] = heavy()
seen['rows'] = [len(reader), reader.stats()['rows']]
seen['looked'] = heavy()
batch = reader.sample(3)
seen['sampled'] = heavy()
seen['batch'] = [type(batch).__name__, batch['obs'].shape[0]]
reader.close()
print(json.dumps(seen))
"""


def probe(name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, name],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the assertion shows what it printed
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_a_reader_imports_torch_only_when_it_first_touches_rows(daemon: Any) -> None:
    d = daemon(capacity=64, unit="transition")
    with Writer(d.name) as writer:
        writer.extend({"obs": torch.arange(20.0).reshape(10, 2)})
    seen = probe(d.name)
    assert seen["imported"] == [] and seen["constructed"] == [] and seen["looked"] == []
    assert seen["rows"] == [10, 10]
    assert {"torch", "tensordict"} <= set(seen["sampled"])
    assert seen["batch"] == ["TensorDict", 3]
