"""What taking over a ``torchdata.nodes`` pipeline costs, against the user's own loader, interleaved in one run.

The pipeline, as torchdata's docs migrate a ``DataLoader``: ``SamplerWrapper(RandomSampler)`` ->
``ParallelMapper(dataset.__getitem__)`` -> ``Batcher(32)`` -> ``Mapper(default_collate)`` (-> ``Prefetcher`` with
workers), in a ``Loader``. The dataset is ``workloads.AugmentedDataset`` (cheap 32-d items, augmentation drawn from
torch, numpy and python ``random``: what keyed streams have to seed). Two measures, each the median over interleaved
repetitions with its range:

(a) loading alone (no training), microseconds per batch: the user's ``Loader`` (``plain``) against our copy of it
    (``ours``: the order drawn on its stream, each item's map seeded from its key, the loader's state recorded after
    every batch), with the map inline (``num_workers=0``: CPU time of the process, where all the work is) and in
    2 worker processes (wall time);
(b) whole fits of ``workloads.MLP`` over the loader with 2 workers: ``plain`` (``seed_everything(workers=True)`` +
    ``deterministic=True``) against ``DeterminismCallback(seed)``, the time inside ``trainer.fit``.

No goal is set: the cost is per item (a map this cheap is the worst case; a real one, decoding an image, hides it).
torchdata prints tracebacks of its own on stderr during the run (worker processes finalizing the copies of other
iterators they were forked with; a sort thread unpickling a tensor from a worker stopped at once by ``_shutdown``,
from the plain fits: Lightning's iterable check starts an iterator of the user's loader that the next ``iter()``
stops); the table at the end is what the run measured.

Run::

    python benchmarks/bench_nodes.py           # about a minute on 2 CPU cores
    python benchmarks/bench_nodes.py --quick   # fewer repetitions
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from workloads import MLP, AugmentedDataset, compared_trainer, quiet

from lightning_repro.data import nodes
from lightning_repro.streams import StreamKey

SEED = 42
BATCH = 32
ROOT_DIR = tempfile.mkdtemp(prefix="bench-nodes-runs-")  # the runs' manifests land here, not in the checkout


def _pipeline(items: int, workers: int) -> Any:
    import torchdata.nodes as tn  # type: ignore[import-untyped]

    dataset = AugmentedDataset(items, 32, 10)
    node: Any = tn.SamplerWrapper(torch.utils.data.RandomSampler(dataset))
    node = tn.ParallelMapper(node, dataset.__getitem__, workers, method="process")
    node = tn.Mapper(tn.Batcher(node, BATCH), torch.utils.data.default_collate)
    return tn.Loader(tn.Prefetcher(node, 2) if workers else node)


def _load(setup: str, items: int, workers: int) -> float:
    """Microseconds per batch to iterate the loader once: CPU time with the map inline, wall time with workers."""
    loader = _pipeline(items, workers)
    if setup == "ours":
        key = StreamKey("train", 0)
        loader = nodes.take_over(loader, seed=SEED, rank=0, stream=key, counter=lambda: 0, consumed=None, warn=print)
    clock = time.perf_counter if workers else time.process_time
    start = clock()
    batches = sum(1 for _ in loader)
    return (clock() - start) / batches * 1e6


def _fit(setup: str, items: int) -> float:
    trainer = compared_trainer(setup, SEED, max_epochs=1, default_root_dir=ROOT_DIR)
    model, loader = MLP(32), _pipeline(items, 2)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return time.perf_counter() - start


def _span(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _interleaved(measure: Any, reps: int) -> tuple[list[float], list[float]]:
    plain: list[float] = []
    ours: list[float] = []
    for rep in range(reps):
        for setup in ("plain", "ours") if rep % 2 == 0 else ("ours", "plain"):
            (plain if setup == "plain" else ours).append(measure(setup))
    return plain, ours


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, fewer items")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (pairs), default 7")
    args = parser.parse_args(argv)
    quiet()
    reps = args.reps or (3 if args.quick else 7)
    items = 1024 if args.quick else 4096
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads; {items} items")
    rows = ["| measure | plain | ours | ours/plain: median [min-max] |", "|---|---|---|---|"]
    for workers in (0, 2):
        plain, ours = _interleaved(lambda setup, w=workers: _load(setup, items, w), reps)
        ratios = [o / p for o, p in zip(ours, plain, strict=True)]
        what = "inline map, CPU time" if workers == 0 else "2 worker processes, wall time"
        rows.append(
            f"| (a) loading, us per batch of {BATCH} ({what}) | {statistics.median(plain):.0f}"
            f" | {statistics.median(ours):.0f} | {_span(ratios)} |"
        )
        print(rows[-1], flush=True)
    plain, ours = _interleaved(lambda setup: _fit(setup, items), reps)
    ratios = [o / p for o, p in zip(ours, plain, strict=True)]
    rows.append(
        f"| (b) fit, MLP, 1 epoch, 2 workers, s | {statistics.median(plain):.2f} | {statistics.median(ours):.2f}"
        f" | {_span(ratios)} |"
    )
    print(rows[-1])
    print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
