"""``GradientAccumulationScheduler`` resumed in the middle of an epoch whose accumulation it changed.

The scheduler sets the accumulation in ``on_train_epoch_start``, which a mid-epoch resume does not run: the resumed
epoch went on with the Trainer's 1 (plain Lightning does too), stepping at every batch. In one process: the
uninterrupted run saves a checkpoint in epoch 1 (accumulation 2) and a new Trainer resumes from it; the scheduler
before and after our callback in ``callbacks`` (it checks the Trainer's value in its own ``on_train_start``).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER

BATCHES = 8  # 32 samples, batch 4
SAVE_AT = (1, 3)  # epoch 1, batch 3: step 8 + 2, the end of a window; batch 4 then only accumulates


class SaveAt(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) == SAVE_AT:
            trainer.save_checkpoint(self.path)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCHES, 4, generator=g), torch.randn(4 * BATCHES, 1, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)


def _fit(ours: bool, first: str, ckpt: Path, *, resume: bool) -> tuple[int, str]:
    callbacks: list[Callback] = [GradientAccumulationScheduler({0: 1, 1: 2})]
    if ours:
        repro = DeterminismCallback(seed=3)
        callbacks = [repro, *callbacks] if first == "ours" else [*callbacks, repro]
    else:
        pl.seed_everything(3, verbose=False)
    if not resume:
        callbacks.append(SaveAt(ckpt))
    model = helpers.SmallRegressor()
    trainer = helpers.fast_trainer(callbacks, max_epochs=2)
    trainer.fit(model, _loader(), ckpt_path=ckpt if resume else None)
    return trainer.global_step, digest_tensors(dict(model.state_dict()))


@pytest.mark.parametrize("first", ["ours", "scheduler"])
def test_resumed_epoch_keeps_the_scheduled_accumulation(tmp_path: Path, first: str) -> None:
    ckpt = tmp_path / "mid-epoch-1.ckpt"
    expected = _fit(True, first, ckpt, resume=False)
    assert expected[0] == BATCHES + BATCHES // 2
    assert _fit(True, first, ckpt, resume=True) == expected


def test_plain_lightning_resumes_with_the_trainers_accumulation(tmp_path: Path) -> None:
    """What the fix is for: plain Lightning steps at every resumed batch of epoch 1 (4 batches left: 4 steps)."""
    ckpt = tmp_path / "mid-epoch-1.ckpt"
    assert _fit(False, "", ckpt, resume=False)[0] == 12
    assert _fit(False, "", ckpt, resume=True)[0] == 10 + (BATCHES - SAVE_AT[1] - 1)


# ---------------------------------------------------------------------------------------------- another accumulation
class EpochAccumulation(helpers.SmallRegressor):
    """Sets the accumulation in its own ``on_train_epoch_start`` (1, then 2): a hook a mid-epoch resume skips."""

    def on_train_epoch_start(self) -> None:
        self.trainer.accumulate_grad_batches = 1 if self.current_epoch == 0 else 2


def _resume_warned(
    model: pl.LightningModule, ckpt: Path, caplog: pytest.LogCaptureFixture, **trainer: Any
) -> tuple[list[str], str]:
    """Resume ``model`` from ``ckpt``: the NotExactWarnings' messages and the resume line."""
    repro = DeterminismCallback(seed=3)
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        helpers.fast_trainer([repro], max_epochs=3, **trainer).fit(model, _loader(), ckpt_path=ckpt)
    [line] = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    return [str(w.message) for w in seen if issubclass(w.category, NotExactWarning)], line


