"""Workloads the benchmarks share: datasets that augment from every process stream, small models, a step timer.

Every dataset here draws from torch, numpy and python ``random`` inside ``__getitem__``, as real augmentation does,
so that sample-keyed seeding has something to do.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import Dataset


class CheapDataset(Dataset):  # type: ignore[type-arg]
    """A cheap ``__getitem__`` that draws once from each of torch, numpy and python ``random``."""

    def __init__(self, n: int, dim: int = 16) -> None:
        self.n = n
        self.dim = dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.rand(self.dim) * float(np.random.rand()) + random.random(), i


class AugmentedDataset(Dataset):  # type: ignore[type-arg]
    """Fixed features plus augmentation drawn from torch, numpy and python ``random``."""

    def __init__(self, n: int, dim: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(self.x.shape[1])
        scale = 1.0 + 0.1 * float(np.random.rand())
        sign = -1.0 if random.random() < 0.5 else 1.0
        return x * (scale * sign), self.y[i]


class MLP(pl.LightningModule):
    def __init__(self, dim: int, width: int = 256, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = dim
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU(), nn.Dropout(0.1)]
            size = width
        layers.append(nn.Linear(size, classes))
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class ImageDataset(Dataset):  # type: ignore[type-arg]
    """3x32x32 images made from the index, with the usual augmentation: crop, flip, jitter, noise."""

    def __init__(self, n: int, classes: int) -> None:
        self.n = n
        self.classes = classes
        g = torch.Generator().manual_seed(0)
        self.bank = torch.randn(64, 3, 40, 40, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.bank[i % 64]
        top, left = (int(v) for v in torch.randint(0, 9, (2,)))  # random crop 32x32 of a padded 40x40
        image = image[:, top : top + 32, left : left + 32]
        if random.random() < 0.5:
            image = image.flip(2)
        image = image * (0.8 + 0.4 * float(np.random.rand())) + 0.05 * torch.randn_like(image)
        return image, i % self.classes


class SmallCNN(pl.LightningModule):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(128, classes),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(Callback):
    """Timestamps every ``on_train_batch_start``; a step is the interval between two of them."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self, skip: int) -> list[float]:
        return [b - a for a, b in zip(self.starts[skip:-1], self.starts[skip + 1 :], strict=True)]



def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    # Lightning's hints that do not change the measurement: the num_workers=0 bottleneck, litlogger,
    # a deprecated pytree API it calls; and ours about PYTHONHASHSEED (hashing is not timed here)
    warnings.filterwarnings("ignore", message=r".*(num_workers|litlogger|LeafSpec|PYTHONHASHSEED).*")


class ConstantDataset(Dataset):  # type: ignore[type-arg]
    """Returns the same tensors for every index and draws from no stream: what the loading machinery alone costs."""

    def __init__(self, n: int, dim: int = 16) -> None:
        self.n = n
        self.x = torch.ones(dim)
        self.y = torch.tensor(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def bare_trainer(callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without logger, progress bar, model summary or checkpoints: only the training is timed."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        **kwargs,
    }
    return pl.Trainer(callbacks=callbacks, **options)


def compared_trainer(setup: str, seed: int, **kwargs: Any) -> pl.Trainer:
    """A :func:`bare_trainer` of one side of a comparison: ``"plain"`` (``seed_everything(seed, workers=True)`` and
    ``deterministic=True``) or ``"ours"`` (``DeterminismCallback(seed)``)."""
    from lightning_repro import DeterminismCallback

    if setup == "plain":
        pl.seed_everything(seed, workers=True, verbose=False)
        return bare_trainer([], deterministic=True, **kwargs)
    return bare_trainer([DeterminismCallback(seed)], **kwargs)


def shard_linears(net: Any, mesh: Any, mp_policy: Any = None) -> None:
    """FSDP2 as the sharded benchmarks apply it in ``configure_model``: ``fully_shard`` on each ``Linear`` of ``net``
    (an ``nn.Sequential``) and on the whole net, over ``mesh`` (with FSDP2's ``MixedPrecisionPolicy`` ``mp_policy``
    where given); nothing when ``net`` is already sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(net, FSDPModule):
        return
    extra = {} if mp_policy is None else {"mp_policy": mp_policy}
    for module in net:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, **extra)
    fully_shard(net, mesh=mesh, **extra)
