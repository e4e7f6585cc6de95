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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" or (report.when == "setup" and report.passed):
        return
    if report.when == "call":
        state = "passed" if report.passed else "skipped" if report.skipped else "failed"
    else:
        state = "skipped" if report.skipped else "failed"
    with open(os.environ["SHMBUFFER_TORCHRL_REPORT"], "a") as out:
        out.write(json.dumps({"test": item.nodeid, "outcome": state}) + "\n")
