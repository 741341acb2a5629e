"""DDP on CPU (gloo, real processes): rank-aware seeding and bitwise resume of a killed job.

Two ranks, launched three ways: Lightning's own launcher (``devices=2``), ``torchrun
--nproc_per_node=2``, and two "nodes" of one process each on loopback (``num_nodes=2``,
``NODE_RANK`` 0 and 1). The whole job is killed hard (``os._exit`` on every rank) a few steps
after a ``ModelCheckpoint`` and resumed; weights and optimizer state must equal those of the
uninterrupted job, and every rank's per-step sample indices, losses and dropout masks too.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import runner
import torch

pytestmark = [pytest.mark.ddp, pytest.mark.slow]

# 96 samples, batch 8, 2 ranks: 6 batches per rank and epoch
BASE: dict[str, Any] = {"max_epochs": 2}
KILL = {"ckpt_every_n_steps": 4, "kill_after_batches": 6}  # checkpoint mid-epoch, killed two steps later
# Workers of a rank are started by a fork server: forking them from a rank process itself hung once in ~20
# runs here, inside os.fork() (CPython's thread-state lock held by another thread at the moment of the fork).
FORKSERVER = {"mp_context": "forkserver"}


def _per_rank(out: str, rank: int, resumed: str | None = None) -> list[tuple[Any, ...]]:
    records = runner.stitched(out, resumed, rank) if resumed else runner.steps(out, rank)
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in records]


@pytest.mark.parametrize(
    ("launcher", "num_workers"),
    [("lightning", 0), ("lightning", 2), ("torchrun", 0), ("nodes", 0)],
    ids=["devices=2-workers0", "devices=2-workers2", "torchrun", "two-nodes"],
)
def test_killed_job_resumes_bitwise(runs: Any, launcher: str, num_workers: int) -> None:
    cfg = {**BASE, "num_workers": num_workers, **FORKSERVER}
    reference, ref_out = runs.ddp_reference(cfg, launcher)
    _, killed = runs.ddp_reference({**cfg, **KILL}, launcher, expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-resumed", launcher=launcher)
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    assert resumed["global_step"] == reference["global_step"]
    for rank in (0, 1):
        assert _per_rank(killed, rank, out) == _per_rank(ref_out, rank), f"rank {rank} diverged"
        assert resumed["ranks"][rank]["params"] == reference["params"]  # every rank ends with the same weights


def test_each_rank_traces_and_verifies_its_continuation(runs: Any) -> None:
    """Under DDP each rank writes its own trace; a resumed job checks every rank's steps against the killed job's."""
    from lightning_repro.trace import diff_trace_paths, diff_traces

    cfg = {**BASE, "num_workers": 0}
    reference, _ = runs.ddp_reference(cfg, "lightning")
    _, killed = runs.ddp({**cfg, **KILL, "trace": True}, "ddp-traced-killed", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    resumed, _ = runs.ddp({**cfg, "trace": True, "resume": str(checkpoint)}, "ddp-traced-resumed")
    assert resumed["params"] == reference["params"]  # tracing changes nothing
    found = diff_trace_paths(checkpoint.parent, checkpoint.parent)  # the directory of per-rank files, read
    assert sorted(found.a) == [0, 1]
    for rank, trace in found.a.items():
        assert [run.resumed_from_step for run in trace.runs] == [None, 4]
        assert [r.step for r in trace.records] == list(range(1, reference["global_step"] + 1))
        assert {r.rank for r in trace.records} == {rank}
        assert f"[rank: {rank}] continuation verified: steps 5..6 bitwise" in resumed["stderr"]
    # what the user sees: one line per resume and one per continuation check, from rank 0 only
    said = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: ")]
    [resume] = [line for line in said if line.startswith("lightning-repro: resumed from")]
    assert ": exact (restore verified: " in resume
    assert "continuation check: steps 5..6 of the trace" in resume
    assert len([line for line in said if line.startswith("lightning-repro: continuation verified: steps 5..6")]) == 1
    between_ranks = diff_traces(found.a[0], found.a[1])  # the ranks read other samples from the first step
    assert (between_ranks.first_divergent_step, between_ranks.cause) == (1, "data-order")


def test_ranks_are_seeded_apart_but_start_alike(runs: Any) -> None:
    reference, ref_out = runs.ddp_reference({**BASE, "num_workers": 0}, "lightning")
    # with a logger: trainer.log_dir, where the manifest goes, is a collective that every rank must reach
    again, again_out = runs.ddp({**BASE, "num_workers": 0, "max_epochs": 1, "csv_logger": True}, "ddp-again")
    assert [p.relative_to(again_out).as_posix() for p in Path(again_out).rglob("repro_manifest.json")] == [
        "logs/repro_manifest.json"
    ]
    ranks = reference["ranks"]
    assert ranks[0]["init"] == ranks[1]["init"]  # initialised identically before DDP syncs anything
    rank0, rank1 = runner.steps(ref_out, 0), runner.steps(ref_out, 1)
    assert all(a["dropout"] != b["dropout"] for a, b in zip(rank0, rank1, strict=True))  # masks differ per rank
    assert ranks[0]["hash"] == ranks[1]["hash"] == again["ranks"][0]["hash"] == again["ranks"][1]["hash"]
    # the two ranks split each epoch: no sample twice, none missed
    for epoch in (0, 1):
        seen = [i for rank in (0, 1) for s in runner.steps(ref_out, rank) if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(seen) == list(range(96))
    # a second job with the same seed draws the same masks and samples (it ran one epoch of the two)
    assert runner.steps(again_out, 1) == [s for s in rank1 if s["epoch"] == 0]


def test_plain_ddp_dropout(runs: Any) -> None:
    """The control: Lightning's DDP with seed_everything draws identical masks on every rank (reported as xfailed)."""
    plain, out = runs.ddp({**BASE, "num_workers": 0, "repro": False, "strategy": "ddp", "max_epochs": 1}, "plain-ddp")
    assert plain["ranks"][0]["init"] == plain["ranks"][1]["init"]
    rank0, rank1 = runner.steps(out, 0), runner.steps(out, 1)
    assert len(rank0) == len(rank1) == 6
    with runner.plain_lightning_bug("every rank draws the same dropout masks (seed_everything is not rank-aware)"):
        assert all(a["dropout"] != b["dropout"] for a, b in zip(rank0, rank1, strict=True)), "a mask is shared"


