"""The check of ``scripts/lightning-tests.sh`` (Lightning's own tests with the callback injected): its verdicts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from lightning_repro import DeterminismCallback

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lightning_tests.py"
ALLOWED = {"loops/test_a.py::test_random": "asserts unseeded randomness"}


@pytest.fixture
def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lightning_tests_under_test", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(**outcomes: str) -> dict[str, str]:
    return {f"tests/tests_pytorch/loops/test_a.py::{name}": outcome for name, outcome in outcomes.items()}


def test_only_the_allowed_failures_fail(harness: ModuleType) -> None:
    code, lines = harness.check(_ids(test_ok="passed", test_random="failed", test_gpu="skipped"), ALLOWED)
    assert code == 0
    assert lines[0] == "1 failed, 1 passed, 1 skipped"
    assert "allowed failure: loops/test_a.py::test_random (asserts unseeded randomness)" in lines


@pytest.mark.parametrize("outcome", ["failed", "error", "xpassed"])
def test_any_other_failure_fails_the_run(harness: ModuleType, outcome: str) -> None:
    code, lines = harness.check(_ids(test_random="failed", test_new=outcome), ALLOWED)
    assert code == 1
    assert f"UNEXPECTED {outcome.upper()}: loops/test_a.py::test_new" in lines


def test_an_allowed_failure_that_passes_is_reported(harness: ModuleType) -> None:
    code, lines = harness.check(_ids(test_random="passed"), ALLOWED)
    assert code == 0
    assert "allowed failure passed: loops/test_a.py::test_random (remove it from the list?)" in lines


def test_a_run_without_tests_fails(harness: ModuleType) -> None:
    assert harness.check({}, ALLOWED)[0] == 1


def test_the_plugin_keeps_the_worst_phase_and_writes_the_results(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def report(nodeid: str, when: str, outcome: str, **extra: Any) -> SimpleNamespace:
        flags = {"failed": outcome == "failed", "skipped": outcome == "skipped"}
        return SimpleNamespace(nodeid=nodeid, when=when, **flags, **extra)

    for item in (
        report("a", "setup", "passed"),
        report("a", "call", "passed"),
        report("a", "teardown", "failed"),  # an error at teardown fails a test that passed
        report("b", "setup", "skipped"),
        report("c", "call", "skipped", wasxfail=""),
        report("d", "call", "passed"),
    ):
        harness.pytest_runtest_logreport(item)
    harness.pytest_collectreport(SimpleNamespace(nodeid="e.py", failed=True))
    path = tmp_path / "results.json"
    monkeypatch.setenv("LIGHTNING_TESTS_RESULTS", str(path))
    harness.pytest_sessionfinish(None, 1)
    written = json.loads(path.read_text())
    assert written == {
        "exitstatus": 1,
        "outcomes": {"a": "error", "b": "skipped", "c": "xfailed", "d": "passed", "e.py": "error"},
    }


def test_the_entry_point_factory_gives_a_fresh_callback(harness: ModuleType) -> None:
    first, second = harness.callbacks(), harness.callbacks()
    assert [type(c) for c in first] == [DeterminismCallback]
    assert first[0] is not second[0]
    assert first[0].seed == 0
