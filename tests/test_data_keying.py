"""Sample-keyed streams beyond the global ones: a collate_fn without auto-collation, and datasets' own generators."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_repro import capture_process_streams
from lightning_repro.dataloaders import StreamKey, prepare_dataloader
from lightning_repro.rng import digest_process_streams


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def _prepare(loader: DataLoader[Any], counter: Counter | None = None) -> DataLoader[Any]:
    return prepare_dataloader(loader, seed=7, rank=0, stream=StreamKey("train", 0), counter=counter or Counter())


class Plain(Dataset):  # type: ignore[type-arg]
    """Draws from the global streams, like most datasets."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(())), float(np.random.rand()), random.random()])


def random_collate(sample: torch.Tensor) -> torch.Tensor:
    """A collate_fn that augments: draws from torch, numpy and python."""
    noise = torch.tensor([0.0, float(torch.rand(())), float(np.random.rand()), random.random()])
    return sample + noise


def identity_collate(sample: torch.Tensor) -> torch.Tensor:
    return sample


def _rows(loader: DataLoader[Any]) -> list[tuple[float, ...]]:
    return [tuple(float(v) for v in t) for t in loader]


# ------------------------------------------------------------------ item 4: batch_size=None with a random collate_fn
def test_random_collate_without_auto_collation_does_not_depend_on_workers() -> None:
    in_main = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate)))
    in_workers = _rows(
        _prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate, num_workers=2))
    )
    assert in_workers == in_main
    assert len({row[1] for row in in_main}) == len(in_main)  # every sample's collate drew its own numbers


def test_random_collate_without_auto_collation_does_not_move_the_process_streams() -> None:
    loader = _prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate))
    before = digest_process_streams(capture_process_streams())
    rows = _rows(loader)
    assert len(rows) == 24
    assert digest_process_streams(capture_process_streams()) == before


def test_collate_that_draws_nothing_keeps_the_samples() -> None:
    default = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True)))
    custom = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=identity_collate)))
    assert custom == default
