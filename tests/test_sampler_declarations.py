"""A sampler declares its options and capabilities once (``Sampler.options``, ``consumes``,
``waits_for_data``, ``has_priorities``); the command line, the daemon's config, ``Buffer``,
the cluster's daemon options, ``settings()`` and the ``hello`` reply derive from it."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import shmbuffer
from shmbuffer.buffer import Buffer
from shmbuffer.cli import build_parser
from shmbuffer.clients.readerstate import CONSUMING_SAMPLERS, consumes
from shmbuffer.cluster.options import DAEMON_OPTIONS, start_flags
from shmbuffer.daemon.config import SAMPLER_OPTIONS, DaemonConfig
from shmbuffer.daemon.service import BufferService
from shmbuffer.samplers import OPTIONS, SAMPLERS, Option, make_sampler, takers

#: A value of each type that no default equals, so that a test sees it arrive.
GIVEN: dict[type, Any] = {int: 3, float: 0.25}


def _start_action(option: Option[Any]) -> Any:
    start = build_parser()._subparsers._group_actions[0].choices["start"]  # type: ignore[union-attr]
    return next(a for a in start._actions if option.flag in a.option_strings)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_declared_options_are_flags_config_keys_and_buffer_keywords(option: Option[Any]) -> None:
    action = _start_action(option)
    assert action.default is None  # None: the sampler's own default
    assert option.help in action.help
    assert option.name in {f.name for f in fields(DaemonConfig)}
    assert option.name in SAMPLER_OPTIONS
    keyword = inspect.signature(Buffer).parameters[option.name]
    assert keyword.kind is keyword.KEYWORD_ONLY and keyword.default is None
    assert option.name in DAEMON_OPTIONS
    # every sampler that declares it defaults to the declared default
    for name in takers(option):
        assert inspect.signature(SAMPLERS[name]).parameters[option.name].default == option.default


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_a_declared_option_reaches_the_sampler_through_every_door(option: Option[Any]) -> None:
    value = GIVEN[option.type]
    name = takers(option)[-1]
    args = build_parser().parse_args(["start", "--sampler", name, option.flag, str(value)])
    assert getattr(args, option.name) == value
    cluster = build_parser().parse_args(start_flags({"sampler": name, option.name: value}, 0))
    assert getattr(cluster, option.name) == value
    config = DaemonConfig(sampler=name, **{option.name: value})
    assert config.make_sampler().settings()[option.name] == value
    with Buffer(16, sampler=name, **{option.name: value}) as buf:
        assert buf.sampler.settings()[option.name] == value


@pytest.mark.parametrize("name", SAMPLERS)
def test_settings_are_the_declared_options(name: str) -> None:
    sampler = make_sampler(name)
    declared = {option.name: option.default for option in SAMPLERS[name].options}
    assert sampler.settings() == declared


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("times", [None, 2])
def test_the_hello_reply_says_what_the_sampler_declares(name: str, times: int | None) -> None:
    cls = SAMPLERS[name]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as storage:
        config = DaemonConfig(
            name=f"decl-{uuid.uuid4().hex[:10]}",
            capacity=16,
            storage_dir=storage,
            sampler=name,
            max_times_sampled=times,
        )
        buffer = BufferService(config).buffer_info()
    sampler = config.make_sampler()
    assert buffer["consumes"] is sampler.consuming is (cls.consumes or times is not None)
    assert sampler.waits_when_empty is (cls.waits_for_data or times is not None)
    assert consumes(buffer) is sampler.consuming
    # a daemon before the field: the reader decides by the sampler's declaration
    older = {k: v for k, v in buffer.items() if k != "consumes"}
    assert consumes(older) is sampler.consuming
    assert (name in CONSUMING_SAMPLERS) is cls.consumes


def test_the_reader_takes_the_daemons_word_over_the_name() -> None:
    # a sampler this side does not know, or one it knows by another declaration
    assert consumes({"sampler": "not-known-here", "max_times_sampled": None, "consumes": True})
    assert not consumes({"sampler": "fifo", "max_times_sampled": None, "consumes": False})


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_sampler_is_a_choice_of_every_door(name: str) -> None:
    args = build_parser().parse_args(["start", "--sampler", name])
    assert args.sampler == name
    assert build_parser().parse_args(start_flags({"sampler": name}, 0)).sampler == name
    assert DaemonConfig(sampler=name).make_sampler().name == name
    with Buffer(16, sampler=name) as buf:
        assert buf.sampler.name == name and buf.stats()["sampler"]["sampler"] == name


NEW_SAMPLER = """
import numpy as np

from shmbuffer.samplers.selector import Selection, Selector


class OldestSelector(Selector):
    name = "test-oldest"
    uses_rng = False

    def clear(self, capacity):
        self.seqs = {}

    def insert(self, items, priority):
        self.seqs.update(zip(items.slots.tolist(), items.seqs.tolist()))

    def delete(self, slots):
        for slot in slots.tolist():
            del self.seqs[slot]

    def update(self, slots, priority):
        pass

    def select(self, n, rng):
        oldest = sorted(self.seqs, key=self.seqs.get)[:n]
        return Selection(np.array(oldest, dtype=np.int64), np.ones(n))
"""

PROBE = """
from shmbuffer.cli import build_parser
from shmbuffer.ring.container import Container
from shmbuffer.daemon.config import DaemonConfig
from shmbuffer.samplers import SAMPLERS

print(list(SAMPLERS))
assert build_parser().parse_args(["start", "--sampler", "test-oldest"]).sampler == "test-oldest"
container = Container(8, sampler=DaemonConfig(sampler="test-oldest").make_sampler())
for n in (4, 4, 4):  # the third write overwrites the first
    container.commit(container.reserve_rows(n).id)
print(container.sample_rows(3).rows.tolist())
"""


def test_a_new_sampler_is_one_module_added_to_the_package(tmp_path: Path) -> None:
    """A module dropped into ``shmbuffer/samplers`` is listed, a ``--sampler`` choice and
    served, with no other file changed."""
    package = Path(shmbuffer.__file__).parent
    shutil.copytree(package, tmp_path / "shmbuffer", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "shmbuffer" / "samplers" / "oldest.py").write_text(NEW_SAMPLER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=tmp_path,  # ``-c`` puts the working directory first on the path
        capture_output=True,
        text=True,
        timeout=60,
        check=False,  # the assertion shows stderr
    )
    assert out.returncode == 0, out.stdout + out.stderr
    names, rows = out.stdout.splitlines()
    assert eval(names) == [*SAMPLERS, "test-oldest"]  # the package's own first, then it
    assert eval(rows) == [4, 5, 6]  # rows 0..3 were overwritten: the oldest live ones
