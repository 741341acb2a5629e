"""What lightning-repro costs under DDP: ``fit`` time and checkpoint save time, against plain Lightning, in one run.

Two ranks over gloo on the CPU (``torchrun --nproc_per_node=2``, started by this script), each rank's loader with
``num_workers=2`` over ``ImageDataset`` (3x32x32 images with crop, flip, jitter and noise drawn from torch, numpy and
python in ``__getitem__``), batch 32, shuffled, and two models:

* ``cnn``: the small CNN of ``benchmarks/workloads.py`` (SGD with momentum): a checkpoint of under 1 MB, whose save
  is mostly fixed costs;
* ``large``: an MLP on the flattened images, 3072 -> 1024 -> 1024 -> 1024 -> 10, with AdamW: 5.2 M parameters, a
  63 MB checkpoint, a save of a few hundred milliseconds (a realistic checkpoint).

* ``plain``: ``lightning.pytorch.seed_everything(seed, workers=True)``, ``Trainer(deterministic=True)`` and
  Lightning's ``DDPStrategy``;
* ``ours``: ``DeterminismCallback(seed)`` and ``ReproDDPStrategy``.

The two alternate (plain, ours, then ours, plain, ...), each repetition a fresh ``Trainer`` in the same two
processes. Measured on rank 0, between barriers: the wall time of ``trainer.fit`` (setup, worker start, training;
checkpointing off), and after the fit the median time of ``trainer.save_checkpoint`` (a single file, written by
rank 0; ours gathers every rank's part of the entry first). Each repetition gives one ratio ours/plain per measure;
printed are the median ratio and its range (min-max). Goals (issue 21): ``fit`` at most 1.05x, save at most 1.02x.

The machine may be shared: the load average is printed beside each model's figures, and so is the CPU time of a
save on each rank (``time.process_time``, which other processes disturb less than the wall time). After the timed
saves each fit saves a few more times with every part of the save timed (wall and CPU, per rank; medians): what the
entry costs and where (the process streams, the entry, the restore digests, the encoding for the seal, the gather,
the seal), what Lightning's ``dump_checkpoint``, the write and its barrier take.

Run::

    python benchmarks/bench_ddp.py                 # a few minutes on 2 CPU cores
    python benchmarks/bench_ddp.py --quick         # fewer repetitions, shorter fits
    python benchmarks/bench_ddp.py --models cnn    # one model only
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

import lightning.pytorch as pl
import torch
from docs_tables import add_flag, write_table  # benchmarks/ is on sys.path: the script's directory
from torch import nn

SEED = 42
FIT_GOAL = 1.05
SAVE_GOAL = 1.02


class LargeMLP(pl.LightningModule):
    """An MLP on the flattened 3x32x32 images with AdamW: 5.2 M parameters, a 63 MB checkpoint."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.2), nn.Linear(1024, classes),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


MODELS = {"cnn": "small CNN (SGD, momentum)", "large": "large MLP (AdamW, 5.2 M parameters)"}

_PARTS = [  # (module, attribute, label, ours only): what a save's parts are, in the order a save runs them
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector.dump_checkpoint",
     "Lightning's dump_checkpoint (ours: with our entry)", False),
    ("lightning_repro._resume", "ResumeMixin._entry", "  our entry, in all", True),
    ("lightning_repro._resume", "capture_process_streams", "    capture the process streams", True),
    ("lightning_repro._resume", "ResumeMixin._build_entry", "    build this rank's part (position, metrics...)", True),
    ("lightning_repro.checkpoint.verify", "add_restore_digests", "    restore digests (parameters, optimizer)", True),
    ("lightning_repro.checkpoint.save", "encode", "    encode this rank's part for the seal", True),
    ("lightning_repro.checkpoint.gather", "pack_part", "    pack it (tensors out of band)", True),
    ("lightning_repro.checkpoint.gather", "_all_gather_bytes", "    all_gather (waits for the slower rank)", True),
    ("lightning_repro.checkpoint.gather", "unpack_part", "    unpack the other rank's part", True),
    ("lightning_repro.checkpoint.save", "seal_entry", "    seal the entry (SHA-256)", True),
    ("lightning.fabric.plugins.io.torch_io", "TorchCheckpointIO.save_checkpoint", "torch.save (rank 0)", False),
    ("lightning.pytorch.strategies.ddp", "DDPStrategy.barrier", "Lightning's barrier after the write", False),
]  # fmt: skip


