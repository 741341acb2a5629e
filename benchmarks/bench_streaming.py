"""What item-keyed streams cost on a streaming workload, against plain Lightning, interleaved in one run (issue 19).

The workload: a sharded ``IterableDataset`` (each dataloader worker reads its own shard) of cheap 32-d items with
augmentation drawn from torch, numpy and python ``random``, a small MLP, batch 32, ``num_workers=2``. Two set-ups,
in an order that alternates from one repetition to the next:

* ``plain``: ``lightning.pytorch.seed_everything(seed, workers=True)`` and ``Trainer(deterministic=True)``;
* ``ours``: ``DeterminismCallback(seed)``: each item's streams seeded from (seed, loader, epoch, worker, k), each
  batch stamped with its worker's position.

Measured: the wall time inside ``trainer.fit`` (goal: ratio ours/plain <= 1.05), a fit of several epochs (3 of
9600 items by default, about 4-5 s on 2 cores: a 1-s fit, one epoch with its workers started anew, moved by +-20 %
between repetitions). The goal is judged on the median of the pairwise ratios (each pair: a plain fit and an ours
fit back to back, in alternating order), printed with their range and with the ratio of each set-up's fastest fit
(the least disturbed one) beside it. The loading alone is timed too, in CPU
time, in the main process (``num_workers=0``, no training): the microseconds per item the keyed streams and the
stamps add. Then a mid-epoch resume of a dataset without ``state_dict()``: the workers' fast-forward (items read
again on their streams, not collated or sent) in items per second, and the size of the per-worker positions in the
checkpoint entry (``streaming``), for that dataset and for one with a ``state_dict()``.

Run::

    python benchmarks/bench_streaming.py           # a few minutes on 2 CPU cores (9 pairs of 3-epoch fits)
    python benchmarks/bench_streaming.py --quick   # shorter, noisier
    python benchmarks/bench_streaming.py --reps 15 --items 9600 --epochs 3   # more pairs, or another workload
    python benchmarks/bench_streaming.py --threads 1   # one torch thread: 2 workers + training on 2 cores, not 4

The output ends with a markdown table; ``--write-docs`` also writes it into ``docs/performance.md`` (between its
``bench_streaming`` markers). Exit code 0 when the goal is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from docs_tables import add_flag, write_table
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from workloads import MLP, bare_trainer, compared_trainer, quiet

from lightning_repro import DeterminismCallback
from lightning_repro.data.takeover import StreamKey, prepare_dataloader

SEED = 42
SETUPS = ("plain", "ours")
GOAL = 1.05
BATCH = 32
WORKERS = 2
ROOT_DIR = tempfile.mkdtemp(prefix="bench-streaming-runs-")  # the runs' manifests land here, not in the checkout


class ShardedAugmented(IterableDataset):  # type: ignore[type-arg]
    """``n`` cheap 32-d items, sharded by worker, each augmented from torch, numpy and python ``random``."""

    def __init__(self, n: int, dim: int = 32, classes: int = 10) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def _ids(self) -> range:
        info = get_worker_info()
        return range(len(self.x)) if info is None else range(info.id, len(self.x), info.num_workers)

    def __iter__(self) -> Any:
        for i in self._ids():
            x = self.x[i] + 0.05 * torch.randn(self.x.shape[1])
            scale = 1.0 + 0.1 * float(np.random.rand())
            sign = -1.0 if random.random() < 0.5 else 1.0
            yield x * (scale * sign), self.y[i]


class StatefulAugmented(ShardedAugmented):
    """The same, with its position as ``state_dict()`` (restored in the worker instead of a fast-forward)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.pos = self.start = 0

    def __iter__(self) -> Any:
        ids, start = list(self._ids()), self.start
        for j in range(start, len(ids)):
            self.pos = j + 1
            yield self.x[ids[j]], self.y[ids[j]]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["pos"])


def _loader(dataset: IterableDataset) -> DataLoader[Any]:  # type: ignore[type-arg]
    return DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)


def _fit(setup: str, items: int, epochs: int) -> float:
    trainer = compared_trainer(setup, SEED, max_epochs=epochs, default_root_dir=ROOT_DIR)
    model, loader = MLP(32), _loader(ShardedAugmented(items))
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start


def _load(setup: str, items: int, workers: int) -> float:
    """Seconds to iterate the loader once (no training), plain or taken over: CPU time of the main process with
    ``workers=0``, wall time with workers (their work is in other processes)."""
    loader: Any = DataLoader(ShardedAugmented(items), batch_size=BATCH, num_workers=workers)
    if setup == "ours":
        loader = prepare_dataloader(loader, seed=SEED, rank=0, stream=StreamKey("train", 0), counter=lambda: 0)
    clock = time.perf_counter if workers else time.process_time
    start = clock()
    for _ in loader:
        pass
    return clock() - start


def _entry_bytes(path: Path) -> int:
    part = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][0]
    buffer = io.BytesIO()
    torch.save(part.get("streaming", {}), buffer)
    return len(buffer.getvalue())


