"""DDP with dataloader workers (2 a rank, started by each rank's fork server): a killed job resumes bitwise, and a
SIGTERM from outside to the whole job (ranks, workers, fork servers) stops it at one batch on every rank and resumes
bitwise. The two tests share the uninterrupted reference job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
from ddp_cases import BASE, FORKSERVER, assert_resumes_bitwise, killed_job_resumes_bitwise, preempted

pytestmark = [pytest.mark.ddp, pytest.mark.slow]


def test_killed_job_resumes_bitwise(runs: Any) -> None:
    killed_job_resumes_bitwise(runs, "nodes", 2)
    reference, _ = runs.ddp_reference({**BASE, "num_workers": 2, **FORKSERVER}, "nodes")
    assert reference["worker_server"] == "forked"  # the tests' fork server for workers (tests/mpwarm.py) was used


def test_sigterm_from_outside_to_the_whole_job_resumes_bitwise(runs: Any) -> None:
    """The scheduler's case: once both ranks passed step 2, the test sends SIGTERM to the job's whole process group
    (both ranks, their dataloader workers and the workers' fork server), wherever each process happens to be. The
    job stops after one batch, the same on every rank, writes its checkpoint and exits; the resume from it, at
    whatever step the file says, equals the uninterrupted job. The workers, signalled too, ignore a SIGTERM that does
    not come from their rank and serve the batches their rank still fetches. The stopped job's workers come from the
    fork server multiprocessing spawns (a fresh interpreter), as a user's do; the other jobs' from one forked from
    the rank at its start (tests/mpwarm.py, seconds of imports less): the resume equals the reference all the same."""
    cfg = {**BASE, "num_workers": 2, **FORKSERVER}  # the reference of test_killed_job_resumes_bitwise[...workers2]
    # then 0.1 s a batch: the signal lands inside the job's run
    stopped_cfg = {**cfg, "reached_marker_at": 2, "warm_forkserver": False}
    # each rank a task of its own, as a scheduler (srun) starts them; the signal goes to each task's process group
    stopped, checkpoint, entry = preempted(runs, stopped_cfg, "outside-sigterm", "nodes", from_outside=True)
    step, _, _ = runner.checkpoint_position(checkpoint)
    assert step >= 2
    assert entry["ranks"][0]["batches"] == entry["ranks"][1]["batches"]  # both ranks stopped after the same batch
    assert {p.read_text() for p in Path(stopped).glob("worker-server-*.txt")} == {"spawned"}  # each rank's
    assert_resumes_bitwise(runs, cfg, stopped, checkpoint, "outside-sigterm-resumed", "nodes")
