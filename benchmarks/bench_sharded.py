"""What lightning-repro costs a sharded run: checkpoint save time and step time, against plain Lightning and DDP.

Two ranks over gloo on the CPU (``torchrun --nproc_per_node=2``, started by this script): the MLP benchmark model
(``workloads.MLP``, 3 hidden layers of 256) with ``fully_shard`` on each ``Linear`` and on the whole net, under
``ModelParallelStrategy`` (data parallel 2), and the same model under DDP, each with and without lightning-repro
(``DeterminismCallback`` and our strategy; plain: ``seed_everything`` and Lightning's strategy). For each it prints the
median step time and the median time of ``trainer.save_checkpoint`` (the distributed layout, a directory, and the
single file), and the ratios ours / plain. The goal: at most 1.02x on the save time, and a per-step cost under
sharding no larger than under DDP.

Run::

    python benchmarks/bench_sharded.py [--steps 40] [--saves 7]

On a shared, loaded machine the figures move by several percent between runs: read the ratios of one run, taken
side by side, and run it twice.
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

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))


def _sharded_mlp(dim: int) -> Any:
    import workloads

    class ShardedMLP(workloads.MLP):  # type: ignore[misc]
        def configure_model(self) -> None:
            workloads.shard_linears(self.net, self.device_mesh["data_parallel"])

    return ShardedMLP(dim)


def _case(kind: str, ours: bool, layout: str, steps: int, saves: int, root: Path) -> dict[str, float]:
    import lightning.pytorch as pl
    import workloads
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader

    from lightning_repro import DeterminismCallback, ReproDDPStrategy, ReproModelParallelStrategy

    callbacks: list[Any] = []
    if ours:
        callbacks.append(DeterminismCallback(seed=0))
    else:
        pl.seed_everything(0, verbose=False)
    timer = workloads.StepTimer()
    callbacks.append(timer)
    dim = 64
    distributed = layout == "directory"
    strategy: Any
    if kind == "fsdp2":
        strategy = (ReproModelParallelStrategy if ours else ModelParallelStrategy)(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
        )
        model = _sharded_mlp(dim)
    else:
        strategy = ReproDDPStrategy() if ours else DDPStrategy()
        model = workloads.MLP(dim)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, default_root_dir=root,
    )  # fmt: skip
    loader = DataLoader(workloads.AugmentedDataset(4096, dim, 10), batch_size=64, shuffle=True)
    trainer.fit(model, loader)
    times = []
    for i in range(saves):
        trainer.strategy.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(root / f"{kind}-{ours}-{layout}-{i}.ckpt")
        trainer.strategy.barrier()
        times.append(time.perf_counter() - start)
    return {"step": statistics.median(timer.step_times(skip=5)), "save": statistics.median(times[1:])}


def _worker(args: argparse.Namespace) -> None:
    import workloads

    workloads.quiet()
    root = Path(args.root)
    results: dict[str, dict[str, float]] = {}
    cases = [("fsdp2", "directory"), ("fsdp2", "file"), ("ddp", "file")]
    for kind, layout in cases:
        for ours in (False, True, False, True):  # interleaved twice: the machine's load drifts
            got = _case(kind, ours, layout, args.steps, args.saves, root)
            key = f"{kind}/{layout}/{'ours' if ours else 'plain'}"
            previous = results.get(key)
            results[key] = got if previous is None else {k: min(v, got[k]) for k, v in previous.items()}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.root, "results.json").write_text(json.dumps(results))


def _table(results: dict[str, dict[str, float]]) -> str:
    lines = [
        "| run | layout | step plain | step ours | step ratio | save plain | save ours | save ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, layout in (("fsdp2", "directory"), ("fsdp2", "file"), ("ddp", "file")):
        plain, ours = results[f"{kind}/{layout}/plain"], results[f"{kind}/{layout}/ours"]
        lines.append(
            f"| {'FSDP2 (dp 2)' if kind == 'fsdp2' else 'DDP'} | {layout} | {plain['step'] * 1e3:.1f} ms"
            f" | {ours['step'] * 1e3:.1f} ms | {ours['step'] / plain['step']:.3f}x | {plain['save'] * 1e3:.1f} ms"
            f" | {ours['save'] * 1e3:.1f} ms | {ours['save'] / plain['save']:.3f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as root:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1"]
        command += ["--master_addr=127.0.0.1", "--master_port=29517", __file__, "--worker", "--root", root]
        command += ["--steps", str(args.steps), "--saves", str(args.saves)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        results = json.loads(Path(root, "results.json").read_text())
    print("2 ranks over gloo on the CPU, the MLP benchmark model (batch 64); medians, best of two interleaved runs")
    print(_table(results))


if __name__ == "__main__":
    main()
