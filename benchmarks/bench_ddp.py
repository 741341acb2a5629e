"""What lightning-repro costs under DDP: ``fit`` time and checkpoint save time, against plain Lightning, in one run.

Two ranks over gloo on the CPU (``torchrun --nproc_per_node=2``, started by this script), each rank's loader with
``num_workers=2``: the small CNN of ``benchmarks/workloads.py`` on ``ImageDataset`` (3x32x32 images with crop, flip,
jitter and noise drawn from torch, numpy and python in ``__getitem__``), batch 32, shuffled.

* ``plain``: ``lightning.pytorch.seed_everything(seed, workers=True)``, ``Trainer(deterministic=True)`` and
  Lightning's ``DDPStrategy``;
* ``ours``: ``DeterminismCallback(seed)`` and ``ReproDDPStrategy``.

The two alternate (plain, ours, then ours, plain, ...), each repetition a fresh ``Trainer`` in the same two
processes. Measured on rank 0, between barriers: the wall time of ``trainer.fit`` (setup, worker start, training;
checkpointing off), and after the fit the median time of ``trainer.save_checkpoint`` (a single file, written by
rank 0; ours gathers every rank's part of the entry first). Each repetition gives one ratio ours/plain per measure;
printed are the median ratio and its range (min-max). Goals (issue 21): ``fit`` at most 1.05x, save at most 1.02x.

Run::

    python benchmarks/bench_ddp.py                 # a few minutes on 2 CPU cores
    python benchmarks/bench_ddp.py --quick         # fewer repetitions, shorter fits
    python benchmarks/bench_ddp.py --write-docs    # also writes the table into docs/performance.md

Exit code 0 when both goals are met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docs_tables import add_flag, write_table  # benchmarks/ is on sys.path: the script's directory

SEED = 42
FIT_GOAL = 1.05
SAVE_GOAL = 1.02


def _fit(ours: bool, images: int, epochs: int, saves: int, root: Path) -> dict[str, float]:
    """One fit and ``saves`` checkpoint saves on this rank; rank 0's wall times (seconds)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    import workloads
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_repro import DeterminismCallback, ReproDDPStrategy

    callbacks: list[Any] = []
    if ours:
        callbacks.append(DeterminismCallback(SEED))
    else:
        pl.seed_everything(SEED, workers=True, verbose=False)
    trainer = workloads.bare_trainer(
        callbacks,
        devices=2,
        strategy=ReproDDPStrategy() if ours else DDPStrategy(),
        max_epochs=epochs,
        deterministic=None if ours else True,
        default_root_dir=root,
    )
    loader = DataLoader(workloads.ImageDataset(images, 10), batch_size=32, shuffle=True, num_workers=2)
    model = workloads.SmallCNN(10)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    trainer.fit(model, loader)
    trainer.strategy.barrier()
    fit_s = time.perf_counter() - start
    times = []
    for i in range(saves):
        trainer.strategy.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(root / f"{'ours' if ours else 'plain'}-{i}.ckpt")
        trainer.strategy.barrier()
        times.append(time.perf_counter() - start)
    return {"fit": fit_s, "save": statistics.median(times)}


def _worker(args: argparse.Namespace) -> None:
    import workloads

    workloads.quiet()
    root = Path(args.root)
    results: dict[str, list[dict[str, float]]] = {"plain": [], "ours": []}
    _fit(False, 64 * 2, 1, 1, root), _fit(True, 64 * 2, 1, 1, root)  # warm-up: imports, the allocator
    for rep in range(args.reps):
        for ours in (False, True) if rep % 2 == 0 else (True, False):
            results["ours" if ours else "plain"].append(_fit(ours, args.images, args.epochs, args.saves, root))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(root, "results.json").write_text(json.dumps(results))


def _span(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _verdict(value: float, goal: float) -> str:
    return f"≤ {goal:g}: {'met' if value <= goal else 'NOT met'}"


def table(results: dict[str, list[dict[str, float]]], title: str) -> tuple[str, bool]:
    """The markdown table of one run, and whether both goals are met."""
    rows, ok = [], True
    for measure, goal, what in (("fit", FIT_GOAL, "`fit` time"), ("save", SAVE_GOAL, "`save_checkpoint` time")):
        plain = [r[measure] for r in results["plain"]]
        ratios = [o[measure] / p[measure] for o, p in zip(results["ours"], results["plain"], strict=True)]
        verdict = _verdict(statistics.median(ratios), goal)
        ok &= "NOT" not in verdict
        scale, unit = (1.0, "s") if measure == "fit" else (1e3, "ms")
        median = f"{statistics.median(plain) * scale:.2f} {unit}"
        rows.append(f"| {title}: {what} | {median} | {_span(ratios)} | {verdict} |")
    head = ["| workload | plain (median) | ratio ours/plain: median [min-max] | goal |", "|---|---|---|---|"]
    return "\n".join([*head, *rows]), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, shorter fits")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (pairs), default 7")
    parser.add_argument("--saves", type=int, default=5, help="checkpoint saves after each fit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    add_flag(parser, "bench_ddp")
    args = parser.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    args.images = args.images or (1024 if args.quick else 2048)
    if args.worker:
        _worker(args)
        return 0
    if args.write_docs and args.quick:
        parser.error("--write-docs writes the documented table: run without --quick")
    start = time.perf_counter()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as root:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1"]
        command += ["--master_addr=127.0.0.1", "--master_port=29519", __file__, "--worker", "--root", root]
        command += ["--reps", str(args.reps), "--saves", str(args.saves), "--images", str(args.images)]
        command += ["--epochs", str(args.epochs)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        results = json.loads(Path(root, "results.json").read_text())
    steps = args.images // 2 // 32 * args.epochs
    title = f"DDP, 2 ranks (gloo), workers 2, small CNN, batch 32, {steps} steps a rank"
    text, ok = table(results, title)
    print(f"{args.reps} interleaved repetitions, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at")
    print(f"the end, {time.perf_counter() - start:.0f} s in all\n")
    print(text)
    if args.write_docs:
        print(f"\nwritten into {write_table('bench_ddp', text)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
