"""DDP: a rank's own module buffers, callback states and trainer metrics, which Lightning's checkpoint (rank 0's)
does not hold.

Each rank's forward updates its own BatchNorm statistics, and a module's ``on_train_batch_end`` may move a buffer with
the rank's batch (an EMA teacher); DDP overwrites them with rank 0's only at a forward that follows a synchronized one
(not inside a gradient accumulation window, nor after a validation) or never (``broadcast_buffers=False``). A job
killed after a checkpoint and resumed in its folder must give every rank its own buffers, and DDP's next forward the
broadcast (or not) it had: every file the resumed job writes holds what the uninterrupted job's holds (before, rank 1's
logged teacher values and validation losses differed, and the resume said "exact").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import runner
import torch

from lightning_repro.cli.main import main

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

BASE_METRICS = {"max_epochs": 2, "ckpt_every_n_steps": 4, "teacher": True, "read_metrics": True}
BASE_METRICS |= {"csv_logger": True, "log_every_n_steps": 1}
IGNORED = ("/callbacks/DeterminismCallback/manifest/", "/callbacks/DeterminismCallback/entry_sha256")
CASES = [
    # the teacher moved by each rank's batch after the step checkpoint (the rest of its on_train_batch_end, run on
    # resume); inside an accumulation window DDP does not broadcast at the next forward: rank 1's teacher is its own
    pytest.param(
        {"teacher": True, "accumulate": 2, "ckpt_every_n_steps": 2, "save_last": True, "val": "off"},
        7,
        "last.ckpt",
        id="ema-teacher-accumulation",
    ),
    # a checkpoint at a validation's end inside an accumulation window (batch 4 of the window 4-6): the next forward
    # does not broadcast (the one before it ran under no_sync, the validation's without grad), so rank 1's teacher
    # moves on from its own at batch 5 (a new process's DDP broadcasts at its first forward)
    pytest.param(
        {"teacher": True, "accumulate": 3, "val": 2, "ckpt_every_n_epochs": 1},
        5,
        "epoch=0-step=1.ckpt",
        id="ema-teacher-checkpoint-inside-an-accumulation-window",
    ),
    # broadcast_buffers=False: every rank keeps its own statistics for good, and EMAWeightAveraging's averaged copy of
    # each rank's module too (Lightning saves the callback's model from rank 0 as well)
    pytest.param(
        {
            "batchnorm": True,
            "ema": True,
            "val": 3,
            "ckpt_every_n_steps": 3,
            "save_last": True,
            "ddp_kwargs": {"broadcast_buffers": False},
        },
        7,
        "last.ckpt",
        id="batchnorm-ema-broadcast_buffers-False",
    ),
]


@pytest.mark.parametrize(("extra", "kill_after", "resume_from"), CASES)
def test_every_rank_resumes_with_its_own_buffers(
    runs: Any, extra: dict[str, Any], kill_after: int, resume_from: str
) -> None:
    cfg = {"max_epochs": 2, "num_workers": 0, **extra}
    reference, ref_out = runs.ddp(cfg, "ddp-ref-buffers", launcher="nodes")
    killed = {**cfg, "kill_after_batches": kill_after}
    _, out = runs.ddp(killed, "ddp-killed-buffers", launcher="nodes", expect_kill=True)
    checkpoint = Path(out, "ckpt", resume_from)
    part = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][1]
    own = part["replica"].get("buffers")  # rank 1's own: unlike rank 0's, which the file holds
    assert own, part.get("replica")
    if extra.get("ema"):  # the averaged model's statistics too
        assert any(k.startswith("callback[EMAWeightAveraging") and "running_mean" in k for k in own), sorted(own)
    resumed = runner.run_ddp({**cfg, "out": out, "resume": str(checkpoint)}, launcher="nodes")
    assert (resumed["params"], resumed["optimizer"]) == (reference["params"], reference["optimizer"])
    for rank in (0, 1):
        assert resumed["ranks"][rank]["params"] == reference["params"], f"rank {rank}"
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    lines = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, resumed["stderr"][-3000:]
    assert ": exact (restore verified: parameters," in lines[0], lines[0]
    assert "differed from rank 0's" not in resumed["stderr"]  # the restore check's warning of old checkpoints


def test_every_rank_resumes_with_its_own_early_stopping_state(runs: Any) -> None:
    """Each rank's ``EarlyStopping`` watches its own ``val_rank`` (logged without ``sync_dist``): rank 1's gets worse
    at epoch 1 and stops the job (the ranks stop together when one would). Lightning's checkpoint holds rank 0's
    state, whose best score rank 1's value beats: resumed with it, rank 1 went on and the job trained 5 epochs."""
    cfg = {"max_epochs": 5, "num_workers": 0, "rank_early_stopping": True, "ckpt_every_n_epochs": 1}
    reference, ref_out = runs.ddp(cfg, "ddp-ref-stop", launcher="nodes")
    assert reference["global_step"] == 12, "rank 1's EarlyStopping is meant to stop the job after 2 epochs of 6 steps"
    _, out = runs.ddp({**cfg, "kill_after_batches": 7}, "ddp-killed-stop", launcher="nodes", expect_kill=True)
    checkpoint = Path(out, "ckpt", "epoch=0-step=6.ckpt")
    part = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][1]
    [(key, state)] = part["replica"]["callbacks"].items()  # rank 1's own: unlike rank 0's, which the file holds
    assert key.startswith("EarlyStopping"), key
    assert float(state["best_score"]) == 4.0, state  # its own value of epoch 0 (rank 0's: 12)
    resumed = runner.run_ddp({**cfg, "out": out, "resume": str(checkpoint)}, launcher="nodes")
    assert (resumed["params"], resumed["global_step"]) == (reference["params"], reference["global_step"])
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)


