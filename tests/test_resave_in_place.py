"""A resume in the run's folder writes again, in place, what the interrupted run saved at the checkpoint's step.

The case users meet with gradient accumulation: ``ModelCheckpoint(every_n_train_steps=3, save_last=True)`` writes
``epoch=0-step=6.ckpt`` and ``last.ckpt`` on epoch 0's last batch, then a second ``ModelCheckpoint(every_n_epochs=1)``
saves the same step at the epoch's end, as ``epoch=0-step=6-v1.ckpt`` (the name is taken). A job stopped after that
and resumed from ``last.ckpt`` runs epoch 0's end again (it was still due at ``last.ckpt``), and the epoch callback
saves step 6 again: Lightning's version counter found ``-v1`` and named it ``-v2``, one file more than the
uninterrupted run's, named by ``best_model_path`` and our save guards in every later file. Here the interrupted run is
a fit of one epoch (its ``last.ckpt`` is that of a killed job: the epoch's end ran after it), resumed in the same
folder for a second epoch, and compared with an uninterrupted two-epoch fit: the same files, every value equal.

Also here: the values logged at the checkpoint's batch are in the epoch-end file as in the uninterrupted run's
(``_LoggerConnector.on_batch_end`` puts them into ``logged_metrics`` after ``on_train_batch_end``); a file of the
step written before the checkpoint, or without our entry, keeps Lightning's versioned name.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import helpers
import pytest
import runner
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback
from lightning_repro._warn import RESUME_LOGGER

IGNORED = ("/callbacks/DeterminismCallback/entry_sha256", "/callbacks/DeterminismCallback/manifest/")
"""The entry's seal and run manifest: the manifest holds the Trainer's arguments (``max_epochs`` differs here)."""

# Lightning's own warning when a run writes into a checkpoint folder with files: what a resume in place does
pytestmark = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")


class Logged(helpers.SmallRegressor):
    """Logs a step-and-epoch training loss and a validation loss, as users' modules do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def _loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator))
    return DataLoader(data, batch_size=2, shuffle=True)


