"""A map-style dataset given its epoch in ``on_train_epoch_start`` (a curriculum), resumed in the middle of an epoch.

A mid-epoch resume skips that hook, so the rest of the epoch was read with a fresh dataset's epoch 0 and the resume
said exact. In one process: the uninterrupted run saves a checkpoint in epoch 1 (or at its end), a new Trainer
resumes from it; the weights and every sample the module saw are compared.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER

BATCHES = 8  # 32 samples, batch 4


class Curriculum(Dataset):  # type: ignore[type-arg]
    """Its samples scale with the difficulty its ``set_epoch`` sets; each draws noise from the process streams."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4 * BATCHES, 4, generator=g), torch.randn(4 * BATCHES, 1, generator=g)
        self.difficulty = 0
        self.scale = 1.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] * (1 + self.difficulty) * self.scale + 0.1 * torch.randn(4), self.y[i]

    def set_epoch(self, epoch: int) -> None:
        self.difficulty = epoch


class Module(helpers.SmallRegressor):
    def __init__(self, workers: int, persistent: bool, scale_too: bool) -> None:
        super().__init__()
        self.data, self.workers, self.persistent, self.scale_too = Curriculum(), workers, persistent, scale_too
        self.seen: list[str] = []

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.data, batch_size=4, shuffle=True, num_workers=self.workers, persistent_workers=self.persistent
        )

    def on_train_epoch_start(self) -> None:
        self.data.set_epoch(self.current_epoch)
        if self.scale_too:  # set beside set_epoch: nothing gives it back
            self.data.scale = 1.0 + self.current_epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(digest_tensors({"x": batch[0]}))
        return super().training_step(batch, batch_idx)


def _fit(ckpt: Path, *, resume: bool, at: tuple[int, int], **module: Any) -> tuple[str, list[str]]:
    model = Module(**module)
    callbacks: list[Callback] = [DeterminismCallback(seed=3)]
    if not resume:
        callbacks.append(helpers.SaveAt(ckpt, at))
    trainer = helpers.fast_trainer(callbacks, max_epochs=3, default_root_dir=ckpt.parent)
    trainer.fit(model, ckpt_path=ckpt if resume else None)
    return digest_tensors(dict(model.state_dict())), model.seen


def _resumed(ckpt: Path, caplog: pytest.LogCaptureFixture, **kwargs: Any) -> tuple[Any, list[str], str]:
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fit(ckpt, resume=True, **kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    [line] = [r.getMessage() for r in caplog.records if r.name == RESUME_LOGGER and "resumed from" in r.getMessage()]
    return result, messages, line


@pytest.mark.parametrize(
    ("workers", "persistent", "at"),
    [(0, False, (1, 3)), (2, False, (1, 3)), (2, True, (1, 3)), (0, False, (1, BATCHES - 1))],
    ids=["mid-epoch", "mid-epoch-workers", "mid-epoch-persistent-workers", "epoch-end"],
)
def test_a_dataset_given_its_epoch_by_a_hook_resumes_bitwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int, persistent: bool, at: tuple[int, int]
) -> None:
    options = {"workers": workers, "persistent": persistent, "scale_too": False, "at": at}
    digest, seen = _fit(tmp_path / "ckpt.ckpt", resume=False, **options)
    entry = torch.load(tmp_path / "ckpt.ckpt", weights_only=True)["callbacks"]["DeterminismCallback"]
    [position] = entry["ranks"][0]["data"]
    # persistent workers read the copy they started with (difficulty 0 in every epoch): nothing to record
    assert position.get("dataset_state") == (None if persistent else {"difficulty": 1, "scale": 1.0})
    (resumed_digest, resumed_seen), messages, line = _resumed(tmp_path / "ckpt.ckpt", caplog, **options)
    assert messages == []
    assert "NOT exact" not in line
    assert resumed_seen == seen[-len(resumed_seen) :]
    assert resumed_digest == digest
    given = [r.getMessage() for r in caplog.records if "gave train dataset 0" in r.getMessage()]
    assert len(given) == (at == (1, 3) and not persistent)


def test_attributes_set_epoch_does_not_give_back_are_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = {"workers": 0, "persistent": False, "scale_too": True, "at": (1, 3)}
    _fit(tmp_path / "ckpt.ckpt", resume=False, **options)
    _, messages, line = _resumed(tmp_path / "ckpt.ckpt", caplog, **options)
    [message] = messages
    assert "scale: 1.0 now, 2.0 then" in message
    assert "set_epoch(1) does not give them back" in message
    assert ": NOT exact: " in line