def _metrics_read(out: str | Path, rank: int) -> list[dict[str, Any]]:
    path = Path(out, f"metrics-rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_rank_reads_its_own_trainer_metrics_after_a_resume(runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank logs its own ``train_loss`` (step and epoch values, without ``sync_dist``); the module's
    ``on_train_batch_end`` reads ``trainer.callback_metrics`` and ``logged_metrics``. ``ModelCheckpoint`` saves every
    4 steps before that hook, which then runs again on resume; a CSVLogger logs every step, so the batch's log row
    is still due when the file is written. Killed after 10 batches, resumed from step 8 (epoch 1: epoch 0's
    ``train_loss_epoch`` is each rank's own too): every rank reads what it read in the uninterrupted job, and every
    file and log row equal its; ``inspect`` names rank 1's own values. Before each part held them, rank 1 read rank
    0's values at the resumed batch."""
    cfg = {**BASE_METRICS, "num_workers": 0}
    reference, ref_out = runs.ddp(cfg, "ddp-ref-metrics", launcher="nodes")
    _, killed = runs.ddp({**cfg, "kill_after_batches": 10}, "ddp-killed-metrics", launcher="nodes", expect_kill=True)
    checkpoint = Path(killed, "ckpt", "epoch=1-step=8.ckpt")
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    parts = entry["ranks"]
    assert "callback_metrics" not in parts[0]  # rank 0's: the shared values
    assert "pending_log" not in parts[0]
    own, shared = parts[1]["callback_metrics"]["_callback_metrics"], entry["callback_metrics"]["_callback_metrics"]
    assert own["train_loss_epoch"] != shared["train_loss_epoch"]  # the ranks' values differ: the test can tell
    assert parts[1]["pending_log"]["train_loss_step"] != entry["pending"]["log"]["train_loss_step"]
    capsys.readouterr()
    assert main(["inspect", "--json", str(checkpoint)]) == 0
    said = [rank["own_logged_values"] for rank in json.loads(capsys.readouterr().out)["ranks"]]
    assert said[0] == []
    assert {"train_loss_epoch", "train_loss_step"} <= set(said[1]), said
    assert "teacher" not in said[1]  # logged with sync_dist: alike on every rank
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-resumed-metrics", launcher="nodes")
    assert (resumed["params"], resumed["optimizer"]) == (reference["params"], reference["optimizer"])
    for rank in (0, 1):
        read = [r for r in _metrics_read(killed, rank) if r["global_step"] < 8] + _metrics_read(out, rank)
        assert read == _metrics_read(ref_out, rank), f"rank {rank}"
    assert _metrics_read(ref_out, 0) != _metrics_read(ref_out, 1)
    later = sorted(p.name for p in Path(out, "ckpt").glob("*.ckpt"))
    assert later == ["epoch=1-step=12.ckpt"]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=later)
    assert not problems, "\n".join(problems)
    # rank 0's rows (its logger writes them): from the file's logger step on, the uninterrupted job's
    expected = runner.csv_rows(ref_out, drop_empty=True)
    loops = torch.load(checkpoint, weights_only=True)["loops"]
    cut = loops["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"]
    assert runner.csv_rows(out, drop_empty=True) == [row for row in expected if int(row["step"]) >= cut]
