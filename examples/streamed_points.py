"""The ordinary project's data streamed with litdata, as a project that outgrew map-style data writes it.

``prepare_data`` writes the points once into litdata's chunked format (``litdata.optimize``); training reads them
through a shuffled ``StreamingDataset`` and a ``StreamingDataLoader`` with workers, augmenting each item in its
``transform`` from torch, numpy and python ``random`` (as ``ordinary_project.Points`` does); validation and prediction
read their sets in order. Run the project on it with ``--run '{"stream": "DIR", ...}'``: DIR holds the chunks
(written by the first run, read by the others). Needs ``pip install litdata``.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

CHUNK = 24  # items a chunk: litdata deals whole chunks to workers (192 items, 2 workers: 4 chunks each)


def _points(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].sum(dim=1) > 0).long()


def _item(i: int, n: int, seed: int) -> dict[str, Any]:
    x, y = _points(n, seed)
    return {"x": x[i], "y": y[i], "i": i}


def augment(item: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """litdata's ``transform`` of a training item: the draws of ``ordinary_project.Points``."""
    x = item["x"] + 0.2 * torch.randn(16)  # torch: jitter
    x = x * float(np.random.uniform(0.8, 1.2))  # numpy: scale
    if random.random() < 0.5:  # python: flip the last features
        x = torch.cat([x[:8], x[8:].flip(0)])
    return x, item["y"]


def as_pair(item: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return item["x"], item["y"]


class StreamedPointsData(pl.LightningDataModule):
    """``ordinary_project.PointsData``'s sets in litdata chunks under ``root``, read by ``StreamingDataLoader``."""

    def __init__(self, root: str, samples: int, batch_size: int, num_workers: int, val_loaders: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.sets = {"train": (samples, 0), **{f"val{i}": (64, 100 + i) for i in range(val_loaders)}}

    def prepare_data(self) -> None:  # once, on one process per node
        import litdata

        for name, (n, seed) in self.sets.items():
            out = Path(self.hparams.root, name)
            if not (out / "index.json").exists():
                litdata.optimize(
                    fn=functools.partial(_item, n=n, seed=seed),
                    inputs=list(range(n)),
                    output_dir=str(out),
                    chunk_size=CHUNK,
                    num_workers=1,
                    mode="overwrite",
                )

    def _loader(self, name: str, **kw: Any) -> Any:
        import litdata

        shuffle = name == "train"
        dataset = litdata.StreamingDataset(
            str(Path(self.hparams.root, name)), shuffle=shuffle, transform=augment if shuffle else as_pair
        )
        return litdata.StreamingDataLoader(dataset, **kw)

    def train_dataloader(self) -> Any:
        workers = self.hparams.num_workers
        return self._loader(
            "train", batch_size=self.hparams.batch_size, num_workers=workers, persistent_workers=workers > 0
        )

    def val_dataloader(self) -> Any:
        loaders = [self._loader(f"val{i}", batch_size=32) for i in range(self.hparams.val_loaders)]
        return loaders[0] if len(loaders) == 1 else loaders

    def predict_dataloader(self) -> Any:
        return self._loader("val0", batch_size=32)
