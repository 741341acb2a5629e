"""The distributed cases of ``gpu_check.py``: DDP, FSDP and FSDP2 jobs on the GPU resume bitwise.

For each of ``ReproDDPStrategy`` (``"ddp_repro"``), ``ReproFSDPStrategy`` (``"fsdp_repro"``, FSDP1, CUDA only) and
``ReproModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``), in 32-bit and (FSDP, FSDP2) in
``bf16-mixed`` (FSDP2 with its ``MixedPrecisionPolicy``), three jobs over NCCL (``torchrun``): uninterrupted;
stopped mid-epoch (``max_steps``) and checkpointed with ``trainer.save_checkpoint``; resumed from it in fresh
processes. Each rank's weights and optimizer state (its shard, under FSDP) must equal the uninterrupted job's,
SHA-256 for SHA-256. With 2 CUDA devices the jobs have 2 ranks (data parallel 2); with one (NCCL puts one rank on
each device) they have one rank, which still runs each strategy's CUDA path (the FSDP wrapping, the distributed
checkpoint, the entry) but not the exchange between ranks: the report says which. The cases run side by side.

Run through ``python benchmarks/gpu_check.py``; ``python benchmarks/gpu_check_sharded.py`` runs these cases alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 7
CASES = (
    ("ddp_repro", "32-true"),
    ("fsdp_repro", "32-true"),
    ("model_parallel_repro", "32-true"),
    ("fsdp_repro", "bf16-mixed"),
    ("model_parallel_repro", "bf16-mixed"),
)
STEPS, STOP_AT = 16, 6  # 2 epochs of 8 steps per rank; stopped in the first epoch
TIMEOUT_S = 600


class Net(pl.LightningModule):
    def __init__(self, fsdp2: bool, bf16: bool = False) -> None:
        super().__init__()
        self.fsdp2, self.bf16 = fsdp2, bf16
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def configure_model(self) -> None:
        if self.fsdp2:
            import workloads  # benchmarks/, beside this script

            policy = None
            if self.bf16:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            workloads.shard_linears(self.net, self.device_mesh["data_parallel"], mp_policy=policy)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

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
        strategy = ReproModelParallelStrategy(data_parallel_size=cfg["world"], tensor_parallel_size=1)
    model = Net(fsdp2, bf16=cfg["precision"] == "bf16-mixed")
    trainer = pl.Trainer(
        accelerator="gpu", devices=cfg["world"], strategy=strategy, precision=cfg["precision"],
        max_steps=cfg["max_steps"], logger=False,
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


def _job(work: Path, name: str, port: int, **cfg: Any) -> list[dict[str, Any]]:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    full = {"max_steps": STEPS, "resume": "", "save": "", "out": str(out), **cfg}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg['world']}", "--nnodes=1"]
    command += ["--master_addr=127.0.0.1", f"--master_port={port}", __file__, "--rank-child", json.dumps(full)]
    env = {**os.environ, "PYTHONHASHSEED": str(SEED)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(cfg["world"])]


def _case(work: Path, strategy: str, precision: str, world: int, port: int) -> tuple[bool, str]:
    """One case's three jobs (the uninterrupted and the stopped one side by side); (bitwise equal, detail)."""
    name = f"{strategy}-{precision}"
    common = {"strategy": strategy, "precision": precision, "world": world}
    ckpt = work / f"{name}-stopped.ckpt"
    with ThreadPoolExecutor(2) as pool:
        full_job = pool.submit(_job, work, f"{name}-full", port, **common)
        pool.submit(_job, work, f"{name}-stopped", port + 1, max_steps=STOP_AT, save=str(ckpt), **common).result()
        full = full_job.result()
    resumed = _job(work, f"{name}-resumed", port + 2, resume=str(ckpt), **common)
    same = all(
        a["weights"] == b["weights"] and a["optimizer"] == b["optimizer"] and b["restored"]
        for a, b in zip(full, resumed, strict=True)
    )
    pairs = enumerate(zip(full, resumed, strict=True))
    detail = ", ".join(f"rank {r}: {a['weights'][:12]} vs {b['weights'][:12]}" for r, (a, b) in pairs)
    return same, f"weights per rank {detail} (steps {resumed[0]['global_step']}, restored {resumed[0]['restored']})"


def check_sharded(work: Path, report: Any) -> None:
    """Add one row per case to ``report`` (``gpu_check.Report``): PASS, FAIL, or INFO when skipped."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = min(found, 2)
    if not world:
        for strategy, precision in CASES:
            report.add(f"4 {strategy} {precision}: resume", None, "skipped: needs a CUDA device, none here")
        return
    ranks = "2-rank" if world == 2 else "1-rank (1 GPU here: no exchange between ranks)"
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = [
            pool.submit(_case, work, strategy, precision, world, 29531 + 10 * i)
            for i, (strategy, precision) in enumerate(CASES)
        ]
        for (strategy, precision), future in zip(CASES, futures, strict=True):
            label = f"4 {strategy} {precision}: {ranks} resume"
            try:
                same, detail = future.result()
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                report.add(label, False, str(error))
                continue
            report.add(label, same, detail)


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
