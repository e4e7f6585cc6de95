"""A pytest plugin that only records outcomes: TorchRL's replay-buffer tests on TorchRL's own
storages, writers and samplers (nothing swapped), the yardstick the adapters' run is measured
against (``tests/peers/test_torchrl_suite.py``: of the tests that pass here, how many pass on
the daemon). Each test's node id and outcome go to the JSON-lines file
``SHMBUFFER_TORCHRL_REPORT``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def outcome(report: pytest.TestReport) -> str | None:
    """What one of a test's reports says of it: ``passed``, ``skipped`` or ``failed``; None
    for a report that adds nothing (a passed setup, any teardown)."""
    if report.when == "teardown" or (report.when == "setup" and report.passed):
        return None
    if report.when == "call":
        return "passed" if report.passed else "skipped" if report.skipped else "failed"
    return "skipped" if report.skipped else "failed"


def record(entry: dict[str, Any]) -> None:
    """Append ``entry`` to the JSON-lines file ``SHMBUFFER_TORCHRL_REPORT``."""
    with open(os.environ["SHMBUFFER_TORCHRL_REPORT"], "a") as out:
        out.write(json.dumps(entry) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    state = outcome((yield).get_result())
    if state is not None:
        record({"test": item.nodeid, "outcome": state})
