"""What lightning-repro costs a sharded run: checkpoint save time and step time, against plain Lightning and DDP.

Two ranks over gloo on the CPU (``torchrun --nproc_per_node=2``, started by this script). Models:

* ``tiny``: the MLP benchmark model (``workloads.MLP``: 64-d input, 3 hidden layers of 256, Adam), a checkpoint of
  a few hundred KiB: what the entry and the restore check cost by themselves;
* ``large``: the same MLP with 2048-d input and 4 hidden layers of 2048 (16.8 M parameters, Adam: 200 MB of
  weights and optimizer state), whose plain save takes some hundred milliseconds on a 2-core CPU.

Runs: FSDP2 (``fully_shard`` on each ``Linear`` and on the net, ``ModelParallelStrategy`` data parallel 2) in the
distributed layout (a directory) and in the single file, and DDP (the single file), each with and without
lightning-repro (ours: ``DeterminismCallback`` and our strategy; plain: ``seed_everything`` and Lightning's strategy).
Each pair is a plain fit and an ours fit back to back, in alternating order; each fit times ``--saves`` calls of
``trainer.save_checkpoint`` in the middle of training (between two batches, barriers around each) and its steps
(the steps just after a save left out). A pair's ratio is ours' median over plain's median; the table gives the
medians over the pairs and the range of the pairs' ratios, for the save's wall time and for rank 0's CPU time in the
save (all its threads: less disturbed by the other jobs of a shared machine, blind to time spent waiting for the
disk or the other rank). The goals (issue 20): a save at most 1.02x plain's, and a
per-step ratio under sharding no larger than under DDP.

Run::

    python benchmarks/bench_sharded.py                  # about 4 minutes on 2 CPU cores
    python benchmarks/bench_sharded.py --pairs 2 --only tiny
    python benchmarks/bench_sharded.py --write-docs     # also the table in docs/performance.md

On a machine shared with other work the figures move by several percent from one run to the next: the load
average is printed beside them; read the ratios against the range of the pairs.

``--parts`` also times, on each rank, the parts of our save (median milliseconds per save of the ours fits, wall time
and this process's CPU time, which the other jobs of a shared machine disturb less): capturing the process streams,
building the entry, the restore digests, the gather of every rank's part, the seal, and Lightning's own writing
(``strategy.save_checkpoint``), beside the whole ``trainer.save_checkpoint``; and, as the bound of any digest of
every byte, ``read``: one plain pass over this rank's weights and optimizer state (a sum of their bytes as int64
words), timed after each save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

MODELS = {"tiny": {"dim": 64, "width": 256, "depth": 3}, "large": {"dim": 2048, "width": 2048, "depth": 4}}
RUNS = (("fsdp2", "directory"), ("fsdp2", "file"), ("ddp", "file"))
PARTS = {  # module (in lightning_repro), function: what --parts times, by its label
    "streams": ("_resume", "capture_process_streams"),
    "entry": ("checkpoint.save", "build_entry"),
    "digests": ("checkpoint.verify", "add_restore_digests"),
    "gather": ("checkpoint.save", "_gathered"),  # every rank's part (gather_and_seal, the save's, calls it)
    "seal": ("checkpoint.save", "seal_entry"),  # gather_and_seal's
}
TIMES: dict[str, list[tuple[float, float]]] = {}  # --parts: (wall, CPU) seconds per call, by label
WARMUP_STEPS = 4
SAVE_EVERY = 3  # steps between two timed saves


def _model(kind: str, size: str) -> Any:
    import workloads

    class ShardedMLP(workloads.MLP):  # type: ignore[misc]
        def configure_model(self) -> None:
            workloads.shard_linears(self.net, self.device_mesh["data_parallel"])

    return (ShardedMLP if kind == "fsdp2" else workloads.MLP)(**MODELS[size])


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _record(label: str, start: tuple[float, float]) -> None:
    wall, cpu = _clocks()
    TIMES.setdefault(label, []).append((wall - start[0], cpu - start[1]))


def _read_once(trainer: Any) -> None:
    """``read`` of ``--parts``: one pass over every byte of this rank's weights and optimizer state, timed."""
    import torch

    from lightning_repro.shards import local_shard

    def tensors(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            yield local_shard(value)
        elif isinstance(value, dict):
            for item in value.values():
                yield from tensors(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)

    state = [trainer.lightning_module.state_dict(), [o.state_dict() for o in trainer.optimizers]]
    start = _clocks()
    for tensor in tensors(state):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw[: raw.numel() // 8 * 8]
        words.view(torch.int64).sum()
    _record("read", start)


def _time_parts() -> None:
    """Wrap each function of :data:`PARTS` where lightning-repro calls it, recording its time in :data:`TIMES`."""
    import functools
    import importlib

    def timed(label: str, function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = _clocks()
            try:
                return function(*args, **kwargs)
            finally:
                _record(label, start)

        return wrapper

    for label, (module_name, name) in PARTS.items():
        module = importlib.import_module(f"lightning_repro.{module_name}")
        setattr(module, name, timed(label, getattr(module, name)))
    # build_entry and gather_ranks are called as _save.<name> from _resume: the module attribute above is that one


def _fit(
    kind: str, layout: str, size: str, ours: bool, saves: int, root: Path, parts: bool = False
) -> dict[str, list[float]]:
    import lightning.pytorch as pl
    import workloads
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader

    from lightning_repro import DeterminismCallback, ReproDDPStrategy, ReproModelParallelStrategy

    class Saver(pl.Callback):
        """Times ``trainer.save_checkpoint`` every few steps after the warm-up; notes the steps it disturbs."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[float] = []  # this rank's CPU time (all its threads) in the save
            self.disturbed: set[int] = set()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            if step < WARMUP_STEPS or (step - WARMUP_STEPS) % SAVE_EVERY or len(self.times) >= saves:
                return
            trainer.strategy.barrier()
            start = time.perf_counter()
            clocks = _clocks()
            trainer.save_checkpoint(root / f"{kind}-{layout}-{size}-{ours}-{step}.ckpt")
            _record("total", clocks)
            self.cpu.append(time.process_time() - clocks[1])
            trainer.strategy.barrier()
            self.times.append(time.perf_counter() - start)
            if parts:
                _read_once(trainer)
            self.disturbed.add(len(timer.starts))  # the interval that ends at the next batch start holds the save

    callbacks: list[Any] = [DeterminismCallback(seed=0)] if ours else []
    if not ours:
        pl.seed_everything(0, verbose=False)
    timer, saver = workloads.StepTimer(), Saver()
    distributed = layout == "directory"
    strategy: Any
    if kind == "fsdp2":
        strategy = (ReproModelParallelStrategy if ours else ModelParallelStrategy)(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
        )
    else:
        strategy = ReproDDPStrategy() if ours else DDPStrategy()
    steps = WARMUP_STEPS + SAVE_EVERY * saves + 1
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[*callbacks, timer, saver],
        default_root_dir=root,
    )  # fmt: skip
    dim = MODELS[size]["dim"]
    loader = DataLoader(workloads.AugmentedDataset(64 * steps, dim, 10), batch_size=32, shuffle=True)
    write = trainer.strategy.save_checkpoint

    def timed_write(*args: Any, **kwargs: Any) -> None:
        start = _clocks()
        write(*args, **kwargs)
        _record("write", start)

    trainer.strategy.save_checkpoint = timed_write  # type: ignore[method-assign]
    trainer.fit(_model(kind, size), loader)
    intervals = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]
    quiet_steps = [t for i, t in enumerate(intervals, start=1) if i > WARMUP_STEPS and i not in saver.disturbed]
    trainer.strategy.barrier()
    if trainer.global_rank == 0:  # the disk holds one fit's checkpoints at a time
        for path in root.glob(f"{kind}-{layout}-{size}-*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    trainer.strategy.barrier()
    return {"save": saver.times, "save_cpu": saver.cpu, "step": quiet_steps}


def _worker(args: argparse.Namespace) -> None:
    import workloads

    workloads.quiet()
    root = Path(args.root)
    results: dict[str, list[dict[str, Any]]] = {}
    parts: dict[str, dict[str, list[float]]] = {}
    if args.parts:
        _time_parts()
    for size in args.only or list(MODELS):
        for kind, layout in RUNS:
            if size == "large" and kind == "ddp":
                continue  # DDP is the per-step reference: the tiny model's steps
            pairs = results.setdefault(f"{size}/{kind}/{layout}", [])
            for pair in range(args.pairs):
                order = (False, True) if pair % 2 == 0 else (True, False)  # alternate who goes first
                got = {}
                for ours in order:
                    TIMES.clear()
                    got[ours] = _fit(kind, layout, size, ours, args.saves, root, parts=args.parts)
                    if ours and args.parts:  # the last pair's: the saves of one ours fit
                        parts[f"{size}/{kind}/{layout}"] = {
                            k: [statistics.median(w for w, _ in v), statistics.median(c for _, c in v)]
                            for k, v in TIMES.items()
                        }
                pairs.append({"plain": got[False], "ours": got[True], "load": os.getloadavg()[0]})
    rank = int(os.environ.get("RANK", "0"))
    Path(args.root, f"parts-rank{rank}.json").write_text(json.dumps(parts))
    if rank == 0:
        Path(args.root, "results.json").write_text(json.dumps(results))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _ratios(pairs: list[dict[str, Any]], what: str) -> tuple[float, float, float, float, float]:
    """(plain median, ours median, median ratio, min ratio, max ratio) over the pairs."""
    plain = [statistics.median(p["plain"][what]) for p in pairs]
    ours = [statistics.median(p["ours"][what]) for p in pairs]
    ratios = [o / p for o, p in zip(ours, plain, strict=True)]
    return statistics.median(plain), statistics.median(ours), statistics.median(ratios), min(ratios), max(ratios)


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| model | run | layout | save plain | save ours | save ratio [range] | save CPU ratio [range]"
        " | step ratio [range] | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, pairs in results.items():
        size, kind, layout = key.split("/")
        sp, so, sr, slo, shi = _ratios(pairs, "save")
        _, _, tr, tlo, thi = _ratios(pairs, "step")
        _, _, cr, clo, chi = _ratios(pairs, "save_cpu")
        loads = [p["load"] for p in pairs]
        lines.append(
            f"| {size} | {'FSDP2 (dp 2)' if kind == 'fsdp2' else 'DDP'} | {layout} | {_ms(sp)} | {_ms(so)}"
            f" | {sr:.3f}x [{slo:.2f}-{shi:.2f}] | {cr:.3f}x [{clo:.2f}-{chi:.2f}] | {tr:.3f}x [{tlo:.2f}-{thi:.2f}]"
            f" | {min(loads):.1f}-{max(loads):.1f} |"
        )
    return "\n".join(lines)


def _parts_table(per_rank: list[dict[str, dict[str, list[float]]]]) -> str:
    """Wall / CPU ms per part and rank; ``read``'s share of ``total`` (the bound of a digest of every byte)."""
    labels = [*PARTS, "write", "total", "read"]
    lines = [f"| run | rank | {' | '.join(labels)} | read/total |", f"|---|---|{'---|' * (len(labels) + 1)}"]
    for key in per_rank[0]:
        for rank, parts in enumerate(per_rank):
            got = parts[key]
            cells = [f"{got[k][0] * 1e3:.1f} / {got[k][1] * 1e3:.1f}" if k in got else "-" for k in labels]
            share = f"{got['read'][0] / got['total'][0]:.1%}" if "read" in got and "total" in got else "-"
            lines.append(f"| {key} | {rank} | {' | '.join(cells)} | {share} |")
    return "\n".join(lines)


def main() -> None:
    from docs_tables import add_flag, write_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="interleaved plain/ours pairs of fits per run")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per fit")
    parser.add_argument("--only", action="append", choices=list(MODELS), help="this model only (repeatable)")
    parser.add_argument("--parts", action="store_true", help="also time the parts of our save on each rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    add_flag(parser, "bench_sharded")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.write_docs and (args.only or args.pairs < 5):
        parser.error("--write-docs writes the documented table: run both models with at least 5 pairs")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as root:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1"]
        command += ["--master_addr=127.0.0.1", "--master_port=29517", __file__, "--worker", "--root", root]
        command += ["--pairs", str(args.pairs), "--saves", str(args.saves)]
        command += [f"--only={size}" for size in args.only or ()] + (["--parts"] if args.parts else [])
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        results = json.loads(Path(root, "results.json").read_text())
        per_rank = [json.loads(Path(root, f"parts-rank{r}.json").read_text()) for r in (0, 1)]
    table = _table(results)
    print(
        f"2 ranks over gloo on {os.cpu_count()} CPUs, batch 32 per rank; {args.pairs} interleaved pairs of fits,"
        f" {args.saves} saves each; load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
        f" ({time.strftime('%Y-%m-%d')})"
    )
    print(table)
    if args.parts:
        print("\nthe parts of our save, median ms per save on each rank, wall / CPU (the last pair's ours fit):")
        print(_parts_table(per_rank))
    if args.write_docs:
        print(f"\nwritten into {write_table('bench_sharded', table)}")


if __name__ == "__main__":
    main()