def _fit(root: Path, epochs: int, resume: Path | None = None) -> None:
    ckpt = root / "ckpt"
    callbacks = [
        DeterminismCallback(seed=11),
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_top_k=-1, save_last=True),
        ModelCheckpoint(dirpath=ckpt, every_n_epochs=1, save_top_k=-1),
    ]
    trainer = helpers.fast_trainer(
        callbacks,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(Logged(), _loader(), _loader(), ckpt_path=resume)


def _interrupted(tmp_path: Path) -> tuple[Path, Path]:
    """The uninterrupted two-epoch run's folder, and the folder of a one-epoch run (its files as a killed job's)."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _fit(reference, 2)
    _fit(resumed, 1)
    names = sorted(p.name for p in (resumed / "ckpt").iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=6-v1.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert runner.checkpoint_position(resumed / "ckpt" / "last.ckpt")[:2] == (6, 12)
    return reference, resumed


def test_the_epoch_end_save_after_last_ckpt_is_written_again_in_place(tmp_path: Path) -> None:
    reference, resumed = _interrupted(tmp_path)
    _fit(resumed, 2, resume=resumed / "ckpt" / "last.ckpt")
    problems = runner.compare_checkpoint_files(reference, resumed, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    best = torch.load(resumed / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    paths = [state["best_model_path"] for key, state in best.items() if key.startswith("ModelCheckpoint")]
    assert not any(path.endswith("-v2.ckpt") for path in paths), paths


def test_the_checkpoint_batchs_logged_values_reach_the_epoch_end_file(tmp_path: Path) -> None:
    """``epoch=0-step=6-v1.ckpt`` is written after the last batch's ``on_batch_end``: its entry holds that batch's
    ``train_loss_step``, which the batch-end ``last.ckpt`` saved as that call leaves it (without the fix, the
    resumed run's epoch-end file held the previous logged batch's value)."""
    _, folder = _interrupted(tmp_path)

    def logged(name: str) -> dict[str, Any]:
        callbacks = torch.load(folder / "ckpt" / name, weights_only=True)["callbacks"]
        return callbacks["DeterminismCallback"]["callback_metrics"]["_logged_metrics"]

    at_batch, at_epoch_end = logged("last.ckpt"), logged("epoch=0-step=6-v1.ckpt")
    assert _digest(at_batch["train_loss_step"]) == _digest(at_epoch_end["train_loss_step"])


def test_a_file_older_than_the_checkpoint_keeps_lightnings_versioned_name(tmp_path: Path) -> None:
    """``-v1`` dated before ``last.ckpt`` (an earlier run's file): the resumed run does not overwrite it."""
    _, resumed = _interrupted(tmp_path)
    ckpt = resumed / "ckpt"
    earlier = os.path.getmtime(ckpt / "epoch=0-step=3.ckpt")
    os.utime(ckpt / "epoch=0-step=6-v1.ckpt", (earlier, earlier))
    before = (ckpt / "epoch=0-step=6-v1.ckpt").read_bytes()
    _fit(resumed, 2, resume=ckpt / "last.ckpt")
    assert (ckpt / "epoch=0-step=6-v1.ckpt").read_bytes() == before
    assert (ckpt / "epoch=0-step=6-v2.ckpt").is_file()


def test_a_file_without_our_entry_keeps_lightnings_versioned_name(tmp_path: Path) -> None:
    """``-v1`` written by plain Lightning code (no entry names its writer): not overwritten either."""
    _, resumed = _interrupted(tmp_path)
    ckpt = resumed / "ckpt"
    saved = torch.load(ckpt / "epoch=0-step=6-v1.ckpt", weights_only=True)
    saved["callbacks"].pop("DeterminismCallback")
    torch.save(saved, ckpt / "epoch=0-step=6-v1.ckpt")
    before = (ckpt / "epoch=0-step=6-v1.ckpt").read_bytes()
    _fit(resumed, 2, resume=ckpt / "last.ckpt")
    assert (ckpt / "epoch=0-step=6-v1.ckpt").read_bytes() == before
    assert (ckpt / "epoch=0-step=6-v2.ckpt").is_file()


def test_another_callbacks_file_of_the_step_is_not_overwritten(tmp_path: Path) -> None:
    """``last.ckpt`` dated as ``epoch=0-step=6.ckpt`` (a file system with coarse times, or ``save_last="link"``):
    that file, the step callback's, is kept; the epoch callback's own ``-v1`` is written again in place."""
    reference, resumed = _interrupted(tmp_path)
    ckpt = resumed / "ckpt"
    same = os.stat(ckpt / "epoch=0-step=6.ckpt").st_mtime_ns
    os.utime(ckpt / "last.ckpt", ns=(same, same))
    step_file = (ckpt / "epoch=0-step=6.ckpt").read_bytes()
    _fit(resumed, 2, resume=ckpt / "last.ckpt")
    assert (ckpt / "epoch=0-step=6.ckpt").read_bytes() == step_file
    problems = runner.compare_checkpoint_files(reference, resumed, ignore=IGNORED)
    assert not problems, "\n".join(problems)


def _linked(root: Path, resume: Path | None = None, **limits: Any) -> None:
    callbacks = [
        DeterminismCallback(seed=11),
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1, save_last="link"),
    ]
    trainer = helpers.fast_trainer(
        callbacks, enable_checkpointing=True, limit_val_batches=0, default_root_dir=root, **limits
    )
    trainer.fit(Logged(), _loader(), ckpt_path=resume)


def test_a_resume_from_a_linked_last_ckpt_names_the_link_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """``save_last="link"``: ``last.ckpt`` links the file saved at that step, whose state was saved before the link
    (``last_model_path=""`` at the first one). Resumed from the link in its folder, the run found ``last.ckpt``
    there, not its own, and linked ``last-v1.ckpt``, which every later file named."""
    _linked(tmp_path / "reference", max_epochs=2)
    _linked(tmp_path / "resumed", max_steps=4)  # its folder as a job's killed after step 4
    link = tmp_path / "resumed" / "ckpt" / "last.ckpt"
    assert link.is_symlink()
    assert os.readlink(link) == "epoch=0-step=4.ckpt"
    _linked(tmp_path / "resumed", resume=link, max_epochs=2)
    names = sorted(p.name for p in (tmp_path / "resumed" / "ckpt").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "reference" / "ckpt").iterdir())
    assert "last-v1.ckpt" not in names
    problems = runner.compare_checkpoint_files(tmp_path / "reference", tmp_path / "resumed", ignore=IGNORED)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_killed_job_resumed_from_last_ckpt_leaves_the_uninterrupted_runs_files(runs: Any) -> None:
    """In fresh processes, as users meet it: ``scenario.py`` (AdamW, validation, a scheduler, metrics, a CSVLogger,
    2 workers) with accumulation 2, a ``ModelCheckpoint`` every 3 steps with ``last.ckpt`` and one by epoch, SIGKILLed
    after 17 batches (epoch 1), resumed from ``last.ckpt`` (step 6, epoch 0's last batch) in the same folder."""
    cfg = {
        "accumulate": 2,
        "ckpt_every_n_steps": 3,
        "ckpt_every_n_epochs": 1,
        "save_last": True,
        "csv_logger": True,
        "max_epochs": 3,
        "num_workers": 2,
    }
    reference, ref_out, resumed, out = runs.resumed_in_place(cfg, 17, (6, 12))
    assert Path(out, "ckpt", "epoch=0-step=6-v1.ckpt").is_file(), "the killed run saved epoch 0's end after last.ckpt"
    for key in ("params", "optimizer", "global_step", "epoch", "batches_that_stepped", "lr", "metrics"):
        assert resumed[key] == reference[key], key
    assert runner.epochs(out) == runner.epochs(ref_out), "the epoch values differ"


