"""DeterminismCallback with Lightning's Tuner: ``lr_find`` and ``scale_batch_size``, as ``Tuner`` methods and callbacks.

Both save a checkpoint before their trials, run the trials (with ``trainer.callbacks`` replaced: no hook of ours runs)
and restore that checkpoint after them. That restore is not a resume: no "resumed from" line, no warning, and the
run trains as the fit without the Tuner does (its trials drew from the process streams: they are put back too;
Lightning's ``LearningRateFinder.lr_find`` runs its trial inside ``isolate_rng`` already, the batch-size finder does
not).
"""

from __future__ import annotations

import logging
import os
from functools import partial
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


LR_TRIAL_STEPS = 6


class Untrained(Tunable):
    """The first ``untrained`` batches of epoch 0 are read but not trained: no draw, and a loss that reaches no
    parameter, so SGD leaves them as they are (``None`` would do the same, with a warning of Lightning's)."""

    def __init__(self, batch_size: int = 2, untrained: int = 0) -> None:
        super().__init__(batch_size)
        self.untrained = untrained

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 0 and batch_idx < self.untrained:
            return torch.zeros((), requires_grad=True)
        return super().training_step(batch, batch_idx)


def _fit(
    tmp_path: Path, tuner: str | None, batch_size: int = 2, untrained: int = 0, ours: bool = True
) -> tuple[str, DeterminismCallback | None, Tunable, pl.Trainer]:
    """A fit of 2 epochs, after (or with) the Tuner's trials; the digest of the trained weights."""
    callback = DeterminismCallback(seed=3) if ours else None
    model = Untrained(batch_size, untrained) if untrained else Tunable(batch_size)
    callbacks: list[Any] = [callback] if callback is not None else []
    if tuner == "lr_find-callback":
        callbacks.append(LearningRateFinder(num_training_steps=LR_TRIAL_STEPS, update_attr=False))
    elif tuner == "scale_batch_size-callback":
        callbacks.append(BatchSizeFinder(steps_per_trial=2, max_trials=2))
    trainer = helpers.fast_trainer(callbacks, max_epochs=2, default_root_dir=tmp_path)
    if tuner == "lr_find-Tuner":
        Tuner(trainer).lr_find(model, num_training=LR_TRIAL_STEPS, update_attr=False)
    elif tuner == "scale_batch_size-Tuner":
        Tuner(trainer).scale_batch_size(model, steps_per_trial=2, max_trials=2)
    trainer.fit(model)
    return digest_tensors(dict(model.state_dict())), callback, model, trainer


@pytest.mark.parametrize(
    "tuner", ["lr_find-Tuner", "lr_find-callback", "scale_batch_size-Tuner", "scale_batch_size-callback"]
)
def test_the_tuner_s_restore_is_not_a_resume_and_its_trials_leave_no_trace(
    tmp_path: Path, tuner: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The Tuner restored its own checkpoint: our callback said "resumed from .lr_find_<uuid>.ckpt ... NOT exact:
    restore check failed" with a NotExactWarning (an error here), and after a ``Tuner`` method the next ``fit``
    took the Tuner's file for a checkpoint to resume. Now the run is the fit without the Tuner, bit for bit (at the
    batch size the finder chose, over the batches Lightning trains after it), without a line or a warning."""
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER):
        digest, callback, model, trainer = _fit(tmp_path / "tuned", tuner)
    assert callback is not None
    assert [r.getMessage() for r in caplog.records if r.name == RESUME_LOGGER] == []
    assert not callback.restored
    # What the finder does is Lightning's: read from plain Lightning, without our callback. Lightning 2.5.0 differs
    # from 2.6 twice, plain or with us (upstream PRs #21187 and #21056):
    # - 2.5.0's `_run_power_scaling` (tuner/batch_size_scaling.py) doubles the size after the last trial without
    #   trying it (`for _ in range(max_trials)` ... `_adjust_batch_size(factor=2.0)`): the trials of 2 and 4 settle
    #   on 8; 2.6 keeps the last size tried, 4;
    # - 2.5.0's `_lr_find` (tuner/lr_finder.py) restores its file but keeps `fit_loop._combined_loader` and the
    #   iterator its trial read from (`FitLoop.setup_data` returns early, `_TrainingEpochLoop.on_run_start` calls
    #   `iter()` only for epochs > 0): the fit after the LearningRateFinder callback trains the rest of epoch 0, the
    #   trial's 6 batches left out; 2.6's `_lr_find` sets `fit_loop._combined_loader = None`, calls `setup_data()`.
    #   The `Tuner` methods are not affected: the next `fit` drops the loaders (`attach_dataloaders`).
    pl.seed_everything(3, verbose=False)  # Lightning's own trials draw (dropout): the same ones in every run
    _, _, plain_model, plain_trainer = _fit(tmp_path / "lightning", tuner, ours=False)
    assert model.batch_size == plain_model.batch_size
    assert model.batch_size > 2 if tuner.startswith("scale_batch_size") else model.batch_size == 2  # the trials ran
    steps = 2 * 32 // model.batch_size
    left_out = steps - trainer.global_step  # the batches of epoch 0 the fit after the trials does not train
    assert (left_out > 0) == (plain_trainer.global_step < steps)  # as in plain Lightning, whose trial may stop early
    assert left_out == (LR_TRIAL_STEPS if tuner == "lr_find-callback" and left_out else 0)  # the trial's batches
    reference, _, _, _ = _fit(tmp_path / "plain", None, batch_size=model.batch_size, untrained=left_out)
    assert digest == reference
    assert not list((tmp_path / "tuned").glob("*.ckpt"))  # the Tuner deleted its file, as without us


class TwoOptimizers(Tunable):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=self.lr), torch.optim.SGD(self.parameters(), lr=self.lr)]


class FailsInTrial(Tunable):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise ValueError("a failing training step")


# Lightning's: its restore after a failed trial runs with the trial's callbacks, so any stateful callback in the
# checkpoint (ModelCheckpoint's too) is "missing" from the Trainer
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")
@pytest.mark.parametrize(
    ("tuner", "model", "error"),
    [
        ("lr_find", TwoOptimizers, "only works with single optimizer"),  # raised before the trial runs
        ("lr_find", FailsInTrial, "a failing training step"),  # raised in the trial
        ("scale_batch_size", FailsInTrial, "a failing training step"),  # the control: puts them back in a `finally`
    ],
)
def test_a_failed_tuner_run_leaves_the_environment_and_the_trainer_as_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tuner: str, model: type[Tunable], error: str
) -> None:
    """A Tuner that fails leaves ``trainer.callbacks`` replaced by its trial's (Lightning puts them back only on
    success), so Lightning calls neither our ``on_exception`` nor our ``teardown``: ``PYTHONHASHSEED`` stayed set
    in ``os.environ`` and our patches on the strategy and the loops stayed installed. Now they are undone."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    callback = DeterminismCallback(seed=3)
    before = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}  # torch needs that one
    trainer = helpers.fast_trainer([callback], max_epochs=1, default_root_dir=tmp_path)
    if tuner == "lr_find":
        tune = partial(Tuner(trainer).lr_find, model(), num_training=4)
    else:
        tune = partial(Tuner(trainer).scale_batch_size, model(), steps_per_trial=1, max_trials=1)
    with pytest.raises(Exception, match=error):
        tune()
    assert {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"} == before
    patched = [
        name for name in ("process_dataloader", "load_checkpoint", "on_exception") if name in vars(trainer.strategy)
    ]
    assert patched == []
    assert "setup_data" not in vars(trainer.fit_loop)
