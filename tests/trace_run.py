"""A small traced training run for the fresh-process tests of the step trace (``tests/test_trace.py``).

Usage: ``python tests/trace_run.py CONFIG_JSON``. The run traces with ``DeterminismCallback(trace=True)`` beside
its checkpoints (``<out>/ckpt``), can be killed hard after some batches (SIGKILL), resumed from a checkpoint, and
fed a fault: noise from ``os.urandom`` added to the loss from a given step on. It writes ``<out>/result.json``
(``{"continuation": ...}``) when it ends normally.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenario import Killer

DEFAULTS: dict[str, Any] = {
    "out": "",
    "seed": 11,
    "max_steps": 8,
    "ckpt_every": 3,
    "kill_after": 0,  # SIGKILL itself after this many train batches (0: never; runner.KILLED)
    "resume": "",
    "noise_from": 0,  # add os.urandom noise to the loss from this global step on (1-based; 0: never)
    "on_divergence": "warn",
    "num_workers": 0,
}


class Augmented(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), i / 24) + 0.1 * torch.randn(4), torch.tensor([float(i % 3)])


class Model(pl.LightningModule):
    def __init__(self, noise_from: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        self.noise_from = noise_from

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.noise_from and self.global_step + 1 >= self.noise_from:
            # noise outside every seeded stream, and never lost to rounding: a relative change of 1..65536 units of
            # 2**-20 (>= 8 float32 ulps), so the step's loss always differs from a clean run's
            loss = loss * (1.0 + (1 + int.from_bytes(os.urandom(2), "little")) * 2.0**-20)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(cfg: dict[str, Any]) -> None:
    cfg = {**DEFAULTS, **cfg}
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_repro").setLevel(logging.INFO)
    out = Path(cfg["out"])
    from lightning_repro import DeterminismCallback

    repro = DeterminismCallback(cfg["seed"], trace=True, on_divergence=cfg["on_divergence"])
    callbacks: list[Callback] = [repro, ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=cfg["ckpt_every"])]
    if cfg["kill_after"]:
        callbacks.append(Killer(cfg["kill_after"]))
    callbacks[1].save_top_k = -1  # type: ignore[attr-defined]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=cfg["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
    )
    loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=cfg["num_workers"])
    trainer.fit(Model(cfg["noise_from"]), loader, ckpt_path=cfg["resume"] or None)
    assert repro.tracer is not None
    (out / "result.json").write_text(json.dumps({"continuation": repro.tracer.continuation}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
