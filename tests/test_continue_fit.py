"""A fit continued on the same Trainer (``fit_loop.max_epochs`` raised, ``fit`` called again) is one longer fit.

Users train for a while, look, and go on with the same Trainer and module. With the callback, two epochs and then two
more are bitwise the same run as four epochs at once (weights, the last logged values), with 0 and 2 workers, and
the second ``fit`` says nothing about a resume (it restores nothing: no checkpoint is read). Plain Lightning gives
another run for the second half (its workers and samplers are re-seeded from the global stream, which the first fit
moved), so the equality below is ours. Each ``fit`` calls ``configure_optimizers`` again (a fresh optimizer and
scheduler, in plain Lightning too), so the module here steps a stateless SGD.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import fast_trainer
from scenario import digest
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback


class _Noisy(Dataset):  # type: ignore[type-arg]
    """Samples drawn from the torch stream (an augmentation)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((6,), i / 48) + 0.1 * torch.randn(6), torch.tensor([float(i % 3)])


class _Net(pl.LightningModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Dropout(0.3), torch.nn.Linear(12, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # stateless: each `fit` calls configure_optimizers again (a new optimizer and scheduler, in plain Lightning too)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(_Noisy(), batch_size=8, shuffle=True, num_workers=self.workers)


def _run(first: int, workers: int, caplog: pytest.LogCaptureFixture) -> tuple[str, ...]:
    torch.manual_seed(11)  # the module's initialisation, the same for both runs
    module = _Net(workers)
    trainer = fast_trainer([DeterminismCallback(seed=5)], max_epochs=first)
    trainer.fit(module)
    if first < 4:
        trainer.fit_loop.max_epochs = 4
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer.fit(module)
        assert not [r.getMessage() for r in caplog.records if "resum" in r.getMessage().lower()]
    metrics = {k: v.detach().clone() for k, v in sorted(trainer.callback_metrics.items())}
    return (
        digest(dict(module.state_dict())),
        digest(metrics),
        str(trainer.global_step),
        str(trainer.current_epoch),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_then_two_more_are_four_epochs(workers: int, caplog: pytest.LogCaptureFixture) -> None:
    whole = _run(4, workers, caplog)
    assert whole[2] == "24"  # 6 batches an epoch: the run did train for four epochs
    assert _run(2, workers, caplog) == whole
