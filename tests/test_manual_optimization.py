"""Manual optimization resumed between batches: the gradients the user's code carries into the next batch.

Under ``automatic_optimization = False`` Lightning leaves the gradients to the user: a GAN-like module with two
optimizers steps its discriminator every second batch, and its generator's backward also leaves gradients on the
discriminator, which the next batch's discriminator step adds to. A checkpoint after batch 1 of epoch 1 holds those
(our entry's ``grads``); without them the resumed run stepped the discriminator with half its gradient and said
exact. In one process: the uninterrupted run saves the checkpoint (and a ``ModelCheckpoint`` every 5 steps), a new
Trainer resumes from it; every file written after it and every logged value is compared.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import numpy as np
import pytest
import runner
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback, digest_tensors

SAVE_AT = (1, 1)  # epoch 1, after batch 1: the discriminator stepped, the generator's backward left it gradients


class Points(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i)) + 0.1 * torch.randn(4) + float(np.random.rand()) + random.random()


class TwoOptimizers(pl.LightningModule):
    def __init__(self, zero_to_none: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_to_none = zero_to_none
        self.g = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.3), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake = self.g(torch.randn(batch.shape[0], 2))
        loss_d = nn.functional.softplus(self.d(fake.detach())).mean() + nn.functional.softplus(-self.d(batch)).mean()
        self.manual_backward(loss_d / 2)
        if batch_idx % 2 == 1:
            opt_d.step()
            opt_d.zero_grad(set_to_none=self.zero_to_none)
        loss_g = nn.functional.softplus(-self.d(self.g(torch.randn(batch.shape[0], 2)))).mean()
        opt_g.zero_grad(set_to_none=self.zero_to_none)
        self.manual_backward(loss_g)  # also into the discriminator's gradients, which its next step adds to
        opt_g.step()
        self.log_dict({"loss_d": loss_d, "loss_g": loss_g}, on_step=True, on_epoch=True)
        if self.trainer.is_last_batch:
            for scheduler in self.lr_schedulers():  # type: ignore[union-attr]
                scheduler.step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.g.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(self.d.parameters(), lr=1e-2, momentum=0.9)
        schedulers = [torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5), torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.7)]
        return [opt_g, opt_d], schedulers


class SaveAt(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) == SAVE_AT:
            trainer.save_checkpoint(self.path)


class Logged(Callback):
    """Every value logged at every batch end, and what the epoch ends logged."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, str]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append((trainer.global_step, {k: v.item().hex() for k, v in trainer.logged_metrics.items()}))

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.on_train_batch_end(trainer)


def _fit(out: Path, zero_to_none: bool, *, resume: Path | None, workers: int) -> tuple[int, str, list[Any]]:
    logged = Logged()
    files = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{epoch}-{step}")
    callbacks: list[Callback] = [DeterminismCallback(seed=3), files, logged]
    if resume is None:
        callbacks.append(SaveAt(out / "mid-epoch-1.ckpt"))
    model = TwoOptimizers(zero_to_none)
    trainer = helpers.fast_trainer(callbacks, max_epochs=3, enable_checkpointing=True, default_root_dir=out)
    loader = DataLoader(Points(), batch_size=8, shuffle=True, num_workers=workers)
    trainer.fit(model, loader, ckpt_path=resume)
    states = [s for opt in trainer.optimizers for s in opt.state_dict()["state"].values()]
    return trainer.global_step, digest_tensors({"model": dict(model.state_dict()), "optimizers": states}), logged.rows


# Lightning 2.6's own advice on every manual-optimization save of ModelCheckpoint(every_n_train_steps): plain too
@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization:UserWarning")
@pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning")  # each run's files in a folder of its own
@pytest.mark.parametrize(("zero_to_none", "workers"), [(True, 0), (False, 0), (True, 2)])
def test_manual_optimization_resumes_with_the_carried_gradients(
    tmp_path: Path, zero_to_none: bool, workers: int
) -> None:
    steps, digest, rows = _fit(tmp_path / "run", zero_to_none, resume=None, workers=workers)
    assert steps == 36  # 8 batches an epoch: the generator steps at every one, the discriminator at every second
    checkpoint = tmp_path / "run" / "mid-epoch-1.ckpt"
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    # every parameter holds a gradient there (the generator's are zeroed only before its next backward)
    assert sorted(entry["ranks"][0]["grads"]) == sorted(
        f"{n}.{i}.{p}" for n in "dg" for i in (0, 2) for p in ("weight", "bias")
    )
    resumed = _fit(tmp_path / "resumed", zero_to_none, resume=checkpoint, workers=workers)
    assert resumed[:2] == (steps, digest)
    assert resumed[2] == rows[-len(resumed[2]) :]
    written = sorted(p.name for p in (tmp_path / "resumed" / "ckpt").glob("*.ckpt"))
    # step 15's file too: the ModelCheckpoint ran after SaveAt in the checkpoint's on_train_batch_end (Lightning
    # puts checkpoint callbacks last), and the resume runs the rest of that hook
    assert written == ["epoch=1-step=15.ckpt", "epoch=2-step=25.ckpt", "epoch=2-step=30.ckpt"]
    problems = runner.compare_checkpoint_files(tmp_path / "run", tmp_path / "resumed", names=written)
    assert not problems, "\n".join(problems)