class Stop(Callback):
    """Stops the run as a preemption does, when step ``at`` starts (its files so far stay in the folder)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.at and trainer.global_step == self.at:
            raise Preempted


class Preempted(Exception):
    """The stop of :class:`Stop`."""


def _two_callbacks(
    root: Path, *, stop: int = 0, resume: Path | None = None, dropout: float = 0.3, weights_only: bool = False
) -> None:
    """``last.ckpt`` every 3 steps (with its step file), and a second callback's file every 2 steps."""
    ckpt = root / "ckpt"
    often = {"filename": "often-{step}", "save_weights_only": weights_only}
    callbacks = [
        DeterminismCallback(seed=11),
        Stop(stop),
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_top_k=-1, save_last=True),
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1, **often),
    ]
    trainer = helpers.fast_trainer(callbacks, max_steps=16, enable_checkpointing=True, default_root_dir=root)
    with contextlib.suppress(Preempted):
        trainer.fit(helpers.SmallRegressor(dropout=dropout), _loader(), ckpt_path=resume)


def test_a_later_steps_file_saved_alike_again_keeps_its_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Stopped at step 11, after the second callback's ``often-step=10.ckpt``; resumed from ``last.ckpt`` (step 9).
    The resumed run saves step 10 again: Lightning names it ``often-step=10-v1.ckpt`` (the name is taken), a file
    more than the uninterrupted run's, and ``best_model_path`` and our save guards named it in every later file. The
    save holds what the interrupted run's file holds, so that file stays, the versioned one goes, and the callback
    names the first: the folder and every value are the uninterrupted run's."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _two_callbacks(reference)
    _two_callbacks(resumed, stop=11)
    assert (resumed / "ckpt" / "often-step=10.ckpt").is_file()
    assert runner.checkpoint_position(resumed / "ckpt" / "last.ckpt")[0] == 9
    before = (resumed / "ckpt" / "often-step=10.ckpt").read_bytes()
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER):
        _two_callbacks(resumed, resume=resumed / "ckpt" / "last.ckpt")
    assert (resumed / "ckpt" / "often-step=10.ckpt").read_bytes() == before  # the interrupted run's file, kept
    said = f"often-step=10-v1.ckpt holds what {resumed / 'ckpt' / 'often-step=10.ckpt'} holds"
    assert [r for r in caplog.records if said in r.getMessage()], "the resume does not say it kept the file"
    problems = runner.compare_checkpoint_files(reference, resumed, ignore=IGNORED)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("stop", "weights_only"),
    [(11, True), (13, True), (13, False)],
    ids=["weights-only-later-step", "weights-only-checkpoints-step", "checkpoints-step"],
)
def test_the_second_callbacks_file_of_the_step_is_the_uninterrupted_runs(
    tmp_path: Path, stop: int, weights_only: bool
) -> None:
    """Stopped at step 11 (after ``often-step=10.ckpt``; resumed from ``last.ckpt`` of step 9) or 13
    (``often-step=12.ckpt`` written after ``last.ckpt`` of step 12, the epoch's last batch, at the step resumed).

    Weights only (``save_weights_only=True``): Lightning writes no callback state into those files, so no entry of
    ours names their writer, and the resumed run wrote ``often-step=N-v1.ckpt``, a file more than the uninterrupted
    run's, named ``best_model_path`` in later files. Its contents are compared: the same, so the interrupted run's
    file stays. Either kind, saved again on the epoch's last batch: it held the batch counted completed (as a resume
    on that batch loads it) and no pending log row or validation, where the uninterrupted run's file holds them."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _two_callbacks(reference, weights_only=weights_only)
    _two_callbacks(resumed, stop=stop, weights_only=weights_only)
    step = stop - 1
    assert runner.checkpoint_position(resumed / "ckpt" / "last.ckpt")[0] == (9 if stop == 11 else 12)
    saved = torch.load(resumed / "ckpt" / f"often-step={step}.ckpt", weights_only=True)
    assert ("callbacks" in saved) is not weights_only
    before = (resumed / "ckpt" / f"often-step={step}.ckpt").read_bytes()
    _two_callbacks(resumed, resume=resumed / "ckpt" / "last.ckpt", weights_only=weights_only)
    if weights_only:  # the interrupted run's file, kept
        assert (resumed / "ckpt" / f"often-step={step}.ckpt").read_bytes() == before
    names = sorted(p.name for p in (resumed / "ckpt").iterdir())
    assert names == sorted(p.name for p in (reference / "ckpt").iterdir())
    problems = runner.compare_checkpoint_files(reference, resumed, ignore=IGNORED)
    assert not problems, "\n".join(problems)


def test_a_later_steps_file_saved_otherwise_keeps_lightnings_versioned_name(tmp_path: Path) -> None:
    """The same folder resumed with another dropout rate: the step-10 save differs from the interrupted run's file,
    so both stay, the new one under Lightning's versioned name, as without lightning-repro (nothing is lost)."""
    folder = tmp_path / "run"
    _two_callbacks(folder, stop=11)
    before = (folder / "ckpt" / "often-step=10.ckpt").read_bytes()
    _two_callbacks(folder, resume=folder / "ckpt" / "last.ckpt", dropout=0.6)
    assert (folder / "ckpt" / "often-step=10.ckpt").read_bytes() == before
    later = torch.load(folder / "ckpt" / "often-step=12.ckpt", weights_only=True)["callbacks"]
    paths = [state["best_model_path"] for key, state in later.items() if "every_n_train_steps': 2" in key]
    assert (folder / "ckpt" / "often-step=10-v1.ckpt").is_file()
    assert paths == [str(folder / "ckpt" / "often-step=12.ckpt")]


