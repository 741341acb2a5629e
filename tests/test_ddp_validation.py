"""DDP with a validation every 4 batches (two "nodes" started warm): a job killed after a step checkpoint after which
a validation is due resumes bitwise, and a SIGTERM to every rank inside a validation stops the job when the
validation is over and resumes bitwise. The two tests share the uninterrupted reference job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
import torch
from ddp_cases import BASE, KILL, per_rank, sigterm_every_rank

pytestmark = [pytest.mark.ddp, pytest.mark.slow]


def test_killed_job_with_a_due_validation_resumes_bitwise(runs: Any) -> None:
    """A step checkpoint after which a validation is due (every 4 batches): every rank runs it on resume.

    The validation, and a checkpoint a callback writes in it, are collectives: run by rank 0 alone they would hang
    the job or part the ranks.
    """
    cfg = {**BASE, "num_workers": 0, "val": 4, "ckpt_every_n_steps": KILL["ckpt_every_n_steps"]}
    reference, ref_out = runs.ddp_reference(cfg, "nodes")
    _, killed = runs.ddp_reference({**cfg, **KILL}, "nodes", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["pending"] is not None  # the case under test: written at a batch's end...
    assert entry["pending"]["validate"] is True  # ... after which a validation is due
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-resumed-validation", launcher="nodes")
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    for rank in (0, 1):
        assert per_rank(killed, rank, out) == per_rank(ref_out, rank), f"rank {rank} diverged"
    # every file the resumed job writes (in a folder of its own: the one written in the validation it ran first,
    # the later ones) holds what the uninterrupted job's file of that name holds; the manifest: the Trainer's
    # arguments (the killed job's differ)
    later = sorted(p.name for p in Path(out, "ckpt").glob("*.ckpt"))
    assert len(later) >= 2, later
    ignore = ("/callbacks/DeterminismCallback/manifest/", "/callbacks/DeterminismCallback/entry_sha256")
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=ignore, names=later)
    assert not problems, "\n".join(problems)


def test_sigterm_to_every_rank_inside_a_validation_writes_the_exception_checkpoint_and_resumes_bitwise(
    runs: Any,
) -> None:
    """Validation every 4 batches (2 batches a rank): a SIGTERM inside it stops the job when it is over, at the end
    of training batch 4 (see :func:`ddp_cases.sigterm_every_rank`). The reference job is the other test's."""
    cfg = {**BASE, "num_workers": 0, "val": 4, "ckpt_every_n_steps": KILL["ckpt_every_n_steps"]}
    sigterm_every_rank(runs, cfg, "validation", 1, 4, "nodes")
