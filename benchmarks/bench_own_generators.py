"""What keying a dataset's own generator costs per sample, side by side in one run.

A cheap dataset whose ``__getitem__`` draws once from torch's global stream and once from a
generator it holds (``self.rng``) is iterated in full passes (``num_workers=0``, ``batch_size=32``,
``shuffle=True``) through a loader taken over by ``prepare_dataloader``, twice per kind of
generator: with the generator keyed per sample (what ``DeterminismCallback`` does), and with the
keying switched off (``loader.dataset._own = []``), which is what a dataset holding no generator
pays. The difference per sample is the cost of keying one generator of that kind (re-seeding it
before each sample, plus saving and restoring its state once per batch in the main process).
Passes alternate and medians are compared.

Run::

    python benchmarks/bench_own_generators.py           # about 30 s on 2 CPU cores
    python benchmarks/bench_own_generators.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_repro.data.takeover import StreamKey, prepare_dataloader

KINDS: dict[str, Callable[[], Any]] = {
    "random.Random": lambda: random.Random(0),
    "numpy RandomState": lambda: np.random.RandomState(0),
    "numpy Generator (PCG64)": lambda: np.random.default_rng(0),
    "numpy Generator (MT19937)": lambda: np.random.Generator(np.random.MT19937(0)),
    "numpy Generator (Philox)": lambda: np.random.Generator(np.random.Philox(0)),
    "torch.Generator (CPU)": lambda: torch.Generator().manual_seed(0),
}


def _draw(rng: Any) -> float:
    if isinstance(rng, torch.Generator):
        return float(torch.rand((), generator=rng))
    return float(rng.random() if not isinstance(rng, np.random.RandomState) else rng.random_sample())


class OwnRng(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, make: Callable[[], Any]) -> None:
        self.n = n
        self.rng = make()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[float, float]:
        return float(torch.rand(())), _draw(self.rng)


def _loader(n: int, make: Callable[[], Any], *, keyed: bool) -> DataLoader[Any]:
    loader = DataLoader(OwnRng(n, make), batch_size=32, shuffle=True, num_workers=0)
    prepare_dataloader(loader, seed=42, rank=0, stream=StreamKey("train", 0), counter=lambda: 0)
    assert len(loader.dataset._own) == 1  # type: ignore[attr-defined]
    if not keyed:
        loader.dataset._own = []  # type: ignore[attr-defined]
    return loader


def _time_pass(loader: DataLoader[Any]) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repetitions")
    args = parser.parse_args(argv)
    n, reps = (2048, 5) if args.quick else (8192, 9)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {n} samples per pass, batch 32, num_workers=0,")
    print(f"median of {reps} alternating passes each")
    print(f"    {'generator held by the dataset':30}{'not keyed':>12}{'keyed':>12}{'added':>12}")
    for name, make in KINDS.items():
        plain, keyed = _loader(n, make, keyed=False), _loader(n, make, keyed=True)
        _time_pass(plain), _time_pass(keyed)  # warm-up
        plain_times, keyed_times = [], []
        for _ in range(reps):
            plain_times.append(_time_pass(plain))
            keyed_times.append(_time_pass(keyed))
        plain_us = statistics.median(plain_times) / n * 1e6
        keyed_us = statistics.median(keyed_times) / n * 1e6
        print(f"    {name:30}{plain_us:>10.2f}us{keyed_us:>10.2f}us{keyed_us - plain_us:>10.2f}us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