def _save(model: pl.LightningModule, ckpt: Path, at: tuple[int, int], **trainer: Any) -> None:
    class Save(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if (trainer.current_epoch, args[-1]) == at:
                trainer.save_checkpoint(ckpt)

    helpers.fast_trainer([DeterminismCallback(seed=3), Save()], max_epochs=3, **trainer).fit(model, _loader())


def test_a_mid_epoch_resume_that_accumulates_otherwise_is_not_exact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The user's hook set 2 for epoch 1; resumed in epoch 1, the Trainer has its 1 again: said, in the line too."""
    ckpt = tmp_path / "mid.ckpt"
    _save(EpochAccumulation(), ckpt, (1, 3))
    messages, line = _resume_warned(EpochAccumulation(), ckpt, caplog)
    [message] = [m for m in messages if "accumulates" in m]
    assert "accumulates 1 batch(es) per optimizer step where the interrupted run accumulated 2" in message
    assert ": NOT exact: " in line
    assert "accumulates 1 batch(es)" in line


def test_another_trainer_accumulation_mid_epoch_is_not_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "mid.ckpt"
    _save(helpers.SmallRegressor(), ckpt, (1, 3))
    messages, line = _resume_warned(helpers.SmallRegressor(), ckpt, caplog, accumulate_grad_batches=2)
    assert any(
        "accumulates 2 batch(es) per optimizer step where the interrupted run accumulated 1" in m for m in messages
    )
    assert ": NOT exact: " in line


@pytest.mark.parametrize("at", [(0, BATCHES - 1), (1, BATCHES - 1)], ids=["end-of-epoch-0", "end-of-epoch-1"])
def test_no_batch_left_in_the_epoch_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, at: tuple[int, int]
) -> None:
    """At an epoch's last batch nothing of that epoch is left to accumulate: the next epoch runs the user's hook."""
    ckpt = tmp_path / "end.ckpt"
    _save(EpochAccumulation(), ckpt, at)
    messages, line = _resume_warned(EpochAccumulation(), ckpt, caplog)
    assert messages == []
    assert ": exact" in line
    assert "NOT exact" not in line


def test_the_same_accumulation_is_not_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "mid.ckpt"
    _save(helpers.SmallRegressor(), ckpt, (1, 3), accumulate_grad_batches=2)
    messages, line = _resume_warned(helpers.SmallRegressor(), ckpt, caplog, accumulate_grad_batches=2)
    assert messages == []
    assert "NOT exact" not in line


class Unsized(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """32 samples without ``__len__``: Lightning does not know the epoch's length (the fetcher marks its last batch)."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(4 * BATCHES):
            yield torch.randn(4, generator=g), torch.randn(1, generator=g)


@pytest.mark.parametrize(("at", "said"), [((1, 3), True), ((1, BATCHES - 1), False)], ids=["mid-epoch", "last-batch"])
def test_an_unsized_loader_is_said_only_with_batches_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, at: tuple[int, int], said: bool
) -> None:
    ckpt = tmp_path / "unsized.ckpt"

    class Save(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if (trainer.current_epoch, args[-1]) == at:
                trainer.save_checkpoint(ckpt)

    def fit(model: pl.LightningModule, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
        trainer = helpers.fast_trainer(callbacks, max_epochs=3)
        trainer.fit(model, DataLoader(Unsized(), batch_size=4), **kwargs)
        return trainer

    fit(EpochAccumulation(), [DeterminismCallback(seed=3), Save()])
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(EpochAccumulation(), [DeterminismCallback(seed=3)], ckpt_path=ckpt)
    messages = [str(w.message) for w in seen if issubclass(w.category, NotExactWarning)]
    assert any("accumulates 1 batch(es)" in m for m in messages) is said


@pytest.mark.parametrize("swa", [False, True], ids=["user", "swa-batchnorm-epoch"])
def test_the_advice_fits_who_set_the_accumulation(swa: bool) -> None:
    """StochasticWeightAveraging sets the accumulation for its BatchNorm epoch (all of it: no optimizer step): a
    resume inside that epoch was told to "set the value in the Trainer", which is not the user's to set."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_repro.checkpoint.accumulation import resume_accumulation

    ours = DeterminismCallback(seed=3)
    progress = SimpleNamespace(current=SimpleNamespace(ready=3), is_last_batch=False)
    loop = SimpleNamespace(restarted_mid_epoch=True, epoch_loop=SimpleNamespace(batch_progress=progress))
    callbacks = [ours, *([StochasticWeightAveraging(swa_lrs=0.1)] if swa else [])]
    trainer = SimpleNamespace(
        callbacks=callbacks, accumulate_grad_batches=1, current_epoch=3, fit_loop=loop, num_training_batches=8
    )
    said = resume_accumulation(trainer, ours, 9)  # type: ignore[arg-type]
    assert said is not None
    assert said.startswith("The resumed epoch accumulates 1 batch(es) per optimizer step where the interrupted run")
    advice = "; set the value in the Trainer, in `on_train_start` too, or with `GradientAccumulationScheduler`"
    assert (advice in said) is not swa
    assert said.endswith("where StochasticWeightAveraging set it for its BatchNorm epoch (a known exception).") is swa
