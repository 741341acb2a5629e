"""GPU check: bitwise reproducibility and resume of lightning-repro on CUDA, and what determinism costs there.

Run on a machine with an NVIDIA GPU (one device is used; about 2-3 minutes on an H200)::

    python benchmarks/gpu_check.py

Every training and timing run is a fresh Python process (``sys.executable``), so nothing carries
over between runs but files. The checks:

1. Two identical CUDA runs: a small CNN (with batch norm and dropout) trained for 3 epochs on
   random images generated on the fly (augmentation drawing from torch, numpy and python
   ``random``), ``DeterminismCallback(seed)``, ``accelerator="gpu", devices=1``,
   ``num_workers=2``. The SHA-256 of every weight, buffer and optimizer tensor must match.
2. A CUDA resume: the same run stopped in the middle of the second epoch (``max_steps=k``, then
   ``trainer.save_checkpoint``), resumed in a fresh process, compared with run 1 (weights and
   optimizer state, SHA-256). The checkpoint must load with ``torch.load(weights_only=True)``,
   sit in the middle of an epoch, and hold the CUDA RNG states (``entry["ranks"][0]["streams"]["cuda"]``).
3. The cost of deterministic mode, as ``DeterminismCallback`` sets it
   (``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic``, no cuDNN benchmark,
   ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts) vs PyTorch's defaults: forward+backward steps
   of the small CNN and of an ``nn.TransformerEncoderLayer``, timed with CUDA synchronisation.
   Reported as a ratio; an operation without a deterministic implementation fails the check.
4. DDP, FSDP and FSDP2 on 2 GPUs (``gpu_check_sharded.py``): a 2-rank job of each resumes bitwise, rank by rank.
   Skipped (INFO) with fewer than 2 devices, and in the CPU dry run.

It prints a table and ends with ``GPU CHECK: PASS`` (exit 0) or ``GPU CHECK: FAIL`` (exit 1).
Without CUDA it exits 2 with a message. ``--cpu-dry-run`` (hidden) runs the same checks on CPU,
smaller, without the CUDA-state assertion, to test this script where no GPU is available.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_repro import digest_tensors

SEED = 1234
EPOCHS = 3
SAMPLES = 1024
BATCH = 64  # 16 steps per epoch
STOP_AT = 21  # the interrupted run stops after step 21: 5 batches into the second epoch
CHILD_TIMEOUT_S = 240
ENTRY_KEY = "DeterminismCallback"


# ------------------------------------------------------------------------------------ model and data
class RandomImages(Dataset):  # type: ignore[type-arg]
    """Images and labels generated from the index, plus augmentation from torch, numpy and python."""

    def __init__(self, n: int, size: int = 32) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        image = torch.randn(3, self.size, self.size, generator=g)
        label = int(torch.randint(0, 10, (), generator=g))
        image = image + 0.1 * torch.randn_like(image)  # torch: noise
        if np.random.rand() < 0.5:  # numpy: horizontal flip
            image = image.flip(2)
        image = torch.roll(image, random.randint(-2, 2), dims=1)  # python: vertical shift
        return image, label


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a mean over the pixels instead of AdaptiveAvgPool2d, whose CUDA backward has no deterministic version
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def digest(tensors: dict[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes (tensors moved to the CPU first)."""
    return digest_tensors(tensors)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()
    out: dict[str, Any] = {f"{pid}.{key}": value for pid, st in state["state"].items() for key, value in st.items()}
    out["param_groups"] = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return out


