"""Running the chosen scenarios: each one ``repeat`` times in a row, its repetitions folded into
median rows (:func:`bench.report.aggregate`), the machine's load watched around it
(:class:`bench.machine.LoadWatch`), and a progress bar on stderr while it goes.

Repeating a whole scenario interleaves its implementations: a scenario runs each of them once
per call, so the order is impl A run 1, impl B run 1, ..., impl A run 2, ... and noise that
lasts a while hits them all; scenarios that can also rotate their order by ``ctx.rep``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench import machine, report
from bench.registry import SCENARIOS, Context, Row


class _Bar:
    """A rich progress bar on stderr, or nothing when stderr is not a terminal (or rich is
    missing)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.progress: Any = None
        self.task: Any = None

    @contextmanager
    def shown(self) -> Iterator[_Bar]:
        if not sys.stderr.isatty():
            yield self
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            yield self
            return
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        # stdout lines go above the bar only when stdout is the same terminal; a piped
        # stdout (tables, markdown) must stay as it is.
        with Progress(
            *columns,
            console=Console(stderr=True),
            redirect_stdout=sys.stdout.isatty(),
            redirect_stderr=False,
        ) as progress:
            self.progress = progress
            self.task = progress.add_task("bench", total=self.total)
            try:
                yield self
            finally:
                self.progress = None

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)


def merge_notes(notes: list[str], start: int, rep: int, repeat: int) -> None:
    """The notes a repetition added after ``notes[start]``: a later run's copy of a note
    already there is dropped, and its other notes (figures that differ run to run, failures)
    are kept, tagged with the run (``scenario (run 2/3): ...``)."""
    new = notes[start:]
    del notes[start:]
    for note in new:
        if note in notes:
            continue
        name, _, text = note.partition(": ")
        notes.append(f"{name} (run {rep + 1}/{repeat}): {text}" if rep else note)


#: Modules the scenarios import lazily (through their adapters and peers), imported before the
#: first :func:`_freeze`: imported inside a scenario, their objects (torchrl's and
#: tensordict's alone are ~370k) would be walked by every ``gc.collect()`` of that scenario,
#: 0.25-0.3 s each, 60 of them in ``core.transitions``. A missing one is skipped here and
#: reported by the scenario that needs it.
PRELOAD = (
    "tensordict",
    "torchrl.data",
    "cpprb",
    "shmbuffer.buffer",
    "shmbuffer.clients.writer",
    "shmbuffer.clients.reader",
    "shmbuffer.samplers._jit",  # numba (the fast extra)
)


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception:  # the scenario that needs it says why it cannot run
            continue


def _freeze() -> None:
    """Collect, then move every live object out of the collector's sight (``gc.freeze``).

    Scenarios call ``gc.collect()`` before each timed op so that no collection lands inside
    it; with torch, tensordict and torchrl imported, a full collection walks millions of
    module objects (0.3-0.7 s each, most of a ``--quick`` run). Frozen, they are skipped:
    what a scenario allocates is still collected."""
    gc.collect()
    gc.freeze()


def run(names: list[str], ctx: Context, repeat: int) -> tuple[list[Row], dict[str, dict[str, Any]]]:
    """Run every scenario of ``names`` ``repeat`` times; the folded rows, and per scenario
    its seconds, repetitions and load (see :meth:`bench.machine.LoadWatch.stop`)."""
    rows: list[Row] = []
    info: dict[str, dict[str, Any]] = {}
    ctx.repeat = repeat
    _preload()
    with _Bar(len(names) * repeat).shown() as bar:
        for name in names:
            watch = machine.LoadWatch()
            runs: list[list[Row]] = []
            for rep in range(repeat):
                bar.describe(f"{name} ({rep + 1}/{repeat})" if repeat > 1 else name)
                ctx.rep = rep
                start = len(ctx.notes)
                _freeze()
                try:
                    runs.append(SCENARIOS[name](ctx))
                except Exception as exc:  # one scenario failing leaves the others to run
                    ctx.note(name, f"failed: {type(exc).__name__}: {exc}")
                    runs.append([])
                merge_notes(ctx.notes, start, rep, repeat)
                bar.advance()
            info[name] = {"repeats": repeat, **watch.stop()}
            rows += report.aggregate(runs)
            print(f"# {name}: {info[name]['seconds']:.1f} s", flush=True)
    ctx.rep = 0
    return rows, info
