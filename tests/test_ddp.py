"""DDP on CPU (gloo, real processes): through Lightning's own launcher (``devices=2``) the resume of a killed job, a
job started without ``PYTHONHASHSEED``, a checkpoint resumed on other nodes and SIGTERM to every rank at a training
step; as two "nodes" started warm (Lightning's launcher starts rank 1 in a fresh interpreter: seconds of imports a
job) plain Lightning's shared dropout masks, pruning, a module's own batch-end hook and the jobs resumed in their
folder.

The tests of each ``test_ddp*.py`` file share their reference and killed jobs (made once per file, a file per
pytest-xdist worker): see :mod:`ddp_cases` for the jobs, ``test_ddp_nodes.py`` for most of the rank-aware seeding
tests (two "nodes" started warm), ``test_ddp_workers.py`` (dataloader workers), ``test_ddp_validation.py`` and
``test_ddp_torchrun.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
import torch
from ddp_cases import BASE, KILL, killed_job_resumes_bitwise, per_rank, sigterm_every_rank

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

IGNORED = ("/callbacks/DeterminismCallback/manifest/code/", "/callbacks/DeterminismCallback/entry_sha256")
"""What two runs' checkpoint files may differ in: the run manifest's code section and the entry's seal."""
PRUNED = {**BASE, "max_epochs": 3, "num_workers": 0, "pruning": True}


def test_killed_job_resumes_bitwise(runs: Any) -> None:
    killed_job_resumes_bitwise(runs, "lightning", 0)


