"""Gradient accumulation + ``ModelCheckpoint(every_n_train_steps=...)``: a resume writes the files the run wrote.

A checkpoint written at step S on the last batch of an accumulation window, resumed: the first resumed batch only
accumulates, ``global_step`` is still S, and ``ModelCheckpoint`` (whose guard ``_last_global_step_saved`` is not in
its state) would save step S again one batch later: mid-epoch over the good ``epoch=E-step=S.ckpt`` and
``last.ckpt``, at an epoch boundary as a new ``epoch=E+1-step=S.ckpt``. Each case runs the uninterrupted run (A)
and a run killed one batch after the checkpoint and resumed from its ``last.ckpt`` in a fresh process, in the same
directory (B), then compares the files B's directory holds with A's: the same names, and in every file every value
(tensors by SHA-256, other values exactly; paths relative to the run's directory): weights, BatchNorm statistics,
``EMAWeightAveraging``'s ``current_model_state`` and ``averaging_state``, optimizer, LR scheduler, loops, every
callback's state and our entry. Left out: the code section of the entry's run manifest and the entry's seal
(see ``IGNORED``); each file's seal is checked against its own entry instead.

The matrix: accumulation 2 and 3 x ``every_n_train_steps`` 2 and 3 x the checkpoint mid-epoch or on an epoch's last
batch x ``num_workers`` 0 and 2, all with ``save_top_k=-1, save_last=True``, BatchNorm and EMA. The default run has
a pairwise covering subset (every pair of axis values in some cell); ``REPRO_FULL_MATRIX=1`` runs the other cells.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import runner
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback
from lightning_repro.checkpoint.entry import DIGEST_KEY, entry_digest

BATCHES = 12  # scenario.py's 96 samples, batch 8
IGNORED = (
    # The run manifest's code section is the checkout's state when each fit started (git's dirty digest covers
    # untracked files): an edit between run A and the resumed run changes it, and a resume restores nothing from it.
    "/callbacks/DeterminismCallback/manifest/code/",
    # The entry's seal, a SHA-256 over all of it, manifest included: checked against each file's own entry instead.
    "/callbacks/DeterminismCallback/entry_sha256",
)


def checkpoint_at(accumulate: int, every: int, where: str) -> tuple[int, int, int]:
    """(batches run when the checkpoint is written, its global step S, max_epochs) for a cell.

    ``mid-epoch``: the last step checkpoint of a 2-epoch run whose next batch only accumulates (no step checkpoint
    follows it in some cells: then ``last.ckpt`` must not be written again at the end). ``epoch-end``: the first
    step checkpoint on an epoch's last batch, with an epoch after it.
    """
    for epochs in (2, 3, 4):
        found, step = None, 0
        for batch in range(1, epochs * BATCHES + 1):
            index = (batch - 1) % BATCHES
            if (index + 1) % accumulate and index != BATCHES - 1:
                continue  # only accumulates
            step += 1
            if step % every:
                continue
            last = index == BATCHES - 1
            following_steps = (index + 2) % accumulate == 0 or index + 1 == BATCHES - 1
            if where == "mid-epoch" and not last and not following_steps:
                found = (batch, step, epochs)  # the last one wins
            if where == "epoch-end" and last and batch < epochs * BATCHES:
                return batch, step, epochs
        if found is not None:
            return found
    raise AssertionError(f"no {where} checkpoint for accumulate={accumulate}, every={every}")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


def _kill_after_checkpoint(
    runs: Any, cfg: dict[str, Any], where: str, every: int, last: str = "last.ckpt"
) -> tuple[Path, int]:
    """Run ``cfg`` killed one batch after its ``where`` checkpoint of ``every`` steps; its directory and the step."""
    batch, step, _ = checkpoint_at(cfg["accumulate"], every, where)
    _, out = runs.run({**cfg, "kill_after_batches": batch + 1}, "killed", expect_kill=True)
    written = runner.checkpoint_position(Path(out, "ckpt", last))[:2]
    assert written == (step, batch), f"the killed run's {last} is not the checkpoint"
    return Path(out), step


AXES = {"accumulate": (2, 3), "every": (2, 3), "where": ("mid-epoch", "epoch-end"), "workers": (0, 2)}
# A covering array of strength 2 for four two-valued axes: every pair of values of any two axes is in some cell.
DEFAULT = [(3, 3, "mid-epoch", 0), (3, 2, "epoch-end", 2), (2, 3, "epoch-end", 2), (2, 2, "mid-epoch", 2),
           (2, 2, "epoch-end", 0)]  # fmt: skip
FULL = os.environ.get("REPRO_FULL_MATRIX") == "1"
CELLS = [
    pytest.param(*cell, id="acc{}-every{}-{}-workers{}".format(*cell))
    for cell in itertools.product(*AXES.values())
    if cell in DEFAULT or FULL
]


def test_default_cells_cover_every_pair() -> None:
    for (a, values_a), (b, values_b) in itertools.combinations(enumerate(AXES.values()), 2):
        for pair in itertools.product(values_a, values_b):
            assert any((cell[a], cell[b]) == pair for cell in DEFAULT), f"no default cell has {pair}"


@pytest.mark.slow
@pytest.mark.parametrize(("accumulate", "every", "where", "workers"), CELLS)
def test_resumed_run_keeps_the_uninterrupted_runs_files(
    runs: Any, accumulate: int, every: int, where: str, workers: int
) -> None:
    epochs = checkpoint_at(accumulate, every, where)[2]
    cfg = {
        "accumulate": accumulate,
        "ckpt_every_n_steps": every,
        "save_last": True,
        "batchnorm": True,
        "ema": True,
        "num_workers": workers,
        "max_epochs": epochs,
    }
    _assert_resume_keeps_files(runs, cfg, where, every)


def _assert_resume_keeps_files(runs: Any, cfg: dict[str, Any], where: str, every: int, last: str = "last.ckpt") -> None:
    reference, ref_out = runs.reference(cfg)
    out, _ = _kill_after_checkpoint(runs, cfg, where, every, last)
    resumed = runner.run({**cfg, "out": str(out), "resume": str(out / "ckpt" / last)})
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    for path in [*Path(ref_out, "ckpt").glob("*.ckpt"), *Path(out, "ckpt").glob("*.ckpt")]:
        entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
        assert entry[DIGEST_KEY] == entry_digest(entry), f"{path.name}: the entry does not match its seal"
    for key in ("params", "optimizer", "global_step", "epoch", "batches_that_stepped"):
        assert resumed[key] == reference[key], key


@pytest.mark.slow
def test_two_checkpoint_callbacks_due_at_the_same_step(runs: Any) -> None:
    """``every_n_train_steps`` 2 and 3 both save at step 6 (mid-epoch, accumulation 3), the second after the first:
    resumed from the second's ``last-every3.ckpt``, neither saves step 6 again, and the second, which saves no
    more before the end, does not write its ``last`` file again at ``on_train_end``."""
    cfg = {
        "accumulate": 3,
        "ckpt_every_n_steps": [2, 3],
        "save_last": True,
        "batchnorm": True,
        "ema": True,
        "num_workers": 0,
        "max_epochs": 2,
    }
    _assert_resume_keeps_files(runs, cfg, "mid-epoch", 6, "last-every3.ckpt")


@pytest.mark.slow
def test_plain_lightning_saves_the_checkpoints_step_again(runs: Any) -> None:
    """The control: plain Lightning, resumed from ``last.ckpt`` written at step 6 on epoch 0's last batch
    (accumulation 2), adds ``epoch=1-step=6.ckpt`` one batch later. Only file names and bytes are compared (plain
    Lightning does not resume its RNG streams: later files differ from the uninterrupted run's for that too).
    Reported as xfailed while plain Lightning has the bug."""
    cfg = {"accumulate": 2, "ckpt_every_n_steps": 2, "save_last": True, "num_workers": 0, "repro": False}
    out, step = _kill_after_checkpoint(runs, cfg, "epoch-end", 2)
    before = _digests(out / "ckpt")
    runner.run({**cfg, "out": str(out), "resume": str(out / "ckpt" / "last.ckpt")})
    after = _digests(out / "ckpt")
    again = sorted(
        name
        for name, digest in after.items()
        if name != "last.ckpt"
        and (before[name] != digest if name in before else runner.checkpoint_position(out / "ckpt" / name)[0] <= step)
    )
    with runner.plain_lightning_bug("ModelCheckpoint saves the checkpoint's step again after an accumulating batch"):
        assert not again, f"written again or anew at step <= {step} after the resume: {again}"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _guards(path: Path) -> list[tuple[int, int, str]]:
    entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
    return [(g["index"], g["step"], g["file"]) for g in entry["save_guards"]]


def test_entry_records_what_each_checkpoint_callback_saved(tmp_path: Path) -> None:
    """8 batches, accumulation 2 (4 steps); ModelCheckpoints every 2 steps (with ``last-a.ckpt``) and every 3.

    A file written by a callback records that callback at the current step with that file (it sets both once the
    file is written); the others as they are; ``trainer.save_checkpoint`` after ``fit`` records every callback as it
    is. Files are relative to the callback's ``dirpath``.
    """
    repro = DeterminismCallback(seed=3)
    every2 = ModelCheckpoint(
        dirpath=tmp_path, filename="a-{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    every2.CHECKPOINT_NAME_LAST = "last-a"
    every3 = ModelCheckpoint(dirpath=tmp_path, filename="b-{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = helpers.fast_trainer(
        [repro, every2, every3],
        max_epochs=1,
        accumulate_grad_batches=2,
        enable_checkpointing=True,
        default_root_dir=tmp_path / "root",  # the run's manifest goes there, not in the working directory
    )
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)
    trainer.fit(Tiny(), data)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    assert _guards(tmp_path / "a-step=2.ckpt") == [(0, 2, "a-step=2.ckpt"), (0, 0, "")]
    assert _guards(tmp_path / "b-step=3.ckpt") == [(0, 2, "last-a.ckpt"), (0, 3, "b-step=3.ckpt")]
    assert _guards(tmp_path / "a-step=4.ckpt") == [(0, 4, "a-step=4.ckpt"), (0, 3, "b-step=3.ckpt")]
    assert _guards(tmp_path / "last-a.ckpt") == [(0, 4, "last-a.ckpt"), (0, 3, "b-step=3.ckpt")]
    assert _guards(tmp_path / "end.ckpt") == [(0, 4, "last-a.ckpt"), (0, 3, "b-step=3.ckpt")]


@pytest.mark.slow
@pytest.mark.skipif(not helpers.LIGHTNING_26, reason="Lightning 2.5's ModelCheckpoint defers no save (2.6 does)")
@pytest.mark.parametrize("written", ["at-batch-end", "at-validation-end"])
def test_a_save_deferred_until_validation_is_still_due_after_the_resume(runs: Any, written: str) -> None:
    """Validation every 6 batches; ``ModelCheckpoint(monitor="val_loss", every_n_train_steps=4)`` is due at step 4,
    before the first validation: no ``val_loss`` yet, so it defers the save to the validation's end
    (``_defer_save_until_validation``, not in its state). Resumed from ``last.ckpt`` of another callback at step 5
    (``at-batch-end``, killed at step 6 before the validation) or from the file that a ``ModelCheckpoint(
    every_n_epochs=1)`` before it in the callback list writes at that validation's end (``at-validation-end``,
    killed at step 7), the resumed run still writes and registers ``best-step=6.ckpt`` at that validation's end, as
    the uninterrupted run does (step 6 is not due: nothing defers again after the resume)."""
    cfg = {
        "ckpt_every_n_steps": 5,
        "save_last": True,
        "ckpt_every_n_epochs": 1,
        "ckpt_monitor_every_n_steps": 4,
        "val": 6,
        "max_epochs": 1,
    }
    reference, ref_out = runs.reference(cfg)
    assert Path(ref_out, "ckpt", "best-step=6.ckpt").exists()
    kill, resume, step = (6, "last.ckpt", 5) if written == "at-batch-end" else (7, "epoch=0-step=6.ckpt", 6)
    _, out = runs.run({**cfg, "kill_after_batches": kill}, "killed", expect_kill=True)
    assert runner.checkpoint_position(Path(out, "ckpt", resume))[:2] == (step, step)
    if written == "at-batch-end":
        assert not Path(out, "ckpt", "best-step=6.ckpt").exists()
    resumed = runner.run({**cfg, "out": str(out), "resume": str(Path(out, "ckpt", resume))})
    # The killed run's Killer callback sits before the checkpoint callbacks (Lightning puts those last): the
    # remainder's position of the monitor callback in trainer.callbacks is one more in the file the killed run wrote
    # (a resume finds the callback by its state key where the position does not match).
    shifted = "/callbacks/DeterminismCallback/remainder/callbacks[0][1]"
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=(*IGNORED, shifted))
    assert not problems, "\n".join(problems)
    for key in ("params", "optimizer", "global_step", "epoch"):
        assert resumed[key] == reference[key], key


class TinyValidated(Tiny):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))


@pytest.mark.skipif(not helpers.LIGHTNING_26, reason="Lightning 2.5's ModelCheckpoint defers no save (2.6 does)")
@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "monitor-last"])
def test_entry_records_a_save_deferred_until_validation(tmp_path: Path, monitor_first: bool) -> None:
    """``ModelCheckpoint(monitor="val_loss", every_n_train_steps=4)`` defers its save at step 4 (no ``val_loss``
    before the first validation, at batch 6). Files written before that validation record it deferred; a file
    by the monitor callback's own ``on_validation_end`` (its deferred save) records it cleared; one written inside
    the validation's end by another callback (``every_n_epochs=1``, saving at validation ends) records it as it is
    then: cleared when the monitor's hook ran first, still deferred when it runs after (a resume replays it)."""
    monitor = ModelCheckpoint(
        dirpath=tmp_path, filename="best-{step}", monitor="val_loss", every_n_train_steps=4, save_top_k=-1
    )
    every5 = ModelCheckpoint(dirpath=tmp_path, filename="s-{step}", every_n_train_steps=5, save_top_k=-1)
    at_validation = ModelCheckpoint(dirpath=tmp_path, filename="v-{step}", every_n_epochs=1, save_top_k=-1)
    checkpoints = [monitor, every5, at_validation] if monitor_first else [every5, at_validation, monitor]
    trainer = helpers.fast_trainer(
        [DeterminismCallback(seed=3), *checkpoints],
        max_epochs=1,
        val_check_interval=6,
        enable_checkpointing=True,
        default_root_dir=tmp_path / "root",
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer.fit(TinyValidated(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=16))

    def deferred(name: str) -> bool:
        entry = torch.load(tmp_path / name, weights_only=True)["callbacks"]["DeterminismCallback"]
        (guard,) = [g for g in entry["save_guards"] if g["state_key"] == monitor.state_key]
        return bool(guard["defer"])

    assert (tmp_path / "best-step=6.ckpt").exists()  # the deferred save, at the validation's end
    assert deferred("s-step=5.ckpt") is True
    assert deferred("v-step=6.ckpt") is not monitor_first
    assert deferred("best-step=6.ckpt") is False
