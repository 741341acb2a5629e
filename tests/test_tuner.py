"""DeterminismCallback with Lightning's Tuner: ``lr_find`` and ``scale_batch_size``, as ``Tuner`` methods and callbacks.

Both save a checkpoint before their trials, run the trials (with ``trainer.callbacks`` replaced: no hook of ours runs)
and restore that checkpoint after them. That restore is not a resume: no "resumed from" line, no warning, and the
run trains as the fit without the Tuner does (its trials drew from the process streams: they are put back too).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, digest_tensors
from lightning_repro._warn import RESUME_LOGGER


class Tunable(pl.LightningModule):
    """Dropout and a draw in every step: a trial that is not undone moves the streams the real run draws from."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.lr = 0.05
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y) + torch.rand(()) * 1e-3

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def _fit(tmp_path: Path, tuner: str | None, batch_size: int = 2) -> tuple[str, DeterminismCallback, Tunable]:
    """A fit of 2 epochs, after (or with) the Tuner's trials; the digest of the trained weights."""
    callback = DeterminismCallback(seed=3)
    model = Tunable(batch_size)
    finder: list[Any] = []
    if tuner == "lr_find-callback":
        finder = [LearningRateFinder(num_training_steps=6, update_attr=False)]
    elif tuner == "scale_batch_size-callback":
        finder = [BatchSizeFinder(steps_per_trial=2, max_trials=2)]
    trainer = helpers.fast_trainer([callback, *finder], max_epochs=2, default_root_dir=tmp_path)
    if tuner == "lr_find-Tuner":
        Tuner(trainer).lr_find(model, num_training=6, update_attr=False)
    elif tuner == "scale_batch_size-Tuner":
        Tuner(trainer).scale_batch_size(model, steps_per_trial=2, max_trials=2)
    trainer.fit(model)
    return digest_tensors(dict(model.state_dict())), callback, model


@pytest.mark.parametrize(
    "tuner", ["lr_find-Tuner", "lr_find-callback", "scale_batch_size-Tuner", "scale_batch_size-callback"]
)
def test_the_tuner_s_restore_is_not_a_resume_and_its_trials_leave_no_trace(
    tmp_path: Path, tuner: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The Tuner restored its own checkpoint: our callback said "resumed from .lr_find_<uuid>.ckpt ... NOT exact:
    restore check failed" with a NotExactWarning (an error here), and after a ``Tuner`` method the next ``fit``
    took the Tuner's file for a checkpoint to resume. Now the run is the fit without the Tuner, bit for bit (at the
    batch size the finder chose), without a line or a warning."""
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER):
        digest, callback, model = _fit(tmp_path / "tuned", tuner)
    assert model.batch_size == (4 if tuner.startswith("scale_batch_size") else 2)  # the trials ran
    assert [r.getMessage() for r in caplog.records if r.name == RESUME_LOGGER] == []
    assert not callback.restored
    reference, _, _ = _fit(tmp_path / "plain", None, batch_size=model.batch_size)
    assert digest == reference
    assert not list((tmp_path / "tuned").glob("*.ckpt"))  # the Tuner deleted its file, as without us