def measure_resume(items: int, folder: Path) -> tuple[float, float, int, int]:
    """(items fast-forwarded, their seconds, entry bytes without state_dict, with state_dict) of a mid-epoch resume."""
    steps = items // BATCH // 2  # half the epoch consumed
    sizes = []
    for name, make in (("plain", ShardedAugmented), ("state", StatefulAugmented)):
        trainer = bare_trainer([DeterminismCallback(SEED)], max_steps=steps, default_root_dir=folder)
        trainer.fit(MLP(32), _loader(make(items)))
        trainer.save_checkpoint(folder / f"{name}.ckpt")
        sizes.append(_entry_bytes(folder / f"{name}.ckpt"))
    callback = DeterminismCallback(SEED)
    trainer = bare_trainer([callback], max_steps=steps + 1, default_root_dir=folder)
    trainer.fit(MLP(32), _loader(ShardedAugmented(items)), ckpt_path=folder / "plain.ckpt")
    forwarded = callback.train_streams[0].fast_forward
    assert forwarded is not None, "the resume did not fast-forward"
    return forwarded[0], forwarded[1], sizes[0], sizes[1]


def _span(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and 5 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (pairs), at least 5 (default 9)")
    parser.add_argument("--items", type=int, default=None, help="items of the dataset (default 9600)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of a fit (default 3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads in the main process, both set-ups (default: torch's; 1 leaves the 2 workers a"
        " core each on a 2-core machine instead of oversubscribing it)",
    )
    add_flag(parser, "bench_streaming")
    args = parser.parse_args(argv)
    if args.write_docs and (args.quick or args.items or args.epochs or args.threads):
        parser.error("--write-docs writes the documented table: run it without --quick, --items, --epochs, --threads")
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = max(5, args.reps or (5 if args.quick else 9))
    items = args.items or (1600 if args.quick else 9600)
    epochs = args.epochs or (1 if args.quick else 3)
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads,", end=" ")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, seed {SEED}, {reps} interleaved repetitions")
    t0 = time.perf_counter()
    for setup in SETUPS:  # warm-up
        _fit(setup, BATCH * WORKERS * 4, 1)
    fits: dict[str, list[float]] = {s: [] for s in SETUPS}
    for rep in range(reps):
        for setup in SETUPS if rep % 2 == 0 else reversed(SETUPS):
            fits[setup].append(_fit(setup, items, epochs))
    ratios = [a / b for a, b in zip(fits["ours"], fits["plain"], strict=True)]
    ratio = statistics.median(ratios)  # the goal's figure: the median pairwise ratio
    fastest = min(fits["ours"]) / min(fits["plain"])
    loads: dict[str, list[float]] = {s: [] for s in SETUPS}
    loads_w: dict[str, list[float]] = {s: [] for s in SETUPS}
    for rep in range(reps):
        for setup in SETUPS if rep % 2 == 0 else reversed(SETUPS):
            loads[setup].append(_load(setup, items, 0))
            loads_w[setup].append(_load(setup, items, WORKERS))
    added = [(a - b) / items * 1e6 for a, b in zip(loads["ours"], loads["plain"], strict=True)]
    plain_item = statistics.median(loads["plain"]) / items * 1e6
    ratios_w = [a / b for a, b in zip(loads_w["ours"], loads_w["plain"], strict=True)]
    verdict = f"≤ {GOAL:g}: {'met' if ratio <= GOAL else 'NOT met'}"
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        forwarded, seconds, plain_bytes, state_bytes = measure_resume(items, Path(tmp))
    rate = forwarded / seconds if seconds > 0 else float("inf")
    title = f"sharded IterableDataset, {items} 32-d items augmented from 3 streams, MLP, batch {BATCH}, workers 2"
    print(f"\n{title}, {epochs} epoch(s)")
    print(f"  fit time plain {_span(fits['plain'])} s, ours {_span(fits['ours'])} s")
    print(f"  pairwise ratios ours/plain {_span(ratios)} ({verdict}); ratio of the fastest fits {fastest:.3f}")
    cost = _span(added, "{:+.1f}")
    print(f"  loading alone (CPU, main process): plain {plain_item:.1f} us/item, ours {cost} us/item")
    print(f"  loading alone, workers 2 (wall): plain {_span(loads_w['plain'])} s, ratio ours/plain {_span(ratios_w)}")
    print(f"  mid-epoch resume: fast-forward of {forwarded} items in {seconds:.3f} s ({rate:,.0f} items/s)")
    print(f"  per-worker positions in the entry: {plain_bytes} B (no state_dict), {state_bytes} B (with state_dict)")
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f} s\n")
    table = "\n".join(
        [
            "| workload | plain | ours/plain | goal |",
            "|---|---|---|---|",
            f"| {title}, {epochs} epoch(s): `fit` time, {reps} pairs | {statistics.median(fits['plain']):.2f} s"
            f" (median) | {_span(ratios)} (pairwise: median [min-max]); fastest fits {fastest:.3f} | {verdict} |",
            f"| the same loading alone, workers 2, wall time | {statistics.median(loads_w['plain']):.2f} s |"
            f" {_span(ratios_w)} | no goal |",
            f"| the same loading alone, `num_workers=0`, CPU time of the main process | {plain_item:.1f} µs/item |"
            f" {_span(added, '{:+.1f}')} µs/item added | no goal |",
            f"| mid-epoch resume, no `state_dict()`: fast-forward of {forwarded} items in 2 workers | | {rate:,.0f}"
            " items/s | no goal (the cost of reading them) |",
            f"| per-worker positions in the checkpoint entry (2 workers) | | {plain_bytes} B; {state_bytes} B with"
            " the dataset's `state_dict()` | no goal |",
        ]
    )
    print(table)
    if args.write_docs:
        print(f"\nwritten into {write_table('bench_streaming', table)}")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