class _Timed:
    """Time the parts of a save (wall and CPU), by wrapping them while ``active``."""

    def __init__(self, ours: bool) -> None:
        import importlib

        self.active = False
        self.times: dict[str, list[tuple[float, float]]] = {}
        self.undo: list[tuple[Any, str, Any]] = []
        for module_name, attribute, label, ours_only in _PARTS:
            if ours_only and not ours:
                continue
            owner: Any = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for step in path:
                owner = getattr(owner, step)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            setattr(owner, name, self._wrap(original, label))
            self.undo.append((owner, name, original))

    def _wrap(self, function: Any, label: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return function(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.times.setdefault(label, []).append((time.perf_counter() - wall, time.process_time() - cpu))

        return timed

    def close(self) -> dict[str, list[float]]:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
        return {
            label: [statistics.median(w for w, _ in got), statistics.median(c for _, c in got)]
            for label, got in self.times.items()
        }


def _fit(ours: bool, model_name: str, images: int, epochs: int, saves: int, root: Path) -> dict[str, Any]:
    """One fit and ``saves`` timed checkpoint saves on this rank, then ``saves`` saves with their parts timed."""
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
    model = workloads.SmallCNN(10) if model_name == "cnn" else LargeMLP(10)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    trainer.fit(model, loader)
    trainer.strategy.barrier()
    fit_s = time.perf_counter() - start
    times, cpu = [], []
    name = f"{model_name}-{'ours' if ours else 'plain'}"
    for i in range(saves):
        trainer.strategy.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.save_checkpoint(root / f"{name}-{i}.ckpt")
        trainer.strategy.barrier()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    size = os.path.getsize(root / f"{name}-0.ckpt") if trainer.is_global_zero else 0
    timed = _Timed(ours)
    for i in range(saves):
        trainer.strategy.barrier()
        timed.active = True
        trainer.save_checkpoint(root / f"{name}-parts-{i}.ckpt")
        timed.active = False
    return {
        "fit": fit_s,
        "save": statistics.median(times),
        "save_cpu": statistics.median(cpu),
        "bytes": size,
        "parts": timed.close(),
    }


def _worker(args: argparse.Namespace) -> None:
    import workloads

    workloads.quiet()
    root = Path(args.root)
    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, Any] = {}
    for model_name in args.models:
        load = os.getloadavg()[0]
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "ours": []}
        _fit(False, model_name, 64 * 2, 1, 1, root), _fit(True, model_name, 64 * 2, 1, 1, root)  # warm-up
        for rep in range(args.reps):
            for ours in (False, True) if rep % 2 == 0 else (True, False):
                got = _fit(ours, model_name, args.images, args.epochs, args.saves, root)
                runs["ours" if ours else "plain"].append(got)
                if rank == 0:  # the large model's files: 63 MB each
                    for path in root.glob("*.ckpt"):
                        path.unlink()
        results[model_name] = {"runs": runs, "load": [load, os.getloadavg()[0]]}
    Path(root, f"results-{rank}.json").write_text(json.dumps(results))


