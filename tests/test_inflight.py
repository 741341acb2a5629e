"""A checkpoint written inside a training batch resumes at that batch's start, bitwise, where that can be exact.

``OnExceptionCheckpoint`` writes its file while Lightning handles an exception raised in the batch (a Ctrl-C's
``KeyboardInterrupt``, a user's ``RuntimeError``), and Lightning's restart trains that batch again: the entry must
hold the batch's start (the process streams before any ``on_train_batch_start`` drew, the logged epoch values
before its ``self.log``, the accumulated gradients) and count it unread. Each run is a fresh process
(``tests/scenario.py``): the uninterrupted run, the run that raised, and its resume from ``on_exception.ckpt`` in
the same folder (the files ``ModelCheckpoint`` writes after it go on there). Compared by SHA-256 and bits: weights,
optimizer, every step's samples, loss and dropout mask, the epoch values, every row the CSV logger wrote, and
every checkpoint file's values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
import torch

pytestmark = [pytest.mark.slow, pytest.mark.features]  # in the marked run of scripts/test.sh

# 96 samples, batch 8: 12 batches an epoch, 2 epochs; a step checkpoint every 5 steps before and after the stop
BASE: dict[str, Any] = {"max_epochs": 2, "ckpt_every_n_steps": 5, "csv_logger": True}
IGNORED = (  # as tests/test_accumulate_checkpoints.py: the checkout's state, and the seal over it
    "/callbacks/DeterminismCallback/manifest/code/",
    "/callbacks/DeterminismCallback/entry_sha256",
)


def _stopped_then_resumed(
    runs: Any, cfg: dict[str, Any], stop: dict[str, Any]
) -> tuple[str, dict[str, Any], Path, list[dict[str, str]]]:
    """The run that raises (``OnExceptionCheckpoint``), then its resume in its folder; and its logged rows.

    The rows of the run that raised are read before the resume: the CSV logger of the resumed run deletes the
    ``metrics.csv`` it finds (``lightning/fabric/loggers/csv_logs.py: _check_log_dir_exists``).
    """
    _, out = runs.run({**cfg, "on_exception_ckpt": True, "raise_in_batch": stop}, "raised", exit_code=1)
    rows = runner.csv_rows(out)
    checkpoint = Path(out, "ckpt", "on_exception.ckpt")
    resumed = runner.run({**cfg, "out": out, "resume": str(checkpoint)})
    return out, resumed, checkpoint, rows


def _assert_same(
    reference: dict[str, Any], ref_out: str, resumed: dict[str, Any], out: str, rows: list[dict[str, str]]
) -> None:
    for key in ("params", "optimizer", "global_step", "epoch", "batches_that_stepped", "lr", "metrics"):
        assert resumed[key] == reference[key], key
    assert runner.last_steps(out) == runner.last_steps(ref_out), "the steps differ (samples, losses or dropout masks)"
    assert runner.epochs(out) == runner.epochs(ref_out), "the epoch values differ"
    assert rows + runner.csv_rows(out) == runner.csv_rows(ref_out), "the logged rows differ"
    kept = [p.name for p in Path(ref_out, "ckpt").glob("*.ckpt")] + ["on_exception.ckpt"]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=kept)
    assert not problems, "\n".join(problems)


def _resume_line(stderr: str) -> str:
    [line] = [x for x in stderr.splitlines() if x.startswith("lightning-repro: resumed from")]
    return line


# (extra config, where, exception, batch of the run): the exception's batch k
CASES = [
    # in training_step after its draws (torch.rand, a dropout mask) and its self.log(on_epoch=True); mid-epoch 0
    pytest.param({}, "training_step", "KeyboardInterrupt", 6, id="training_step-ctrl-c-w0"),
    # workers; accumulation over 3 batches: batch 17 (index 5 of epoch 1) ends a window, 2 batches accumulated before
    pytest.param({"num_workers": 2, "accumulate": 3}, "training_step", "RuntimeError", 17, id="training_step-acc3-w2"),
    # a callback's on_train_batch_start, after another callback drew from every stream; without sample keys
    pytest.param(
        {"sample_keyed": False, "draw_at_batch_start": True},
        "on_train_batch_start",
        "KeyboardInterrupt",
        9,
        id="batch-start-unkeyed-w0",
    ),
    # the dataset's __getitem__ of batch 9, after its draws: the batch is not counted read yet
    pytest.param(
        {"sample_keyed": False, "draw_at_batch_start": True}, "fetch", "KeyboardInterrupt", 9, id="fetch-unkeyed"
    ),
    pytest.param({}, "fetch", "RuntimeError", 3, id="fetch-keyed"),
    # an IterableDataset read by 2 workers, no __len__ (Lightning's fetcher reads one batch ahead), its own state
    # taken in the workers: 40 items, batch 4, 10 batches an epoch; batch 13 is worker 1's
    pytest.param(
        {"n": 40, "batch_size": 4, "val": "off", "stream": {"state": True}, "num_workers": 2},
        "training_step",
        "RuntimeError",
        13,
        id="training_step-stream-w2",
    ),
]


@pytest.mark.parametrize(("extra", "where", "exc", "batch"), CASES)
def test_an_exception_inside_a_batch_resumes_bitwise(
    runs: Any, extra: dict[str, Any], where: str, exc: str, batch: int
) -> None:
    cfg = {**BASE, **extra}
    reference, ref_out = runs.reference(cfg)
    out, resumed, checkpoint, rows = _stopped_then_resumed(runs, cfg, {"where": where, "exc": exc, "batch": batch})
    loops = torch.load(checkpoint, weights_only=True)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    in_flight = where != "fetch"
    assert (loops["ready"], loops["processed"]) == (batch + int(in_flight), batch)  # where Lightning counted it
    _assert_same(reference, ref_out, resumed, out, rows)
    line = _resume_line(resumed["stderr"])
    if cfg.get("sample_keyed", True):
        assert ": exact (restore verified: parameters, optimizer" in line, line
    else:  # the loader's own verdict (its dataset draws while loading, unkeyed), nothing about the batch
        assert line.endswith(
            "sample_keyed=False: what the dataset draws while loading is not restored (exact only if it draws nothing))"
        ), line
    assert "in the middle of training batch" not in resumed["stderr"], resumed["stderr"][-3000:]


def test_a_save_from_training_step_resumes_bitwise(runs: Any) -> None:
    """``trainer.save_checkpoint`` in ``training_step`` (after its draws and its ``self.log``); the run goes on, and
    a resume from that file in a fresh folder continues like the uninterrupted run."""
    cfg = dict(BASE)
    reference, ref_out = runs.reference(cfg)
    _, saved = runs.run({**cfg, "save_in_batch": {"where": "training_step", "batch": 15}}, "saved-in-batch")
    checkpoint = Path(saved, "ckpt", "in-batch.ckpt")
    resumed, out = runs.run({**cfg, "resume": str(checkpoint)}, "resumed")
    for key in ("params", "optimizer", "global_step", "epoch", "batches_that_stepped", "lr", "metrics"):
        assert resumed[key] == reference[key], key
    # the batch in flight (15: epoch 1, index 3) on
    expected = [s for s in runner.last_steps(ref_out) if s[0] >= (1, 3)]
    assert runner.last_steps(out) == expected
    assert runner.epochs(out) == {1: runner.epochs(ref_out)[1]}
    later = [p.name for p in Path(out, "ckpt").glob("*.ckpt")]
    assert later == ["epoch=1-step=20.ckpt"]
    # ModelCheckpoint's state names the files of the run it resumed, in that run's folder
    problems = runner.compare_checkpoint_files(
        ref_out, out, ignore=(*IGNORED, "/callbacks/ModelCheckpoint"), names=later
    )
    assert not problems, "\n".join(problems)
    line = _resume_line(resumed["stderr"])
    assert ": exact (restore verified" in line, line