def test_same_but_named_compares_every_value_bitwise(tmp_path: Path) -> None:
    """The comparison behind it: names read across, every other difference counts (a float's bits, a dtype)."""
    from lightning_repro.checkpoint.reading import same_but_named

    def saved(name: str, **values: Any) -> str:
        content = {"path": str(tmp_path / name), "x": torch.zeros(3), "nan": float("nan"), "zero": 0.0, **values}
        torch.save(content, tmp_path / name)
        return str(tmp_path / name)

    original = saved("a.ckpt")
    assert same_but_named(saved("a-v1.ckpt"), original)
    assert not same_but_named(saved("b.ckpt", zero=-0.0), original)  # equal as floats, not as bits
    assert not same_but_named(saved("c.ckpt", x=torch.zeros(3, dtype=torch.float64)), original)
    assert not same_but_named(saved("d.ckpt", x=torch.tensor([0.0, 0.0, 2**-149])), original)
    assert not same_but_named(saved("e.ckpt", extra=1), original)
    (tmp_path / "f.ckpt").write_bytes(b"not a checkpoint")
    assert not same_but_named(str(tmp_path / "f.ckpt"), original)
    assert not same_but_named(str(tmp_path), original)  # a directory and a file: never the same


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_same_but_named_compares_distributed_checkpoint_directories(tmp_path: Path) -> None:
    """The sharded layout's checkpoints are directories; they were never the same, and a resume in the run's folder
    kept ``NAME-v1.ckpt/`` beside the interrupted run's directory of a later step (one more than the uninterrupted
    run's, named by later files). The shards compare byte for byte, ``meta.pt`` value by value, and
    ``torch.distributed.checkpoint``'s ``.metadata`` without its per-save ids and path."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from lightning_repro.checkpoint.reading import same_but_named

    def saved(name: str, weight: torch.Tensor, **meta: Any) -> str:
        directory = tmp_path / name
        dcp_save({"w": weight}, storage_writer=FileSystemWriter(directory))
        torch.save({"best_model_path": str(directory), "step": 3, **meta}, directory / "meta.pt")
        return str(directory)

    original = saved("a.ckpt", torch.arange(6.0))
    copy = saved("a-v1.ckpt", torch.arange(6.0))
    assert (Path(copy) / ".metadata").read_bytes() != (Path(original) / ".metadata").read_bytes()  # its save ids
    assert same_but_named(copy, original)
    assert not same_but_named(saved("b.ckpt", torch.arange(6.0) + 1), original)  # a shard's bytes
    assert not same_but_named(saved("c.ckpt", torch.arange(7.0)), original)  # the tensors described
    assert not same_but_named(saved("d.ckpt", torch.arange(6.0), step=4), original)  # meta.pt's values
    extra = saved("e.ckpt", torch.arange(6.0))
    (Path(extra) / "more.txt").write_text("x")
    assert not same_but_named(extra, original)


def _monitored(root: Path, resume: Path | None = None) -> None:
    """A monitored ``ModelCheckpoint`` every 4 steps and a second one every 2 (validation every 3 batches)."""
    ckpt = root / "ckpt"
    callbacks = [
        DeterminismCallback(seed=11),
        ModelCheckpoint(dirpath=ckpt, monitor="val_loss", every_n_train_steps=4, save_top_k=-1, filename="best-{step}"),
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1, filename="often-{step}"),
    ]
    trainer = helpers.fast_trainer(
        callbacks,
        max_steps=10,
        val_check_interval=3,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(Logged(), _loader(), _loader(), ckpt_path=resume)


def test_the_monitored_callbacks_current_score_is_given_back(tmp_path: Path) -> None:
    """``ModelCheckpoint.load_state_dict`` gives back every field of its state but ``current_score``: the file the
    second callback writes at step 6, after a resume in its folder from the monitored callback's step-4 file, held
    ``current_score=None`` in the monitored callback's state where the uninterrupted run's holds the value of that
    save (found by the ordinary project with accumulation, where it left a ``-v1`` file). Now it is given back:
    every value of that file is the uninterrupted run's."""
    _monitored(tmp_path / "reference")
    _monitored(tmp_path / "resumed")  # its later files as a killed job's
    _monitored(tmp_path / "resumed", resume=tmp_path / "resumed" / "ckpt" / "best-step=4.ckpt")  # in its folder
    state = torch.load(tmp_path / "resumed" / "ckpt" / "often-step=6.ckpt", weights_only=True)["callbacks"]
    assert [v["current_score"] is not None for k, v in state.items() if "'val_loss'" in k] == [True]
    problems = runner.compare_checkpoint_files(tmp_path / "reference", tmp_path / "resumed", ignore=IGNORED)
    assert not problems, "\n".join(problems)  # no -v1 copy of step 6: the save holds the same, current_score too


@pytest.mark.parametrize("step", [3, 9], ids=["first-save", "later-save"])
def test_a_resume_from_the_step_file_of_a_callback_with_last_ckpt_leaves_the_uninterrupted_runs_files(
    tmp_path: Path, step: int
) -> None:
    """Resumed from the step file (``epoch=0-step=9.ckpt``), not ``last.ckpt``: the callback wrote ``last.ckpt``
    after it in the same hook, so the uninterrupted run's later files name ``last.ckpt`` as its last save (our save
    guard), where the resumed run's named the step file. The second callback's save of step 10, written again, then
    differed from the interrupted run's file in that one value: kept as ``often-step=10-v1.ckpt``, named by later
    files, and the interrupted run's file stayed, one more than the uninterrupted run's (the line said exact)."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _two_callbacks(reference)
    _two_callbacks(resumed, stop=11)
    _two_callbacks(resumed, resume=resumed / "ckpt" / f"epoch=0-step={step}.ckpt")
    names = sorted(p.name for p in (resumed / "ckpt").iterdir())
    assert names == sorted(p.name for p in (reference / "ckpt").iterdir())
    problems = runner.compare_checkpoint_files(reference, resumed, ignore=IGNORED)
    assert not problems, "\n".join(problems)
