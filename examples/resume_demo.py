"""Kill a training run mid-epoch, resume it, and compare with the run that was never interrupted.

The same small training runs twice: with plain Lightning (``seed_everything(42, workers=True)``
and ``Trainer(deterministic=True)``) and with lightning-repro (``DeterminismCallback(42)``). The
data has augmentation drawing from torch, numpy and python ``random``, the model has dropout, the
loader shuffles and uses two worker processes. For each, three fresh processes run:

(a) the uninterrupted run;
(b) the same run with ``ModelCheckpoint(every_n_train_steps=...)``, killed hard (``os._exit``)
    a few steps after a checkpoint written in the middle of an epoch;
(c) a resume from that checkpoint.

Every run appends the sample indices of each training step to a file as it goes, so the killed
run keeps its record. The report compares the final weights of (a) and (c), and the samples
trained on: (b) before its checkpoint, then (c), against (a), as multisets of sample indices
("repeated": trained more often than in (a), "missed": less often).

Run::

    python examples/resume_demo.py    # about 30-60 s on 2 CPU cores

Exit code 0 when the lightning-repro resume is bitwise identical to its uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

SEED = 42
SAMPLES, BATCH, EPOCHS = 240, 16, 3  # 15 steps per epoch, 45 in all
CHECKPOINT_EVERY = 20  # the checkpoint falls after step 20: in the middle of the second epoch
KILL_AFTER = 23  # ... and the process dies 3 steps later
KILLED_EXIT_CODE = 17


# ---------------------------------------------------------------------------------- the training run
class AugmentedPoints(Dataset):  # type: ignore[type-arg]
    """Fixed points and labels; every read draws its augmentation from torch, numpy and python."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 16, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i] + 0.1 * torch.randn(16)  # torch: jitter
        x = x * float(np.random.uniform(0.9, 1.1))  # numpy: scale
        if random.random() < 0.5:  # python: flip
            x = x.flip(0)
        return x, self.y[i], i


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class RecordSamples(Callback):
    """Appends ``{"step": global step, "samples": [indices]}`` to a file after every training step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        record = {"step": trainer.global_step, "samples": batch[2].tolist()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class KillAfter(Callback):
    """Ends the process abruptly after ``steps`` training steps, like a preempted job."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            os._exit(KILLED_EXIT_CODE)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every parameter."""
    h = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(mode: str, phase: str, out: Path) -> None:
    """One run: ``mode`` is "plain" or "repro", ``phase`` is "uninterrupted", "killed" or "resumed"."""
    callbacks: list[Callback] = []
    if mode == "repro":
        from lightning_repro import DeterminismCallback

        callbacks.append(DeterminismCallback(SEED))
        determinism: dict[str, Any] = {}
    else:
        pl.seed_everything(SEED, workers=True, verbose=False)
        determinism = {"deterministic": True}
    model = Classifier()
    callbacks.append(RecordSamples(out / f"{phase}.samples.jsonl"))
    if phase == "killed":
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1))
        callbacks.append(KillAfter(KILL_AFTER))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        logger=False,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=phase == "killed",
        callbacks=callbacks,
        **determinism,
    )
    loader = DataLoader(AugmentedPoints(), batch_size=BATCH, shuffle=True, num_workers=2)
    trainer.fit(model, loader, ckpt_path=checkpoint_of(out) if phase == "resumed" else None)
    (out / f"{phase}.weights").write_text(weights_digest(model))


def checkpoint_of(out: Path) -> Path:
    return next((out / "ckpt").glob("*.ckpt"))


# ---------------------------------------------------------------------------------- the comparison
def run_phase(mode: str, phase: str, out: Path) -> None:
    """Run one phase in a fresh Python process."""
    env = {**os.environ, "PYTHONHASHSEED": str(SEED)}  # fixed string hashing, as DeterminismCallback advises
    command = [sys.executable, __file__, "--run", mode, phase, str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    expected = KILLED_EXIT_CODE if phase == "killed" else 0
    if proc.returncode != expected:
        raise RuntimeError(f"{mode} {phase} run exited {proc.returncode}, expected {expected}:\n{proc.stderr[-3000:]}")


def samples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_mode(mode: str, out: Path) -> dict[str, Any]:
    """Run (a), (b) and (c) for one mode and compare them."""
    out.mkdir(parents=True)
    for phase in ("uninterrupted", "killed", "resumed"):
        run_phase(mode, phase, out)
    checkpoint_step = torch.load(checkpoint_of(out), weights_only=True)["global_step"]
    before = [s for s in samples(out / "killed.samples.jsonl") if s["step"] < checkpoint_step]
    stitched = Counter(i for s in before + samples(out / "resumed.samples.jsonl") for i in s["samples"])
    reference = Counter(i for s in samples(out / "uninterrupted.samples.jsonl") for i in s["samples"])
    uninterrupted = (out / "uninterrupted.weights").read_text()
    resumed = (out / "resumed.weights").read_text()
    return {
        "uninterrupted": uninterrupted[:12],
        "resumed": resumed[:12],
        "repeated": sum((stitched - reference).values()),
        "missed": sum((reference - stitched).values()),
        "identical": uninterrupted == resumed,
        "checkpoint_step": checkpoint_step,
    }


def print_report(results: dict[str, dict[str, Any]]) -> None:
    plain, ours = results["plain"], results["repro"]
    rows = [
        ("weights, uninterrupted run", plain["uninterrupted"], ours["uninterrupted"]),
        ("weights, killed + resumed run", plain["resumed"], ours["resumed"]),
        ("samples repeated", str(plain["repeated"]), str(ours["repeated"])),
        ("samples missed", str(plain["missed"]), str(ours["missed"])),
        ("identical", "yes" if plain["identical"] else "no", "yes" if ours["identical"] else "no"),
    ]
    steps, resumed_from = SAMPLES // BATCH, ours["checkpoint_step"]
    title = f"{EPOCHS} epochs of {steps} steps, killed after step {KILL_AFTER}, resumed from step {resumed_from}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(f"{'':32}{'plain Lightning':>18}{'lightning-repro':>18}")
        for name, a, b in rows:
            print(f"{name:32}{a:>18}{b:>18}")
        return
    table = Table(title=title)
    table.add_column("")
    table.add_column("plain Lightning", justify="right")
    table.add_column("lightning-repro", justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs=3, metavar=("MODE", "PHASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # inside one of the training processes
        mode, phase, out = args.run
        train(mode, phase, Path(out))
        return 0

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        futures = {mode: pool.submit(run_mode, mode, Path(tmp, mode)) for mode in ("plain", "repro")}
        results = {mode: future.result() for mode, future in futures.items()}
    print_report(results)
    ours = results["repro"]
    print(f"(6 training runs in {time.perf_counter() - started:.0f} s)")
    if ours["identical"] and ours["repeated"] == ours["missed"] == 0:
        print("lightning-repro: the resumed run is bitwise identical to the uninterrupted one.")
        return 0
    print("lightning-repro: the resumed run DIFFERS from the uninterrupted one.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
