"""Populating private memory with the page size the probe picks (``shmbuffer/storage/pages.py``)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from shmbuffer.storage import pages
from shmbuffer.storage.schema import Schema
from shmbuffer.storage.segment import LocalSegment, _address

SIZE = pages.PROBE_MIN_BYTES + 3 * 4096  # the smallest probed mapping, not a whole huge page


def _mapping_kb(address: int, field: str) -> int:
    """``field`` (Rss, AnonHugePages) in kB, summed over the mappings from ``address`` on
    that the populate may have split by advice, up to ``address + SIZE``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.readlines()
    for line in lines:
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            inside = lo < address + SIZE and hi > address
        elif inside and parts[0] == f"{field}:":
            total += int(parts[1])
    return total


def test_the_rule_takes_huge_pages_unless_they_populate_clearly_slower() -> None:
    assert pages.prefer_huge(small_seconds=0.012, huge_seconds=0.007)  # 1.7x faster
    assert pages.prefer_huge(small_seconds=0.010, huge_seconds=0.010)  # a tie
    assert not pages.prefer_huge(small_seconds=0.004, huge_seconds=0.020)  # 5x slower
    assert not pages.prefer_huge(small_seconds=0.010, huge_seconds=0.010 * 1.2)


@pytest.mark.parametrize("choice", [True, False], ids=["huge", "small"])
def test_every_page_is_populated_and_the_advice_follows_the_choice(
    monkeypatch: pytest.MonkeyPatch, choice: bool
) -> None:
    """Whatever the probe decides, the whole mapping is resident and reads as zeros; the rest
    of it takes huge pages only when huge pages were chosen (where the kernel lets madvise
    choose: elsewhere the populate is plain and says so)."""
    monkeypatch.setattr(pages, "prefer_huge", lambda small, huge: choice)
    mm = mmap.mmap(-1, SIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = _address(mm)
    chosen = pages.populate_private(address, SIZE)
    assert _mapping_kb(address, "Rss") * 1024 >= SIZE - 4096, "not every page is resident"
    view = np.frombuffer(mm, np.uint8)
    assert not view[:: 4096 - 1].any()
    view[-1] = 7  # writable to the last byte
    if pages._thp_setting() != "madvise":
        assert chosen is False
        return
    assert chosen is choice
    huge_kb = _mapping_kb(address, "AnonHugePages")
    probed_kb = 2 * pages.PROBE_BYTES // 1024  # the probe's own huge slices
    if choice:
        if huge_kb == 0:
            pytest.skip("the kernel gave no huge pages at all (fragmented memory)")
        assert huge_kb > probed_kb
    else:
        assert huge_kb <= probed_kb


def test_a_small_mapping_is_populated_without_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def probe(*_: object) -> bool:
        raise AssertionError("a mapping below PROBE_MIN_BYTES was probed")

    monkeypatch.setattr(pages, "prefer_huge", probe)
    with LocalSegment(Schema.from_spec({"obs": {"dtype": "float32", "shape": [64]}}), 1000) as seg:
        assert seg.huge_pages is False
        assert not seg.arrays[("obs",)].any()
