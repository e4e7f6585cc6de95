"""Child for the two-process test: attaches by name, checks and writes rows in place.

Talks to the parent only with short lines ("ready", "done", "ok", "bad ...") on stdout and
commands on stdin; every row goes through the shared mapping, none through the pipes.
Usage: python _segment_child.py NAME STORAGE_DIR
"""

from __future__ import annotations

import sys

import torch

from shmbuffer.storage.segment import Segment


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    name, storage_dir = sys.argv[1], sys.argv[2]
    seg = Segment.attach(name, storage_dir=storage_dir)
    obs, reward = seg.columns[("obs",)], seg.columns[("next", "reward")]
    # (a) rows 0..7 were written by the parent before we started
    for i in range(8):
        if not (torch.all(obs[i] == i) and reward[i].item() == i * 0.5):
            say(f"bad row {i}: {obs[i].tolist()} {reward[i].item()}")
            return 1
    # (b) rows 8..15 are ours; the parent reads them through its own mapping
    for i in range(8, 16):
        obs[i] = 100 + i
        reward[i] = -float(i)
    say("done")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":  # the parent changed row 0 while we are both mapped
            ok = bool(torch.all(obs[0] == 77))
            say("ok" if ok else f"bad live row 0: {obs[0].tolist()}")
        elif cmd == "bye":
            seg.close()
            return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
