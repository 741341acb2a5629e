"""SLURM's auto-requeue (``SLURMEnvironment(auto_requeue=True)``): the job gets SIGUSR1 before its time limit, writes
``hpc_ckpt_<N>.ckpt`` and requeues itself; the requeued job (``fit`` with no ``ckpt_path``) resumes from that file.

Lightning writes the file inside the signal handler, wherever the process is (here: right after a batch's backward,
where a file is not exact), and every dataloader worker forked from the training process does the same from its
stale copy of the trainer (SLURM signals every process of the job step), each requeueing the job again. With
DeterminismCallback the handler only notes the signal; the file is written and the job requeued once, at the end of
that training batch, by the training process (``_lightning/signals.py``). Each run is a fresh process
(``tests/scenario.py``, ``"slurm"``): the uninterrupted run, the signalled run (then killed, as SLURM ends the job),
and the requeued run in the same folder, which Lightning resumes from the ``hpc_ckpt_1.ckpt`` it finds there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
import torch
from ddp_cases import FORKSERVER

pytestmark = pytest.mark.slow

# 96 samples, batch 8: 12 batches an epoch, 2 epochs; validation every 4 batches; a step checkpoint every 5 steps
BASE: dict[str, Any] = {
    "max_epochs": 2, "val": 4, "ckpt_every_n_steps": 5, "csv_logger": True, "slurm": {"batch": None}
}
IGNORED = (  # the checkout's state, and the seal over it (as tests/test_inflight.py)
    "/callbacks/DeterminismCallback/manifest/code/",
    "/callbacks/DeterminismCallback/entry_sha256",
)


# (extra config, the signal (after the backward of training batch k, from 0; or at the end of validation batch k),
# the step of the file, the training batches the signalled run reads before SLURM ends it)
CASES = [
    # forked workers (Lightning's handler inherited): mid-epoch 0, between two step checkpoints
    pytest.param({"num_workers": 2}, {"batch": 7}, 8, 10, id="workers-2"),
    # accumulation over 2 batches: the signal in the first batch of a window (the file is written inside the window)
    pytest.param({"accumulate": 2}, {"batch": 14}, 7, 17, id="accumulate-2"),
    # an IterableDataset read by 2 workers with its own state (40 items, batch 4, 10 batches an epoch)
    pytest.param(
        {"n": 40, "batch_size": 4, "val": "off", "stream": {"state": True}, "num_workers": 2},
        {"batch": 12},
        13,
        15,
        id="stream-workers-2",
    ),
    # in the validation after batch 7 (4 batches of 8 each): the file at the next training batch's end
    pytest.param({}, {"batch": 5, "validation": True}, 9, 11, id="in-a-validation"),
]


@pytest.mark.parametrize(("extra", "signal", "step", "read"), CASES)
def test_a_requeued_slurm_job_resumes_bitwise_from_the_file_written_at_the_signalled_batchs_end(
    runs: Any, extra: dict[str, Any], signal: dict[str, Any], step: int, read: int
) -> None:
    cfg = {**BASE, **extra}
    reference, ref_out = runs.reference(cfg)
    out = runs.fresh_dir("signalled")
    signalled = {**cfg, "slurm": signal, "kill_after_batches": read, "out": out}
    runner.run(signalled, expect_kill=True)  # SLURM ends the job after the signal's grace time
    files = sorted(p.name for p in Path(out).glob("hpc_ckpt_*.ckpt"))
    assert files == ["hpc_ckpt_1.ckpt"], files  # one file, the training process's: no worker wrote one
    hpc = Path(out, "hpc_ckpt_1.ckpt")
    saved = torch.load(hpc, weights_only=True, map_location="cpu")
    assert saved["global_step"] == step, "not written at the signalled batch's end"
    assert Path(out, "scontrol.log").read_text() == "requeue 4242\n"  # requeued once
    rows = runner.csv_rows(out, drop_empty=True)  # the CSV logger of the requeued run starts its file again

    requeued = runner.run({**cfg, "out": out})  # no ckpt_path: Lightning finds the file in default_root_dir
    for key in ("params", "optimizer", "global_step", "epoch", "batches_that_stepped", "lr", "metrics"):
        assert requeued[key] == reference[key], key
    assert runner.last_steps(out) == runner.last_steps(ref_out), "the steps differ (samples, losses or dropout masks)"
    assert runner.epochs(out) == runner.epochs(ref_out), "the epoch values differ"
    # the signalled run's CSV file holds the rows it logged until SLURM ended it (the logger writes at each row
    # here); the requeued run's starts again (Lightning's CSVLogger deletes what it finds) from the file's logger step
    expected = runner.csv_rows(ref_out, drop_empty=True)
    cut = saved["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"]
    before = len([row for row in expected if int(row["step"]) < cut])
    assert rows[:before] == expected[:before], "the signalled run logged other rows"
    assert runner.csv_rows(out, drop_empty=True) == expected[before:], "the logged rows after the file differ"
    kept = [p.name for p in Path(ref_out, "ckpt").glob("*.ckpt")]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=kept)
    assert not problems, "\n".join(problems)
    [line] = [x for x in requeued["stderr"].splitlines() if x.startswith("lightning-repro: resumed from")]
    assert line.startswith(f"lightning-repro: resumed from {hpc} at step {saved['global_step']},"), line
    assert ": exact (restore verified" in line, line
    assert sorted(p.name for p in Path(out).glob("hpc_ckpt_*.ckpt")) == files  # the requeued run wrote none


@pytest.mark.ddp
def test_a_requeued_slurm_ddp_job_resumes_bitwise_every_rank_writing_the_file_at_the_same_batch(runs: Any) -> None:
    """Two tasks of a SLURM job (``ReproDDPStrategy`` over gloo, 2 workers a rank from a fork server), each signalled
    with its workers after another batch's backward (rank 0 at its batch 2, rank 1 at its batch 3): the ranks agree
    at batch 2's end and write the file together at batch 3's ``on_train_batch_end``; rank 0 requeues once.
    Lightning's handler would run the save's collectives inside the handler on each rank at another point, and each
    forkserver worker would die of SIGUSR1. The requeued job, in the same folder, equals the uninterrupted one."""
    cfg = {"max_epochs": 2, "ckpt_every_n_steps": 4, "num_workers": 2, **FORKSERVER, "slurm": {"batch": None}}
    reference, ref_out = runs.ddp_reference(cfg, "slurm")
    out = runs.fresh_dir("ddp-signalled")
    signalled = {**cfg, "slurm": {"batch": [2, 3]}, "kill_after_batches": 6, "out": out}
    runner.run_ddp(signalled, launcher="slurm", expect_kill=True)
    files = sorted(p.name for p in Path(out).glob("hpc_ckpt_*.ckpt"))
    assert files == ["hpc_ckpt_1.ckpt"], files
    saved = torch.load(Path(out, "hpc_ckpt_1.ckpt"), weights_only=True, map_location="cpu")
    assert saved["global_step"] == 4  # rank 0's signal agreed at batch 2's end, the file at batch 3's on every rank
    assert [part["batches"] for part in saved["callbacks"]["DeterminismCallback"]["ranks"]] == [4, 4]
    assert Path(out, "scontrol.log").read_text() == "requeue 4242\n"
    requeued = runner.run_ddp({**cfg, "out": out}, launcher="slurm")
    for key in ("params", "optimizer", "global_step"):
        assert requeued[key] == reference[key], key
    for rank in (0, 1):
        assert runner.last_steps(out, rank) == runner.last_steps(ref_out, rank), f"rank {rank} diverged"
        assert requeued["ranks"][rank]["params"] == reference["params"]
    assert ": exact (restore verified: parameters, optimizer" in requeued["stderr"]
