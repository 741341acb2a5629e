"""A one-rank FSDP2 fit (``ReproModelParallelStrategy``, CPU, gloo) that checkpoints before its first optimizer step.

Used by ``tests/test_sharded_prestep.py`` in fresh processes::

    python tests/sharded_prestep.py LAYOUT CKPT            # fit 4 steps, saving CKPT in on_train_start
    python tests/sharded_prestep.py LAYOUT CKPT --resume   # resume CKPT, fit to 4 steps

``LAYOUT``: ``distributed`` (a checkpoint directory) or ``file``. Prints one JSON line: the digests of this rank's
parameters and optimizer state at the end (local shards, exact).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback
from lightning_repro.checkpoint.verify import digest_value
from lightning_repro.strategies.sharded import ReproModelParallelStrategy


class Net(pl.LightningModule):
    def __init__(self, save_to: str | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.save_to = save_to

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for module in self.net:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        if self.save_to:
            self.trainer.save_checkpoint(self.save_to)  # before the first optimizer step: AdamW has no state yet

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    layout, ckpt, resume = sys.argv[1], sys.argv[2], "--resume" in sys.argv
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    strategy = ReproModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=layout == "distributed"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        callbacks=[DeterminismCallback(seed=3)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=ckpt + ".root",
    )
    model = Net(None if resume else ckpt)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt if resume else None)
    optimizer = trainer.optimizers[0].state_dict()
    print(json.dumps({"params": digest_value(model.state_dict()), "optimizer": digest_value(optimizer["state"])}))


if __name__ == "__main__":
    main()
