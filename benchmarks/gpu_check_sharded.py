"""The multi-GPU cases of ``gpu_check.py``: DDP, FSDP and FSDP2 jobs on 2 GPUs resume bitwise.

For each of ``ReproDDPStrategy`` (``"ddp_repro"``), ``ReproFSDPStrategy`` (``"fsdp_repro"``, FSDP1, CUDA only) and
``ReproModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``, data parallel 2), three 2-rank jobs
over NCCL (``torchrun --nproc_per_node=2``): uninterrupted; stopped mid-epoch (``max_steps``) and checkpointed with
``trainer.save_checkpoint``; resumed from it in fresh processes. Each rank's weights and optimizer state (its
shard, under FSDP) must equal the uninterrupted job's, SHA-256 for SHA-256. Needs 2 CUDA devices: with fewer, each
case is reported as skipped (NCCL puts one rank on each device).

Run through ``python benchmarks/gpu_check.py``; ``python benchmarks/gpu_check_sharded.py`` runs these cases alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 7
STRATEGIES = ("ddp_repro", "fsdp_repro", "model_parallel_repro")
STEPS, STOP_AT = 16, 6  # 2 epochs of 8 steps per rank; stopped in the first epoch
TIMEOUT_S = 600


class Net(pl.LightningModule):
    def __init__(self, fsdp2: bool) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def configure_model(self) -> None:
        if self.fsdp2:
            import workloads  # benchmarks/, beside this script

            workloads.shard_linears(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(32), self.y[i]  # augmentation


def rank_child(cfg: dict[str, Any]) -> None:
    """One rank of a job (started by torchrun); writes ``result-rank<R>.json`` in ``cfg["out"]``."""
    from lightning_repro import DeterminismCallback, ReproModelParallelStrategy, digest_tensors

    callback = DeterminismCallback(seed=SEED)
    fsdp2 = cfg["strategy"] == "model_parallel_repro"
    strategy: Any = cfg["strategy"]
    if fsdp2:
        strategy = ReproModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    model = Net(fsdp2)
    trainer = pl.Trainer(
        accelerator="gpu", devices=2, strategy=strategy, max_steps=cfg["max_steps"], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
        default_root_dir=cfg["out"],
    )  # fmt: skip
    loader = DataLoader(Samples(), batch_size=16, shuffle=True, num_workers=2)
    trainer.fit(model, loader, ckpt_path=cfg["resume"] or None)
    if cfg["save"]:
        trainer.save_checkpoint(cfg["save"])
    optimizer = trainer.optimizers[0].state_dict()["state"]
    result = {
        "weights": digest_tensors(dict(model.named_parameters())),
        "optimizer": digest_tensors({f"{p}.{k}": v for p, st in optimizer.items() for k, v in st.items()}),
        "global_step": trainer.global_step,
        "restored": callback.restored,
    }
    Path(cfg["out"], f"result-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _job(work: Path, name: str, **cfg: Any) -> list[dict[str, Any]]:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    full = {"max_steps": STEPS, "resume": "", "save": "", "out": str(out), **cfg}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1"]
    command += ["--master_addr=127.0.0.1", "--master_port=29531", __file__, "--rank-child", json.dumps(full)]
    env = {**os.environ, "PYTHONHASHSEED": str(SEED)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in (0, 1)]


def check_sharded(work: Path, report: Any) -> None:
    """Add one row per strategy to ``report`` (``gpu_check.Report``): PASS, FAIL, or INFO when skipped."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for strategy in STRATEGIES:
            report.add(f"4 {strategy}: 2-rank resume", None, f"skipped: needs 2 CUDA devices, {found} here")
        return
    for strategy in STRATEGIES:
        label = f"4 {strategy}: 2-rank resume"
        try:
            full = _job(work, f"{strategy}-full", strategy=strategy)
            ckpt = work / f"{strategy}-stopped.ckpt"
            _job(work, f"{strategy}-stopped", strategy=strategy, max_steps=STOP_AT, save=str(ckpt))
            resumed = _job(work, f"{strategy}-resumed", strategy=strategy, resume=str(ckpt))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            report.add(label, False, str(error))
            continue
        same = all(
            a["weights"] == b["weights"] and a["optimizer"] == b["optimizer"] and b["restored"]
            for a, b in zip(full, resumed, strict=True)
        )
        detail = ", ".join(f"rank {r}: {a['weights'][:12]} vs {b['weights'][:12]}" for r, (a, b) in enumerate(
            zip(full, resumed, strict=True)
        ))
        report.add(label, same, f"weights per rank {detail} (steps {resumed[0]['global_step']})")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-child":
        rank_child(json.loads(sys.argv[2]))
        return 0
    from gpu_check import Report

    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        check_sharded(Path(tmp), report)
    report.print()
    return 0 if report.passed or all(status == "INFO" for _, status, _ in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
