"""The restore check's message names what the run shows changed the checkpoint: ``ModelPruning``, a user's hook.

``ModelPruning`` (``make_pruning_permanent=True``, its default) writes the pruned weights without their masks into
each checkpoint (its ``on_save_checkpoint``); our entry records the masks and a resume prunes again
(``tests/test_pruning_resume.py``, where an entry without that record is resumed: the message names ModelPruning).
A user's hook that rewrites the file's state is named here; before, the message only said "the checkpoint was
changed after it was written, or something (a hook, ...)".
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
from lightning.pytorch.callbacks import Callback, ModelPruning
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER


class HalvesTheSavedWeights(Callback):
    """A user's hook that changes what the file holds (as a pruning or quantizing callback does)."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v / 2 for k, v in checkpoint["state_dict"].items()}


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True)


def _fit(tmp_path: Path, make: Any, at: tuple[int, int] | None, caplog: pytest.LogCaptureFixture) -> tuple:
    ckpt = tmp_path / "ckpt.ckpt"
    callbacks: list[Callback] = [DeterminismCallback(seed=3), make()]
    if at is not None:
        callbacks.append(helpers.SaveAt(ckpt, at))
    model = helpers.SmallRegressor()
    trainer = helpers.fast_trainer(callbacks, max_epochs=3, default_root_dir=tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(), ckpt_path=None if at is not None else ckpt)
    said = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    lines = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    return digest_tensors(dict(model.state_dict())), said, "".join(lines)


def _pruning() -> Callback:
    return ModelPruning("random_unstructured", amount=0.3, verbose=0)


def test_a_resume_before_modelprunings_first_pruning_is_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    uninterrupted, _, _ = _fit(tmp_path, _pruning, (0, 3), caplog)
    resumed, said, line = _fit(tmp_path, _pruning, None, caplog)
    assert said == []
    assert ": exact" in line
    assert resumed == uninterrupted


def test_a_user_hook_that_rewrites_the_state_dict_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    uninterrupted, _, _ = _fit(tmp_path, HalvesTheSavedWeights, (1, 3), caplog)
    resumed, said, line = _fit(tmp_path, HalvesTheSavedWeights, None, caplog)
    assert resumed != uninterrupted
    [message] = [m for m in said if "parameters" in m]
    assert "(here: `on_save_checkpoint` of HalvesTheSavedWeights, if it changes the checkpoint's state)" in message
    assert ": NOT exact: " in line
