"""``GradientAccumulationScheduler`` resumed in the middle of an epoch whose accumulation it changed.

The scheduler sets the accumulation in ``on_train_epoch_start``, which a mid-epoch resume does not run: the resumed
epoch went on with the Trainer's 1 (plain Lightning does too), stepping at every batch. In one process: the
uninterrupted run saves a checkpoint in epoch 1 (accumulation 2) and a new Trainer resumes from it; the scheduler
before and after our callback in ``callbacks`` (it checks the Trainer's value in its own ``on_train_start``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, digest_tensors

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
