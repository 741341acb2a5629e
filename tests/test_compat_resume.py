"""Resume cases of ordinary projects, in process: unsized iterables, checkpoints plain Lightning can still resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_repro import DeterminismCallback, digest_tensors


class Counting(pl.LightningModule):
    """Records (epoch, batch_idx) of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch_idx))
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y) + torch.rand(()) * 1e-3

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    # checkpointing on unless a test turns it off: some tests pass their own ModelCheckpoint
    return helpers.fast_trainer(callbacks, limit_val_batches=0, **{"enable_checkpointing": True, **kwargs})


class Unsized(IterableDataset):  # type: ignore[type-arg]
    """A stream of 16 fixed samples with no ``__len__``: Lightning counts its epoch as infinitely long."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(16):
            yield torch.randn(4, generator=g), torch.randn(1, generator=g)


def _unsized_fit(max_epochs: int, ckpt: Path | None = None, save: Path | None = None) -> Counting:
    callback = DeterminismCallback(seed=3)  # first: it pins the model's initialisation too
    model = Counting()
    trainer = _trainer([callback], max_epochs=max_epochs, enable_checkpointing=False)
    trainer.fit(model, DataLoader(Unsized(), batch_size=4), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return model


# the stream is re-read from its start every epoch; a mid-epoch resume of it is not exact (and we say so)
@pytest.mark.filterwarnings("ignore:Unsized is an IterableDataset without:lightning_repro.NotExactWarning")
def test_finished_epochs_of_an_unsized_stream_are_not_trained_again(tmp_path: Path) -> None:
    """Every epoch of an unsized loader ended normally, not "cut short": resuming after fit adds only new epochs."""
    uninterrupted = _unsized_fit(3)
    path = tmp_path / "end.ckpt"
    _unsized_fit(2, save=path)
    entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["truncated"] is False
    resumed = _unsized_fit(3, ckpt=path)
    assert resumed.seen == [(2, i) for i in range(4)]  # one epoch, not a finished one again
    assert digest_tensors(dict(resumed.named_parameters())) == digest_tensors(dict(uninterrupted.named_parameters()))


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


# the resuming script has no ModelCheckpoint: Lightning's reminder about it is expected here
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_last_batch_checkpoint_stays_a_valid_lightning_checkpoint(tmp_path: Path) -> None:
    """Written on an epoch's last batch with the plugin, resumed by a script without it: Lightning's own behaviour."""
    # the reference: the same checkpoint written by plain Lightning, resumed by plain Lightning
    counts = {}
    for name, callbacks in (("plain", []), ("repro", [DeterminismCallback(seed=5)])):
        checkpoint = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=4, save_top_k=-1)
        trainer = _trainer([*callbacks, checkpoint], max_epochs=2, default_root_dir=tmp_path)
        trainer.fit(Counting(), _data())
        path = tmp_path / name / "epoch=0-step=4.ckpt"
        loops = torch.load(path, weights_only=True)["loops"]
        model = Counting()
        resumed = _trainer([], max_epochs=2, enable_checkpointing=False)
        resumed.fit(model, _data(), ckpt_path=path)
        counts[name] = (loops, model.seen, resumed.global_step)
    assert counts["repro"][0] == counts["plain"][0]  # Lightning's sections as Lightning wrote them
    assert counts["repro"][1:] == counts["plain"][1:]
    assert counts["repro"][2] == 8  # 2 epochs of 4 batches: no extra batch


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # no ModelCheckpoint when resuming
def test_last_batch_checkpoint_resumed_with_the_plugin_runs_the_epoch_end(tmp_path: Path) -> None:
    """The same checkpoint resumed with the plugin continues like the uninterrupted run (epoch-end hooks included)."""
    callback = DeterminismCallback(seed=5)
    uninterrupted = Counting()
    _trainer([callback], max_epochs=2, enable_checkpointing=False).fit(uninterrupted, _data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    callback = DeterminismCallback(seed=5)
    _trainer([callback, checkpoint], max_epochs=1, default_root_dir=tmp_path).fit(Counting(), _data())
    callback = DeterminismCallback(seed=5)
    model = Counting()
    trainer = _trainer([callback], max_epochs=2, enable_checkpointing=False)
    trainer.fit(model, _data(), ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert trainer.global_step == 8
    assert model.seen == [(1, i) for i in range(4)]
    assert digest_tensors(dict(model.named_parameters())) == digest_tensors(dict(uninterrupted.named_parameters()))
