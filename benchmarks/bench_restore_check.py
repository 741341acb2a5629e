"""What the restore check costs at save: digesting the CNN benchmark model's state, against its step time.

At every checkpoint the callback digests the module's ``state_dict()``, the optimizer and LR scheduler states
(``verify.add_restore_digests``; the data position and metric states are a few bytes); a resume digests them once
more. This script trains ``workloads.SmallCNN`` (SGD with momentum, so the optimizer holds one buffer per parameter)
on ``ImageDataset`` for a few steps, then times the digests and the whole entry (``DeterminismCallback.state_dict``)
and prints them next to the mean step time.

Run::

    python benchmarks/bench_restore_check.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))

import workloads

from lightning_repro import DeterminismCallback, capture_process_streams
from lightning_repro.checkpoint import verify


def main() -> None:
    workloads.quiet()
    callback = DeterminismCallback(seed=0)
    timer = workloads.StepTimer()
    model = workloads.SmallCNN()
    loader = DataLoader(workloads.ImageDataset(2048, 10), batch_size=64, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[callback, timer],
    )  # fmt: skip
    trainer.fit(model, loader)
    step = statistics.median(timer.step_times(skip=2))
    entry = callback._build_entry(trainer, capture_process_streams())  # the entry without the restore digests

    def best(fn: object, repeat: int = 20) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - start)
        return min(times)

    digests = best(lambda: verify.add_restore_digests(entry, trainer))
    whole = best(callback.state_dict)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"SmallCNN: {parameters} parameters, median step {step * 1e3:.1f} ms (batch 64, CPU)")
    print(f"restore digests at save: {digests * 1e3:.2f} ms ({digests / step:.1%} of a step), once per checkpoint")
    print(f"whole entry (DeterminismCallback.state_dict): {whole * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