def _span(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _verdict(value: float, goal: float) -> str:
    return f"≤ {goal:g}: {'met' if value <= goal else 'NOT met'}"


def table(results: list[dict[str, Any]], models: list[str], steps: int) -> tuple[str, bool]:
    """The markdown tables of one run (``results``: each rank's), and whether every goal is met."""
    rows, cpu_rows, part_rows, ok = [], [], [], True
    for model_name in models:
        runs = [r[model_name]["runs"] for r in results]
        load = "{:.1f}-{:.1f}".format(*results[0][model_name]["load"])
        title = f"{MODELS[model_name]}, {steps} steps a rank"
        for measure, goal, what in (("fit", FIT_GOAL, "`fit` time"), ("save", SAVE_GOAL, "`save_checkpoint` time")):
            plain = [r[measure] for r in runs[0]["plain"]]
            ratios = [o[measure] / p[measure] for o, p in zip(runs[0]["ours"], runs[0]["plain"], strict=True)]
            verdict = _verdict(statistics.median(ratios), goal)
            ok &= "NOT" not in verdict
            scale, unit = (1.0, "s") if measure == "fit" else (1e3, "ms")
            median = f"{statistics.median(plain) * scale:.2f} {unit}"
            rows.append(f"| {title}: {what} | {median} | {_span(ratios)} | {verdict} | {load} |")
        size = statistics.median(r["bytes"] for r in runs[0]["plain"]) / 1e6
        cells = []
        for rank_runs in runs:
            plain_cpu = statistics.median(r["save_cpu"] for r in rank_runs["plain"]) * 1e3
            ours_cpu = statistics.median(r["save_cpu"] for r in rank_runs["ours"]) * 1e3
            cells.append(f"{plain_cpu:.2f} / {ours_cpu:.2f} ms (+{ours_cpu - plain_cpu:.2f})")
        cpu_rows.append(f"| {MODELS[model_name]}, {size:.1f} MB | {' | '.join(cells)} |")
        labels = [label for _, _, label, _ in _PARTS]
        for label in labels:
            cells = []
            for kind in ("plain", "ours"):
                for rank_runs in runs:
                    got = [r["parts"][label] for r in rank_runs[kind] if label in r["parts"]]
                    wall, cpu = (statistics.median(g[i] * 1e3 for g in got) for i in (0, 1)) if got else (0, 0)
                    cells.append(f"{wall:.2f} / {cpu:.2f}" if got else "-")
            part_rows.append(f"| {MODELS[model_name].split(' (')[0]}: {label.strip()} | {' | '.join(cells)} |")
    head = [
        "| workload (DDP, 2 ranks over gloo, workers 2, batch 32) | plain (median) | ratio ours/plain: median [min-max]"
        " | goal | load average |",
        "|---|---|---|---|---|",
    ]
    cpu_head = [
        "| CPU time of a save (`process_time`), plain / ours, median | rank 0 | rank 1 |",
        "|---|---|---|",
    ]
    part_head = [
        "| part of a save, wall / CPU ms, median | plain rank 0 | plain rank 1 | ours rank 0 | ours rank 1 |",
        "|---|---|---|---|---|",
    ]
    text = "\n".join([*head, *rows, "", *cpu_head, *cpu_rows, "", *part_head, *part_rows])
    return text, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, shorter fits")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (pairs), default 7")
    parser.add_argument("--saves", type=int, default=5, help="checkpoint saves after each fit (timed, then parts)")
    parser.add_argument("--models", default="cnn,large", help="comma-separated: cnn, large (default: both)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    add_flag(parser, "bench_ddp")
    args = parser.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    args.images = args.images or (1024 if args.quick else 2048)
    args.models = args.models.split(",") if isinstance(args.models, str) else args.models
    if not args.models or any(m not in MODELS for m in args.models):
        parser.error(f"--models takes a comma-separated list of {', '.join(MODELS)}, got {','.join(args.models)!r}")
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
        command += ["--epochs", str(args.epochs), "--models", ",".join(args.models)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        results = [json.loads(Path(root, f"results-{rank}.json").read_text()) for rank in (0, 1)]
    steps = args.images // 2 // 32 * args.epochs
    text, ok = table(results, args.models, steps)
    print(f"{args.reps} interleaved repetitions, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at")
    print(f"the end, {time.perf_counter() - start:.0f} s in all\n")
    print(text)
    if args.write_docs:
        print(f"\nwritten into {write_table('bench_ddp', text)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