def test_two_rank_checkpoint_on_one_rank(runs: Any) -> None:
    cfg = {**BASE, "num_workers": 0}
    _, killed = runs.ddp_reference({**cfg, **KILL}, expect_kill=True)  # the job test_killed_job_resumes_bitwise kills
    checkpoint = str(runner.checkpoints(killed)[-1])
    with pytest.raises(AssertionError, match=r"TopologyError: the checkpoint was written with world size 2"):
        runs.run({**cfg, "resume": checkpoint}, "one-rank-error")
    resumed, out = runs.run({**cfg, "resume": checkpoint, "on_topology_change": "reseed"}, "one-rank-reseed")
    after = runner.steps(out)
    start = (after[0]["epoch"], after[0]["batch_idx"])
    before = [
        i
        for rank in (0, 1)
        for s in runner.steps(killed, rank)
        if (s["epoch"], s["batch_idx"]) < start
        for i in s["indices"]
    ]
    epoch0 = before + [i for s in after if s["epoch"] == 0 for i in s["indices"]]
    counts = collections.Counter(epoch0)
    assert sorted(counts) == list(range(96)), "a sample was missed"
    assert set(counts.values()) == {1}, "a sample was repeated"
    epoch1 = sorted(i for s in after if s["epoch"] == 1 for i in s["indices"])
    assert epoch1 == list(range(96))  # the next epoch is a whole one on the single rank
    assert resumed["epoch"] == 2
    assert "on_topology_change='reseed'" in resumed["stderr"]
    [line] = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: resumed from")]
    assert ": NOT exact: Resuming a checkpoint of world size 2 (1 node(s)) with world size 1 (1 node(s))" in line


def test_same_world_size_on_other_nodes(runs: Any) -> None:
    """A 1-node x 2-device checkpoint resumed as 2 nodes x 1 device: an error by default, exact with reseed."""
    cfg = {**BASE, "num_workers": 0}
    reference, ref_out = runs.ddp_reference(cfg, "lightning")
    _, killed = runs.ddp_reference({**cfg, **KILL}, expect_kill=True)
    checkpoint = str(runner.checkpoints(killed)[-1])
    with pytest.raises(AssertionError, match=r"TopologyError: the checkpoint was written with world size 2 \(1 node"):
        runs.ddp({**cfg, "resume": checkpoint}, "nodes-error", launcher="nodes")
    resumed, out = runs.ddp({**cfg, "resume": checkpoint, "on_topology_change": "reseed"}, "nodes-ok", launcher="nodes")
    assert resumed["params"] == reference["params"]  # the same ranks keep their own streams: still exact
    for rank in (0, 1):
        assert _per_rank(killed, rank, out) == _per_rank(ref_out, rank)


def test_process_group_destroyed_before_interpreter_exit(runs: Any) -> None:
    """``ReproDDPStrategy`` destroys the gloo group it created in an atexit handler, while Python still runs.

    Left to the interpreter's finalisation (plain Lightning destroys only NCCL groups), a gloo worker thread that
    releases a finished collective's tensors then aborts the process: "terminate called without an active
    exception", exit -6, once in a while under load. The scenario's own atexit handler, registered before the
    trainer, runs after ours and records whether the group was still there.
    """
    cfg = {"max_epochs": 1, "val": "off", "strategy": "ddp_repro", "report_process_group_at_exit": True}
    _, out = runs.run(cfg, "process-group")
    assert (Path(out) / "process-group-at-exit-rank0.txt").read_text() == "destroyed"


def test_killed_job_with_a_due_validation_resumes_bitwise(runs: Any) -> None:
    """A step checkpoint after which a validation is due (every 4 batches): every rank runs it on resume.

    The validation, and a checkpoint a callback writes in it, are collectives: run by rank 0 alone they would hang
    the job or part the ranks.
    """
    cfg = {**BASE, "num_workers": 0, "val": 4}
    reference, ref_out = runs.ddp_reference(cfg, "lightning")
    _, killed = runs.ddp_reference({**cfg, **KILL}, "lightning", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["pending"] is not None  # the case under test: written at a batch's end...
    assert entry["pending"]["validate"] is True  # ... after which a validation is due
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-resumed-validation", launcher="lightning")
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    for rank in (0, 1):
        assert _per_rank(killed, rank, out) == _per_rank(ref_out, rank), f"rank {rank} diverged"