def test_a_job_started_without_pythonhashseed_resumes_under_on_env_drift_error(runs: Any) -> None:
    """Started as a user starts it (``python train.py``, no ``PYTHONHASHSEED``), with ``on_env_drift="error"``:
    ``ReproDDPStrategy`` exports the seed to the rank Lightning's launcher starts, so rank 0 hashes at random and rank
    1 with the seed, and their manifests differ. Rank 1's resume compared its interpreter with rank 0's manifest,
    raised ``EnvironmentDriftError`` ("pythonhashseed: None -> '1234'") and the job died; each rank > 0 now keeps its
    own environment and hardware in its part and compares with those."""
    cfg = {**BASE, "num_workers": 0, "on_env_drift": "error", "unset_hash_seed": True}
    _, killed = runs.ddp({**cfg, **KILL}, "ddp-hashseed-killed", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    seed = entry["seed"]
    assert entry["manifest"]["environment"]["pythonhashseed"] is None  # rank 0's, the shared manifest
    assert entry["ranks"][1]["own_manifest"]["environment"]["pythonhashseed"] == str(seed)
    assert set(entry["ranks"][1]["own_manifest"]) == {"environment", "hardware"}
    assert "own_manifest" not in entry["ranks"][0]
    resumed, _ = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-hashseed-resumed")
    assert resumed["global_step"] == 12
    assert ": exact (restore verified: parameters, optimizer" in resumed["stderr"]
    assert "EnvironmentDriftError" not in resumed["stderr"]
    assert "since the checkpoint was written" not in resumed["stderr"]  # no drift said, on any rank


def test_plain_ddp_dropout(runs: Any) -> None:
    """The control: Lightning's DDP with seed_everything draws identical masks on every rank (reported as xfailed)."""
    cfg = {**BASE, "num_workers": 0, "repro": False, "strategy": "ddp", "max_epochs": 1}
    plain, out = runs.ddp(cfg, "plain-ddp", launcher="nodes")
    assert plain["ranks"][0]["init"] == plain["ranks"][1]["init"]
    rank0, rank1 = runner.steps(out, 0), runner.steps(out, 1)
    assert len(rank0) == len(rank1) == 6
    with runner.plain_lightning_bug("every rank draws the same dropout masks (seed_everything is not rank-aware)"):
        assert all(a["dropout"] != b["dropout"] for a, b in zip(rank0, rank1, strict=True)), "a mask is shared"


def test_a_random_pruning_prunes_the_same_weights_on_every_rank(runs: Any) -> None:
    """ModelPruning draws its masks from the process streams: under rank-aware seeding every rank drew its own and the
    replicas pruned different weights (plain Lightning's ranks share one stream); it prunes on a stream every rank
    shares now. The weights at the end (the pruning made permanent) are the same on both ranks. The job is the
    reference of the next test."""
    result, _ = runs.ddp_reference(PRUNED, "nodes")
    ranks = result["ranks"]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["init"] == ranks[1]["init"]


def test_a_pruned_job_killed_after_its_first_pruning_resumes_bitwise(runs: Any) -> None:
    """ModelPruning (random masks, the lottery-ticket reset) under DDP, killed in epoch 1 two batches after its
    step-8 checkpoint (pruned at epoch 0's end), resumed: every rank prunes again with the checkpoint's masks and
    continues as the uninterrupted job (``tests/test_pruning_resume.py`` has the single-process cases)."""
    cfg = PRUNED
    reference, ref_out = runs.ddp_reference(cfg, "nodes")
    kill = {"ckpt_every_n_steps": 4, "kill_after_batches": 10}
    _, killed = runs.ddp_reference({**cfg, **kill}, "nodes", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(checkpoint)[0] == 8
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-pruned-resumed", launcher="nodes")
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    for rank in (0, 1):
        assert per_rank(killed, rank, out) == per_rank(ref_out, rank), f"rank {rank} diverged"
        assert resumed["ranks"][rank]["params"] == reference["params"]
    assert ": exact (restore verified: parameters, optimizer" in resumed["stderr"]
    assert "differs from the state it saved" not in resumed["stderr"]


def test_same_world_size_on_other_nodes(runs: Any) -> None:
    """A 1-node x 2-device checkpoint resumed as 2 nodes x 1 device: an error by default, exact with reseed."""
    cfg = {**BASE, "num_workers": 0}
    reference, ref_out = runs.ddp_reference(cfg, "lightning")
    _, killed = runs.ddp_reference({**cfg, **KILL}, "lightning", expect_kill=True)
    checkpoint = str(runner.checkpoints(killed)[-1])
    with pytest.raises(AssertionError, match=r"TopologyError: the checkpoint was written with world size 2 \(1 node"):
        runs.ddp({**cfg, "resume": checkpoint}, "nodes-error", launcher="nodes")
    resumed, out = runs.ddp({**cfg, "resume": checkpoint, "on_topology_change": "reseed"}, "nodes-ok", launcher="nodes")
    assert resumed["params"] == reference["params"]  # the same ranks keep their own streams: still exact
    for rank in (0, 1):
        assert per_rank(killed, rank, out) == per_rank(ref_out, rank)


def test_sigterm_to_every_rank_at_a_training_step_writes_the_exception_checkpoint_and_resumes_bitwise(
    runs: Any,
) -> None:
    """Lightning's launcher: rank 0's launcher forwards the signal to rank 1, which gets it twice (see
    :func:`ddp_cases.sigterm_every_rank`). The reference job is test_killed_job_resumes_bitwise's."""
    sigterm_every_rank(runs, {**BASE, "num_workers": 0}, "train", 3, 3, "lightning")


def test_a_job_resumed_in_its_folder_writes_the_epoch_end_save_again_in_place(runs: Any) -> None:
    """``last.ckpt`` on epoch 0's last batch (step 6), then a ``ModelCheckpoint(every_n_epochs=1)`` saves that step
    as ``epoch=0-step=6-v1.ckpt``; the job is killed in epoch 1 and resumed from ``last.ckpt`` in its folder. The
    epoch-end save is written again, in place (rank 0 decides, every rank agrees: no ``-v2``), and every file
    equals the uninterrupted job's (``tests/test_resave_in_place.py`` has the single-process cases)."""
    cfg = {**BASE, "num_workers": 0, "ckpt_every_n_steps": 3, "ckpt_every_n_epochs": 1, "save_last": True}
    _resumed_in_its_folder(runs, cfg, "ddp-in-place", 8, ("last.ckpt", 6), "epoch=0-step=6-v1.ckpt")


def _resumed_in_its_folder(
    runs: Any, cfg: dict[str, Any], name: str, kill_after: int, resume: tuple[str, int], written: str
) -> None:
    """A job killed after ``kill_after`` batches, with ``written`` in its folder, resumed there from the file
    ``resume = (name, step)``: it ends with the uninterrupted job's weights and every file of its folder."""
    reference, ref_out = runs.ddp_reference(cfg, "nodes")
    _, out = runs.ddp({**cfg, "kill_after_batches": kill_after}, name, launcher="nodes", expect_kill=True)
    last = Path(out, "ckpt", resume[0])
    assert runner.checkpoint_position(last)[0] == resume[1]
    assert Path(out, "ckpt", written).is_file()
    resumed = runner.run_ddp({**cfg, "out": out, "resume": str(last)}, launcher="nodes")
    assert resumed["params"] == reference["params"]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)


def test_a_modules_own_batch_end_hook_runs_again_on_every_rank(runs: Any) -> None:
    """The module's ``on_train_batch_end`` moves an EMA teacher and logs it (``sync_dist``: a collective in the
    hook); ``ModelCheckpoint(every_n_train_steps=4)`` saves before it runs. Killed after 6 batches and resumed from
    step 4 on 2 ranks: each rank runs the hook again for the checkpoint's batch with its own outputs and batch, so
    the teacher in every later file, the epoch means logged (the checkpoint's batch included) and the training
    equal the uninterrupted job's."""
    cfg = {**BASE, "num_workers": 0, "ckpt_every_n_steps": 4, "teacher": True}
    reference, ref_out = runs.ddp_reference(cfg, "nodes")
    _, killed = runs.ddp({**cfg, "kill_after_batches": 6}, "ddp-teacher-killed", launcher="nodes", expect_kill=True)
    checkpoint = Path(killed, "ckpt", "epoch=0-step=4.ckpt")
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["remainder"]["callbacks"] == [["<LightningModule>", -1]]
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-teacher-resumed", launcher="nodes")
    assert resumed["params"] == reference["params"]
    # the values synced across the ranks (every rank appends its epoch record to one file: `train_loss_epoch` is
    # each rank's own, logged without sync_dist, and the last rank to write wins)
    synced = [
        {e: {k: v for k, v in values.items() if k != "train_loss_epoch"} for e, values in runner.epochs(o).items()}
        for o in (out, ref_out)
    ]
    assert synced[0] == synced[1]
    assert "teacher_epoch" in synced[0][0]
    later = sorted(p.name for p in Path(out, "ckpt").glob("*.ckpt"))
    assert later == ["epoch=1-step=12.ckpt", "epoch=1-step=8.ckpt"]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=later)
    assert not problems, "\n".join(problems)


def test_a_later_steps_file_a_resumed_job_saves_alike_keeps_its_name(runs: Any) -> None:
    """Two step callbacks, every 3 and every 2 steps, each with its ``last-every<N>.ckpt``; killed after 11 batches
    and resumed from ``last-every3.ckpt`` (step 9) in its folder. The every-2 callback saves step 10 again: the same
    contents as the killed job's file (rank 0 compares, every rank follows), so no ``-v1``: every file equals the
    uninterrupted job's (``tests/test_resave_in_place.py`` has the single-process cases)."""
    cfg = {**BASE, "num_workers": 0, "ckpt_every_n_steps": [3, 2], "save_last": True}
    _resumed_in_its_folder(runs, cfg, "ddp-later-in-place", 11, ("last-every3.ckpt", 9), "every2-epoch=1-step=10.ckpt")