# ------------------------------------------------------------------------------------ child: training run
def train_child(cfg: dict[str, Any]) -> None:
    """One training run; writes its digests to ``cfg["result"]``."""
    from lightning_repro import DeterminismCallback

    callback = DeterminismCallback(SEED)  # first: it sets CUBLAS_WORKSPACE_CONFIG before CUDA starts
    model = SmallCNN()
    trainer = pl.Trainer(
        accelerator=cfg["accelerator"],
        devices=1,
        max_epochs=EPOCHS,
        max_steps=cfg["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    loader = DataLoader(RandomImages(SAMPLES), batch_size=BATCH, shuffle=True, num_workers=2)
    trainer.fit(model, loader, ckpt_path=cfg["resume"] or None)
    if cfg["save"]:
        trainer.save_checkpoint(cfg["save"])
    result = {
        "weights": digest(model.state_dict()),
        "optimizer": digest(optimizer_tensors(trainer.optimizers[0])),
        "global_step": trainer.global_step,
        "restored": callback.restored,
        "device": str(next(model.parameters()).device),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    Path(cfg["result"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ child: timing run
def _workloads(device: str, dry_run: bool) -> dict[str, tuple[nn.Module, torch.Tensor, Callable[..., torch.Tensor]]]:
    """name -> (module, input, loss of the module's output); built from a fixed seed."""
    torch.manual_seed(0)
    batch, size = (8, 16) if dry_run else (256, 32)
    cnn = SmallCNN().to(device)
    labels = torch.randint(0, 10, (batch,), device=device)
    d_model, heads, seq, tbatch = (64, 4, 32, 4) if dry_run else (512, 8, 256, 32)
    block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, batch_first=True).to(device)
    return {
        "small CNN": (
            cnn,
            torch.randn(batch, 3, size, size, device=device),
            lambda out: nn.functional.cross_entropy(out, labels),
        ),
        "transformer block": (
            block,
            torch.randn(tbatch, seq, d_model, device=device),
            lambda out: out.float().pow(2).mean(),
        ),
    }


def _time_steps(module: nn.Module, x: torch.Tensor, loss_fn: Callable[..., torch.Tensor], dry_run: bool) -> float:
    """Median seconds per forward+backward step."""
    cuda = x.is_cuda
    warmup, steps, reps = (8, 5, 3) if dry_run else (10, 30, 5)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> None:
        loss_fn(module(x)).backward()
        module.zero_grad(set_to_none=True)

    module.train()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def timing_child(cfg: dict[str, Any]) -> None:
    """Time every workload in one mode; writes ``{name: seconds per step | {"error": ...}}``."""
    if cfg["deterministic"]:
        from lightning_repro.seeding import set_deterministic_flags

        set_deterministic_flags(True)  # exactly what DeterminismCallback(deterministic=True) sets
    device = "cpu" if cfg["dry_run"] else "cuda"
    if cfg["dry_run"]:
        torch.set_num_threads(1)  # small CPUs time multi-threaded kernels erratically; only the code path matters
    results: dict[str, Any] = {}
    for name, (module, x, loss_fn) in _workloads(device, cfg["dry_run"]).items():
        try:
            results[name] = _time_steps(module, x, loss_fn, cfg["dry_run"])
        except RuntimeError as error:  # an operation without a deterministic implementation
            results[name] = {"error": str(error).strip().splitlines()[0][:200]}
    results["flags"] = {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }
    Path(cfg["result"]).write_text(json.dumps(results))


# ------------------------------------------------------------------------------------ parent
class ChildError(RuntimeError):
    pass


def run_child(cfg: dict[str, Any], env: dict[str, str | None] | None = None) -> dict[str, Any]:
    """Run this script as a child in a fresh interpreter; return the JSON it wrote."""
    child_env = {**os.environ, "PYTHONHASHSEED": str(SEED), **(env or {})}
    child_env = {k: v for k, v in child_env.items() if v is not None}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=child_env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise ChildError(f"{cfg['role']} run timed out after {CHILD_TIMEOUT_S} s") from error
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ChildError(f"{cfg['role']} run exited with {proc.returncode}:\n{tail}")
    return json.loads(Path(cfg["result"]).read_text())  # type: ignore[no-any-return]


class Report:
    """Collects (check, PASS/FAIL/INFO, detail) rows and prints them as a table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, ok: bool | None, detail: str = "") -> None:
        self.rows.append((check, "INFO" if ok is None else "PASS" if ok else "FAIL", detail))

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(status != "FAIL" for _, status, _ in self.rows)

    def print(self) -> None:
        width = max(len(check) for check, _, _ in self.rows)
        print(f"{'check':<{width}}  result  detail")
        print("-" * (width + 40))
        for check, status, detail in self.rows:
            lines = detail.splitlines() or [""]
            print(f"{check:<{width}}  {status:<6}  {lines[0]}")
            for line in lines[1:]:
                print(f"{'':<{width}}          {line}")


def _short(sha: str) -> str:
    return sha[:12]


def check_training(work: Path, accelerator: str, dry_run: bool, report: Report) -> None:
    def train(name: str, **cfg: Any) -> dict[str, Any]:
        full = {"role": "train", "accelerator": accelerator, "max_steps": -1, "resume": "", "save": "", **cfg}
        return run_child({**full, "result": str(work / f"{name}.json")})

    # 1. two identical runs
    try:
        first = train("run-a")
        second = train("run-b")
    except ChildError as error:
        report.add("1 two identical runs", False, str(error))
        return
    device_note = f"device {first['device']}, deterministic algorithms {first['deterministic']}"
    report.add(
        "1 identical runs: weights SHA-256",
        first["weights"] == second["weights"],
        f"{_short(first['weights'])} vs {_short(second['weights'])} ({device_note})",
    )
    report.add(
        "1 identical runs: optimizer SHA-256",
        first["optimizer"] == second["optimizer"],
        f"{_short(first['optimizer'])} vs {_short(second['optimizer'])}",
    )

    # 2. interrupted mid-epoch, resumed in a fresh process
    ckpt = work / f"stopped-at-{STOP_AT}.ckpt"
    try:
        train("interrupted", max_steps=STOP_AT, save=str(ckpt))
    except ChildError as error:
        report.add("2 interrupted run", False, str(error))
        return
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
        report.add("2 checkpoint loads with weights_only=True", True)
    except Exception as error:  # any unpickling error means the check failed
        report.add("2 checkpoint loads with weights_only=True", False, f"{type(error).__name__}: {error}")
        return
    entry = checkpoint.get("callbacks", {}).get(ENTRY_KEY)
    if not entry:
        report.add("2 checkpoint holds the lightning-repro entry", False, f"no {ENTRY_KEY!r} under 'callbacks'")
        return
    part = entry["ranks"][0]  # rank 0's part (entry version 2)
    position = part["data"][0]
    mid_epoch = 0 < position["offset"] < position["length"]
    report.add(
        "2 checkpoint is in the middle of an epoch",
        mid_epoch,
        f"epoch {position['epoch']}, {position['offset']} of {position['length']} batches consumed",
    )
    cuda_states = part["streams"].get("cuda", [])
    if dry_run:
        report.add("2 checkpoint holds CUDA RNG states", None, f"skipped (CPU dry run; {len(cuda_states)} states)")
    else:
        report.add(
            "2 checkpoint holds CUDA RNG states",
            len(cuda_states) > 0,
            f"{len(cuda_states)} device state(s) in entry['ranks'][0]['streams']['cuda']",
        )
    try:
        resumed = train("resumed", resume=str(ckpt))
    except ChildError as error:
        report.add("2 resumed run", False, str(error))
        return
    report.add(
        "2 resume == uninterrupted: weights",
        resumed["weights"] == first["weights"] and resumed["restored"],
        f"{_short(resumed['weights'])} vs {_short(first['weights'])} (restored: {resumed['restored']},"
        f" steps {resumed['global_step']} vs {first['global_step']})",
    )
    report.add(
        "2 resume == uninterrupted: optimizer",
        resumed["optimizer"] == first["optimizer"],
        f"{_short(resumed['optimizer'])} vs {_short(first['optimizer'])}",
    )


def check_timing(work: Path, dry_run: bool, report: Report) -> None:
    results: dict[bool, dict[str, Any]] = {}
    for deterministic in (False, True):
        cfg = {
            "role": "timing",
            "deterministic": deterministic,
            "dry_run": dry_run,
            "result": str(work / f"timing-{deterministic}.json"),
        }
        # the default mode must start CUDA without the workspace restriction deterministic mode sets
        env: dict[str, str | None] = {} if deterministic else {"CUBLAS_WORKSPACE_CONFIG": None}
        try:
            results[deterministic] = run_child(cfg, env=env)
        except ChildError as error:
            report.add(f"3 timing, {'deterministic' if deterministic else 'default'} mode", False, str(error))
            return
    flags = results[True]["flags"]
    if not flags["use_deterministic_algorithms"] or results[False]["flags"]["use_deterministic_algorithms"]:
        report.add("3 timing modes", False, f"flags not as intended: {results}")
        return
    for name in ("small CNN", "transformer block"):
        default, deterministic = results[False][name], results[True][name]
        label = f"3 deterministic cost, {name}"
        if isinstance(default, dict) or isinstance(deterministic, dict):
            modes = (("default", default), ("deterministic", deterministic))
            report.add(label, False, "\n".join(f"{mode}: {r['error']}" for mode, r in modes if isinstance(r, dict)))
            continue
        report.add(
            label,
            None,
            f"{default * 1e3:.3f} ms -> {deterministic * 1e3:.3f} ms per fwd+bwd step,"
            f" ratio {deterministic / default:.3f}",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help="keep the checkpoints and results in this folder")
    args = parser.parse_args(argv)

    if args.child:
        cfg = json.loads(args.child)
        {"train": train_child, "timing": timing_child}[cfg["role"]](cfg)
        return 0

    dry_run = args.cpu_dry_run
    if not dry_run and not torch.cuda.is_available():
        print(
            "gpu_check.py needs an NVIDIA GPU: torch.cuda.is_available() is False here"
            f" (torch {torch.__version__}, built for CUDA {torch.version.cuda}). Run it on a machine with CUDA.",
            file=sys.stderr,
        )
        return 2

    started = time.perf_counter()
    if dry_run:
        print("CPU DRY RUN: the checks below ran on the CPU; they say nothing about CUDA.")
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__},", end=" ")
        print(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, lightning {pl.__version__}")
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check_training(work, "cpu" if dry_run else "gpu", dry_run, report)
        check_timing(work, dry_run, report)
        if dry_run:
            report.add("4 DDP, FSDP, FSDP2 resumes", None, "skipped (CPU dry run)")
        else:
            from gpu_check_sharded import check_sharded

            check_sharded(work, report)
    print()
    report.print()
    print()
    print(f"({time.perf_counter() - started:.0f} s)")
    verdict = "PASS" if report.passed else "FAIL"
    print(f"CPU DRY RUN (no GPU tested): {verdict}" if dry_run else f"GPU CHECK: {verdict}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
