"""What docs/resume.md says of ``SpikeDetection``: Lightning 2.5 and 2.6 cannot resume a run with it, ours or not.

Its ``load_state_dict`` reads ``self.running``, which it never sets. When a Lightning release fixes it, this test
fails: then test the resume and change the docs row.
"""

from __future__ import annotations

from pathlib import Path

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks.spike import SpikeDetection
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback


@pytest.mark.parametrize("ours", [False, True], ids=["plain", "ours"])
def test_a_run_with_spike_detection_cannot_resume(tmp_path: Path, ours: bool) -> None:
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=8)

    def callbacks() -> list[pl.Callback]:
        spikes = SpikeDetection(rtol=100.0, exclude_batches_path=str(tmp_path))
        return [*([DeterminismCallback(seed=1)] if ours else []), spikes]

    ckpt = tmp_path / "mid.ckpt"
    saving = [*callbacks(), helpers.SaveAt(ckpt, (0, 1))]
    trainer = helpers.fast_trainer(saving, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(helpers.SmallRegressor(), loader)
    resumed = helpers.fast_trainer(callbacks(), max_epochs=1, default_root_dir=tmp_path)
    with pytest.raises(AttributeError, match="'SpikeDetection' object has no attribute 'running'"):
        resumed.fit(helpers.SmallRegressor(), loader, ckpt_path=ckpt)
