"""Lightning's own tests with ``DeterminismCallback(seed=0)`` in every Trainer: the harness of ``lightning-tests.sh``.

Three roles, one module (``scripts/lightning-tests.sh`` puts this folder on ``PYTHONPATH`` for that run only):

* :func:`callbacks`: the factory of the ``lightning.pytorch.callbacks_factory`` entry point that the script declares
  in a temporary ``*.dist-info`` (Lightning's ``trainer/connectors/callback_connector.py:
  _configure_external_callbacks`` adds what it returns to every Trainer);
* a pytest plugin (``-p lightning_tests``): each test's outcome, by node id, written as JSON to the file named by
  ``LIGHTNING_TESTS_RESULTS`` when the session ends;
* ``python lightning_tests.py check RESULTS.json``: the outcomes against :data:`ALLOWED_FAILURES`. Exit 1 on a
  failure not listed there (or a run that collected nothing), 0 otherwise; a listed failure that passed is reported,
  so the list can shrink.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

__all__ = ["ALLOWED_FAILURES", "callbacks", "check", "main"]

PREFIX = "tests/tests_pytorch/"
"""Node ids are relative to Lightning's checkout; the keys below leave this out."""

_REUSED_CALLBACKS = (
    "counts callbacks: it builds a second Trainer from the `callbacks` list of the first, which Lightning's"
    " _configure_external_callbacks extended in place with the entry point's callback, so the second Trainer has two"
    " DeterminismCallbacks with one state_key and Lightning refuses them (any stateful callback injected through the"
    " entry point does the same); the first Trainer's part of the test passes"
)
_CALLBACK_LIST = (
    "checks an exact callback list: the entry point's DeterminismCallback is one more item in `trainer.callbacks`"
)
_BATCH_SAMPLER_TYPE = (
    "checks the type of the batch sampler of the loader the loop uses (`trainer.test_dataloaders[0]`): that loader is"
    " the callback's taken-over copy, whose batch_sampler is a ReproBatchSampler wrapping the user's one"
    " (docs/how-it-works.md); the user's own loader and batch sampler are left as they were"
)
_NOT_RESUMABLE_WARNING = (
    "expects Lightning's warning that a mid-epoch resume of a loader without state_dict() is unreliable: the callback"
    " restores the data position itself and hides that warning for the resumed epoch; this checkpoint, written by"
    " `trainer.save_checkpoint` after an exception in training_step, holds a batch in flight, and the callback says"
    " so with its own NotExactWarning ('written in the middle of training batch 4') and a 'NOT exact' resume line"
)

_NO_VERSIONED_COPY = (
    "reads the `-v1` copy Lightning's version counter gives the second fit's save of a step the first fit had saved"
    " (resumed from an earlier checkpoint into the same folder) to compare it with the original: with"
    " DeterminismCallback that save holds what the original holds (compared value by value, bitwise), so the copy is"
    " removed and the original kept, as the uninterrupted run names it, and a line says so; the parity the test means"
    " holds (its loss check before passes)"
)

