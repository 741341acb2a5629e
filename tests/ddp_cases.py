"""The DDP jobs of the ``test_ddp*.py`` files: their configs, and what each preemption test checks.

96 samples, batch 8, 2 ranks: 6 batches per rank and epoch. A job is the scenario (``tests/scenario.py``) on 2 gloo
processes (``runner.run_ddp``), launched by Lightning (``devices=2``), ``torchrun``, or as two "nodes" started warm
by the tests' fork server (a job of Lightning's launcher starts rank 1 in a fresh interpreter: seconds of imports,
so the tests use it where the launcher is what they test). The whole job is killed hard (SIGKILL on every rank) a
few steps after a ``ModelCheckpoint`` and resumed; weights and optimizer state must equal those of the
uninterrupted job, and every rank's per-step sample indices, losses and dropout masks too.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import runner
import torch

BASE: dict[str, Any] = {"max_epochs": 2}
KILL = {"ckpt_every_n_steps": 4, "kill_after_batches": 6}  # checkpoint mid-epoch, killed two steps later
# Workers of a rank are started by a fork server: forking them from a rank process itself hung once in ~20
# runs here, inside os.fork() (CPython's thread-state lock held by another thread at the moment of the fork).
FORKSERVER = {"mp_context": "forkserver"}


def per_rank(out: str, rank: int, resumed: str | None = None) -> list[tuple[Any, ...]]:
    records = runner.stitched(out, resumed, rank) if resumed else runner.steps(out, rank)
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in records]


PREEMPT_TIMEOUT_S = 120  # a preempted job that has not exited by then hangs: the test fails (it did before the fix)
ON_EXCEPTION = {"on_exception_ckpt": True, "report_process_group_at_exit": True}


def preempted(
    runs: Any, cfg: dict[str, Any], name: str, launcher: str, *, from_outside: bool = False
) -> tuple[str, Path, dict[str, Any]]:
    """Run a job that a SIGTERM stops; check every rank exited (status 0) and the file holds every rank's part.

    ``from_outside``: the test sends the signal to the job's process group once every rank wrote its marker.
    """
    out = runs.fresh_dir(name)
    outside = runner.signal_when_reached(out, 2, signal.SIGTERM) if from_outside else None
    config = {**cfg, **ON_EXCEPTION, "out": out}
    runner.run_ddp(config, launcher=launcher, exit_code=0, timeout=PREEMPT_TIMEOUT_S, while_running=outside)
    for rank in (0, 1):  # written by each rank's last atexit handler: the rank ran to its end, group destroyed
        assert (Path(out) / f"process-group-at-exit-rank{rank}.txt").read_text() == "destroyed", f"rank {rank}"
    checkpoint = Path(out, "ckpt", "on_exception.ckpt")
    assert checkpoint.exists(), "the job wrote no on_exception.ckpt"
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    parts = entry["ranks"]
    assert len(parts) == 2
    assert parts[0]["streams_sha256"] != parts[1]["streams_sha256"]  # each rank's own part
    return out, checkpoint, entry


def assert_resumes_bitwise(
    runs: Any, cfg: dict[str, Any], stopped: str, checkpoint: Path, name: str, launcher: str
) -> None:
    reference, ref_out = runs.ddp_reference(cfg, launcher)
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, name, launcher=launcher)
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    assert resumed["global_step"] == reference["global_step"]
    for rank in (0, 1):
        assert per_rank(stopped, rank, out) == per_rank(ref_out, rank), f"rank {rank} diverged"
        assert resumed["ranks"][rank]["params"] == reference["params"]


def sigterm_every_rank(runs: Any, cfg: dict[str, Any], where: str, batch: int, stop_step: int, launcher: str) -> None:
    """Every rank's main process gets SIGTERM at the same batch (a scheduler signals every task), with
    ``OnExceptionCheckpoint``: the job writes ``on_exception.ckpt`` with every rank's part, exits, and resumes bitwise.

    Before ``ReproDDPStrategy`` handled it the job hung and wrote nothing: Lightning's handler runs a broadcast in
    the signal handler (twice on rank 1, which rank 0's launcher signals again), the ranks' collectives no longer
    paired up, and the gather of every rank's state into the checkpoint waited forever.
    """
    signal_self = {"signal": "SIGTERM", "where": where, "batch": batch}
    stopped, checkpoint, entry = preempted(runs, {**cfg, "signal_self": signal_self}, f"sigterm-{where}", launcher)
    step, _, _ = runner.checkpoint_position(checkpoint)
    assert step == stop_step  # every rank stopped after the same batch: the first one that ended after the signal
    assert all(part["batches"] == stop_step for part in entry["ranks"])
    assert_resumes_bitwise(runs, cfg, stopped, checkpoint, f"sigterm-{where}-resumed", launcher)


def killed_job_resumes_bitwise(runs: Any, launcher: str, num_workers: int, **extra: Any) -> None:
    """The job killed two steps after a mid-epoch checkpoint, resumed: equal to the uninterrupted job on every rank,
    the restore verified on each rank without a word of difference (``extra``: more of the scenario's options)."""
    cfg = {**BASE, "num_workers": num_workers, **FORKSERVER, **extra}
    reference, ref_out = runs.ddp_reference(cfg, launcher)
    _, killed = runs.ddp_reference({**cfg, **KILL}, launcher, expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-resumed", launcher=launcher)
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    assert resumed["global_step"] == reference["global_step"]
    for rank in (0, 1):
        assert per_rank(killed, rank, out) == per_rank(ref_out, rank), f"rank {rank} diverged"
        assert resumed["ranks"][rank]["params"] == reference["params"]  # every rank ends with the same weights
    assert ": exact (restore verified: parameters, optimizer" in resumed["stderr"]
    assert "differs from the state it saved" not in resumed["stderr"]  # a rank's restore check, warned in its log
    assert "at the save differed from rank 0's" not in resumed["stderr"]
