"""DDP preemption (gloo, real processes): SIGTERM to every rank, at a training step, inside a validation, from outside.

Every rank stops after the same training batch, ``OnExceptionCheckpoint`` writes the file with every rank's part,
the job exits, and a resume from the file equals the uninterrupted job bitwise. Apart from ``test_ddp.py`` so that
pytest-xdist can run the two files on two workers (their reference runs are made once per file).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import runner
import torch
from test_ddp import BASE, FORKSERVER, _per_rank

pytestmark = [pytest.mark.ddp, pytest.mark.slow]


PREEMPT_TIMEOUT_S = 120  # a preempted job that has not exited by then hangs: the test fails (it did before the fix)
ON_EXCEPTION = {"on_exception_ckpt": True, "report_process_group_at_exit": True}


def _preempted(
    runs: Any, cfg: dict[str, Any], name: str, *, from_outside: bool = False
) -> tuple[str, Path, dict[str, Any]]:
    """Run a job that a SIGTERM stops; check every rank exited (status 0) and the file holds every rank's part.

    ``from_outside``: the test sends the signal to the job's process group once every rank wrote its marker.
    """
    out = runs.fresh_dir(name)
    outside = runner.signal_when_reached(out, 2, signal.SIGTERM) if from_outside else None
    config = {**cfg, **ON_EXCEPTION, "out": out}
    runner.run_ddp(config, exit_code=0, timeout=PREEMPT_TIMEOUT_S, while_running=outside)
    for rank in (0, 1):  # written by each rank's last atexit handler: the rank ran to its end, group destroyed
        assert (Path(out) / f"process-group-at-exit-rank{rank}.txt").read_text() == "destroyed", f"rank {rank}"
    checkpoint = Path(out, "ckpt", "on_exception.ckpt")
    assert checkpoint.exists(), "the job wrote no on_exception.ckpt"
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    parts = entry["ranks"]
    assert len(parts) == 2
    assert parts[0]["streams_sha256"] != parts[1]["streams_sha256"]  # each rank's own part
    return out, checkpoint, entry


def _assert_resumes_bitwise(runs: Any, cfg: dict[str, Any], stopped: str, checkpoint: Path, name: str) -> None:
    reference, ref_out = runs.ddp_reference(cfg, "lightning")
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, name)
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    assert resumed["global_step"] == reference["global_step"]
    for rank in (0, 1):
        assert _per_rank(stopped, rank, out) == _per_rank(ref_out, rank), f"rank {rank} diverged"
        assert resumed["ranks"][rank]["params"] == reference["params"]


@pytest.mark.parametrize(
    ("where", "batch", "stop_step"),
    # validation every 4 batches (2 batches a rank): a SIGTERM inside it stops the job when it is over, at the
    # end of training batch 4
    [("train", 3, 3), ("validation", 1, 4)],
    ids=["at-a-training-step", "inside-a-validation"],
)
def test_sigterm_to_every_rank_writes_the_exception_checkpoint_and_resumes_bitwise(
    runs: Any, where: str, batch: int, stop_step: int
) -> None:
    """Every rank's main process gets SIGTERM at the same batch (a scheduler signals every task), with
    ``OnExceptionCheckpoint``: the job writes ``on_exception.ckpt`` with every rank's part, exits, and resumes bitwise.

    Before ``ReproDDPStrategy`` handled it the job hung and wrote nothing: Lightning's handler runs a broadcast in
    the signal handler (twice on rank 1, which rank 0's launcher signals again), the ranks' collectives no longer
    paired up, and the gather of every rank's state into the checkpoint waited forever.
    """
    cfg = {**BASE, "num_workers": 0, "val": 4}  # the reference of test_killed_job_with_a_due_validation_...
    signal_self = {"signal": "SIGTERM", "where": where, "batch": batch}
    stopped, checkpoint, entry = _preempted(runs, {**cfg, "signal_self": signal_self}, f"sigterm-{where}")
    step, _, _ = runner.checkpoint_position(checkpoint)
    assert step == stop_step  # every rank stopped after the same batch: the first one that ended after the signal
    assert all(part["batches"] == stop_step for part in entry["ranks"])
    _assert_resumes_bitwise(runs, cfg, stopped, checkpoint, f"sigterm-{where}-resumed")


def test_sigterm_from_outside_to_the_whole_job_resumes_bitwise(runs: Any) -> None:
    """The scheduler's case: once both ranks passed step 2, the test sends SIGTERM to the job's whole process group
    (both ranks, their dataloader workers and the workers' fork server), wherever each process happens to be. The
    job stops after one batch, the same on every rank, writes its checkpoint and exits; the resume from it, at
    whatever step the file says, equals the uninterrupted job. The workers, signalled too, ignore a SIGTERM that does
    not come from their rank and serve the batches their rank still fetches."""
    cfg = {**BASE, "num_workers": 2, **FORKSERVER}  # the reference of test_killed_job_resumes_bitwise[...workers2]
    stopped_cfg = {**cfg, "reached_marker_at": 2}  # then 0.1 s a batch: the signal lands inside the job's run
    stopped, checkpoint, entry = _preempted(runs, stopped_cfg, "outside-sigterm", from_outside=True)
    step, _, _ = runner.checkpoint_position(checkpoint)
    assert step >= 2
    assert entry["ranks"][0]["batches"] == entry["ranks"][1]["batches"]  # both ranks stopped after the same batch
    _assert_resumes_bitwise(runs, cfg, stopped, checkpoint, "outside-sigterm-resumed")