ALLOWED_FAILURES: dict[str, str] = {
    "models/test_hparams.py::test_adding_datamodule_hparams[data1-model1]": (
        "expects no `log_hyperparams` call for a module and datamodule without hyperparameters: the callback logs the"
        " run manifest to the loggers as hyperparameters (`repro/...`, docs/manifest.md), before Lightning logs the"
        " user's, so with hyperparameters Lightning's call is still the last one (the other cases of the test pass)"
    ),
    "loops/test_loops.py::test_restart_parity": _NO_VERSIONED_COPY,
    "loops/test_loops.py::test_restart_with_val_parity": _NO_VERSIONED_COPY,
    "loops/test_training_loop.py::test_training_starts_with_seed[True]": (
        "asserts unseeded randomness: after one seed_everything(123) it expects the second of two fits to see other"
        " batches than the first; DeterminismCallback(seed=0) pins every stream for each Trainer, so both see the same"
    ),
    "checkpointing/test_model_checkpoint.py::test_checkpoint_repeated_strategy_extended": (
        "counts callbacks: it builds five Trainers from one `callbacks` list, which Lightning's"
        " _configure_external_callbacks extends with the entry point's callback, so the second Trainer has two"
        " DeterminismCallbacks with one state_key and Lightning refuses them (any stateful callback injected"
        " through the entry point does the same)"
    ),
    "callbacks/test_finetuning_callback.py::test_callbacks_restore": _REUSED_CALLBACKS,
    "models/test_restore.py::test_model_properties_fit_ckpt_path": _REUSED_CALLBACKS,
    "models/test_restore.py::test_running_test_pretrained_model_cpu": _REUSED_CALLBACKS,
    "models/test_restore.py::test_load_model_from_checkpoint[ValTestLossBoringModel]": _REUSED_CALLBACKS,
    "models/test_restore.py::test_load_model_from_checkpoint[GenericValTestLossBoringModel]": _REUSED_CALLBACKS,
    "trainer/flags/test_fast_dev_run.py::test_callbacks_and_logger_not_called_with_fastdevrun[1]": _REUSED_CALLBACKS,
    "trainer/flags/test_fast_dev_run.py::test_callbacks_and_logger_not_called_with_fastdevrun[4]": _REUSED_CALLBACKS,
    "trainer/connectors/test_checkpoint_connector.py::test_loops_restore": _REUSED_CALLBACKS,
    "trainer/connectors/test_callback_connector.py::test_checkpoint_callbacks_are_last": _CALLBACK_LIST,
    "trainer/connectors/test_callback_connector.py::test_attach_model_callbacks": _CALLBACK_LIST,
    "trainer/connectors/test_data_connector.py::test_replace_distributed_sampler[1]": _BATCH_SAMPLER_TYPE,
    "trainer/connectors/test_data_connector.py::test_replace_distributed_sampler[2]": _BATCH_SAMPLER_TYPE,
    "models/test_restore.py::test_restarting_mid_epoch_raises_warning[ExceptionModel-True]": _NOT_RESUMABLE_WARNING,
    "models/test_restore.py::test_restarting_mid_epoch_raises_warning[ShouldStopModel-True]": _NOT_RESUMABLE_WARNING,
    "tuner/test_lr_finder.py::test_exponential_vs_linear_mode_gradient_difference": (
        "asserts the outcome of particular random draws: after seed_everything(42) it expects both lr_find runs to"
        " suggest a learning rate; each Trainer's DeterminismCallback(seed=0) re-seeds before BoringModel's random"
        " data is drawn, and with those draws the exponential run finds none (plain Lightning with seed_everything(0)"
        " after the second Trainer's construction fails the same way)"
    ),
}
"""Node id (below ``tests/tests_pytorch/``) -> why it fails with the callback injected and is not a bug of ours."""


def callbacks() -> list[Any]:
    """The entry point's factory: a fresh ``DeterminismCallback(seed=0)`` for each Trainer."""
    from lightning_repro import DeterminismCallback

    return [DeterminismCallback(seed=0)]


# ------------------------------------------------------------------------------------------- pytest plugin
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: Any) -> None:
    """Keep the worst outcome of each test's phases: failed (any phase) > xfailed > skipped > passed."""
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        return
    rank = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 3}
    previous = _outcomes.get(report.nodeid)
    if previous is None or rank[outcome] > rank[previous]:
        _outcomes[report.nodeid] = outcome


def pytest_collectreport(report: Any) -> None:
    """A module that cannot be collected (an import error) counts as an error of that module."""
    if report.failed:
        _outcomes[report.nodeid] = "error"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Write the outcomes where ``LIGHTNING_TESTS_RESULTS`` says."""
    path = os.environ.get("LIGHTNING_TESTS_RESULTS")
    if path:
        with open(path, "w") as out:
            json.dump({"exitstatus": int(exitstatus), "outcomes": _outcomes}, out, indent=1, sort_keys=True)


# ------------------------------------------------------------------------------------------- the check
def _short(nodeid: str) -> str:
    return nodeid[len(PREFIX) :] if nodeid.startswith(PREFIX) else nodeid


def check(outcomes: dict[str, str], allowed: dict[str, str] = ALLOWED_FAILURES) -> tuple[int, list[str]]:
    """The exit code and the report's lines for ``outcomes`` (node id -> outcome) against ``allowed``."""
    by_id = {_short(nodeid): outcome for nodeid, outcome in outcomes.items()}
    counts = Counter(by_id.values())
    failing = sorted(i for i, o in by_id.items() if o in ("failed", "error", "xpassed"))
    unexpected = [i for i in failing if i not in allowed]
    lines = [", ".join(f"{counts[k]} {k}" for k in sorted(counts)) or "no test ran"]
    for nodeid in failing:
        if nodeid in allowed:
            lines.append(f"allowed failure: {nodeid} ({allowed[nodeid]})")
    for nodeid in unexpected:
        lines.append(f"UNEXPECTED {by_id[nodeid].upper()}: {nodeid}")
    for nodeid in sorted(allowed):
        outcome = by_id.get(nodeid)
        if outcome in ("passed", None):
            lines.append(
                f"allowed failure {'passed' if outcome else 'did not run'}: {nodeid} (remove it from the list?)"
            )
    code = 1 if unexpected or not by_id else 0
    lines.append("result: " + ("FAILED" if code else "OK") + f" ({len(unexpected)} unexpected)")
    return code, lines


def main(argv: list[str]) -> int:
    """``check RESULTS.json``: print the report, return the exit code."""
    if len(argv) != 2 or argv[0] != "check":
        print("usage: python lightning_tests.py check RESULTS.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        outcomes = json.load(f)["outcomes"]
    code, lines = check(outcomes)
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
