"""DDP on CPU as two "nodes" of one process each on loopback (``num_nodes=2``, ``NODE_RANK`` 0 and 1, both started warm
by the tests' fork server): a killed job resumes bitwise, every rank traces and verifies its continuation, the
ranks are seeded apart but start alike, a two-rank checkpoint resumed on one rank, and the gloo group destroyed
before the interpreter exits.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path
from typing import Any

import pytest
import runner
from ddp_cases import BASE, KILL, killed_job_resumes_bitwise

pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.launchers]  # in the marked run of scripts/test.sh


def test_killed_job_resumes_bitwise(runs: Any) -> None:
    killed_job_resumes_bitwise(runs, "nodes", 0)


def test_a_drift_on_one_node_is_said_by_its_rank_and_in_the_resume_line(runs: Any) -> None:
    """Resumed with another thread setting on node 1 only (``MKL_NUM_THREADS``, a variable the manifest records:
    it can change the numbers): rank 1 compares with its own saved environment and finds the change; it says so in
    its log, and rank 0's resume line, whose own environment is unchanged, says NOT exact with rank 1's reason.
    Before, rank 1's drift was a note nobody saw and the line said exact."""
    cfg = {**BASE, "num_workers": 0}
    _, killed = runs.ddp_reference({**cfg, **KILL}, "nodes", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    moved = {**cfg, "resume": str(checkpoint), "node_env": {"1": {"MKL_NUM_THREADS": "1"}}}
    resumed, _ = runs.ddp(moved, "ddp-node1-drift", launcher="nodes")
    stderr = resumed["stderr"]
    [line] = [x for x in stderr.splitlines() if x.startswith("lightning-repro: resumed from")]
    assert ": NOT exact: [rank 1] The environment changed since the checkpoint was written" in line, line
    assert "[rank: 1] The environment changed since the checkpoint was written" in stderr  # rank 1's own log
    assert "environment.env.MKL_NUM_THREADS: None -> '1'" in stderr
    assert stderr.count("MKL_NUM_THREADS: None") == 2  # the line and rank 1's log: rank 0 found no drift of its own
    assert "NotExactWarning: The environment changed" not in stderr


def test_a_failed_restore_check_on_one_rank_is_in_the_resume_line(runs: Any) -> None:
    """Rank 1's module changes the optimizer state it loads (its ``on_load_checkpoint``): its restore check fails
    and says so in its log, and rank 0's resume line, whose own check passed, says NOT exact with rank 1's reason
    (it said exact before: rank 0's check only)."""
    cfg = {**BASE, "num_workers": 0}
    _, killed = runs.ddp_reference({**cfg, **KILL}, "nodes", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    changed = {**cfg, "resume": str(checkpoint), "perturb_on_load_rank": 1}
    resumed, _ = runs.ddp(changed, "ddp-rank1-restore-failed", launcher="nodes")
    stderr = resumed["stderr"]
    [line] = [x for x in stderr.splitlines() if x.startswith("lightning-repro: resumed from")]
    said = ": NOT exact: [rank 1] the state restored from the checkpoint differs from the state it saved in: optimizer"
    assert said in line, line
    assert "[rank 1] [rank 1]" not in line
    assert "[rank 0]" not in stderr  # rank 0's restore check passed


def _traced_killed_copy(runs: Any, name: str) -> Path:
    """The checkpoint of a traced job killed mid-epoch (run once), in a copy of its folder: a resumed traced job
    appends to the trace files beside the checkpoint, which another test resumes too."""
    _, killed = runs.ddp_reference({**BASE, "num_workers": 0, **KILL, "trace": True}, "nodes", expect_kill=True)
    copy = Path(runs.fresh_dir(name))
    shutil.copytree(killed, copy)
    return runner.checkpoints(str(copy))[-1]


def test_each_rank_traces_and_verifies_its_continuation(runs: Any) -> None:
    """Under DDP each rank writes its own trace; a resumed job checks every rank's steps against the killed job's,
    and rank 0 says every rank's check in one line at the end of the fit."""
    from lightning_repro.trace import diff_trace_paths, diff_traces

    cfg = {**BASE, "num_workers": 0}
    reference, _ = runs.ddp_reference(cfg, "nodes")
    checkpoint = _traced_killed_copy(runs, "ddp-traced-killed")
    resumed, _ = runs.ddp({**cfg, "trace": True, "resume": str(checkpoint)}, "ddp-traced-resumed", launcher="nodes")
    assert resumed["params"] == reference["params"]  # tracing changes nothing
    found = diff_trace_paths(checkpoint.parent, checkpoint.parent)  # the directory of per-rank files, read
    assert sorted(found.a) == [0, 1]
    for rank, trace in found.a.items():
        assert [run.resumed_from_step for run in trace.runs] == [None, 4]
        assert [r.step for r in trace.records] == list(range(1, reference["global_step"] + 1))
        assert {r.rank for r in trace.records} == {rank}
        assert f"[rank: {rank}] continuation verified: steps 5..6 bitwise" in resumed["stderr"]
    # what the user sees: one line per resume, rank 0's check when it ends, every rank's at the end of the fit
    said = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: ")]
    [resume] = [line for line in said if line.startswith("lightning-repro: resumed from")]
    assert ": exact (restore verified: " in resume
    assert "continuation check: steps 5..6 of the trace" in resume
    checks = [line for line in said if line.startswith("lightning-repro: continuation")]
    assert checks[0].startswith("lightning-repro: continuation verified on rank 0: steps 5..6 bitwise"), checks
    assert checks[1:] == ["lightning-repro: continuation verified on every rank (2): steps 5..6 bitwise"]
    between_ranks = diff_traces(found.a[0], found.a[1])  # the ranks read other samples from the first step
    assert (between_ranks.first_divergent_step, between_ranks.cause) == (1, "data-order")


def test_a_divergence_on_one_rank_is_said_by_rank_0_at_the_end_of_the_fit(runs: Any) -> None:
    """Rank 1 resumes from another optimizer state than the one it saved (its module changes it on load): its own
    steps differ from its trace from step 6 on (its loss), while rank 0's agree (DDP averages the gradients, the
    optimizer state is each rank's), so rank 0 said "continuation verified" of its own check and rank 1's divergence
    was a warning in rank 1's log only. Rank 0 now says every rank's check at the end of the fit, and warns of rank
    1's."""
    checkpoint = _traced_killed_copy(runs, "ddp-traced-killed-rank1")
    cfg = {**BASE, "num_workers": 0, "trace": True, "on_divergence": "warn", "perturb_on_load_rank": 1}
    resumed, _ = runs.ddp({**cfg, "resume": str(checkpoint)}, "ddp-traced-rank1-diverges", launcher="nodes")
    stderr = resumed["stderr"]
    said = [line for line in stderr.splitlines() if line.startswith("lightning-repro: continuation")]
    assert said[0].startswith("lightning-repro: continuation verified on rank 0: steps 5..6 bitwise"), said
    [end] = said[1:]
    assert end.startswith("lightning-repro: continuation NOT verified on every rank: [rank 1] step 6 differs"), end
    assert end.endswith("; verified on rank 0 (steps 5..6)"), end
    assert "[rank: 1] continuation check: the resumed run differs" in stderr  # rank 1's log, as before
    assert "NotExactWarning: [rank: 1] continuation check: the resumed run differs" in stderr  # rank 0's warning


def test_ranks_are_seeded_apart_but_start_alike(runs: Any) -> None:
    reference, ref_out = runs.ddp_reference({**BASE, "num_workers": 0}, "nodes")
    # with a logger: trainer.log_dir, where the manifest goes, is a collective that every rank must reach
    again_cfg = {**BASE, "num_workers": 0, "max_epochs": 1, "csv_logger": True}
    again, again_out = runs.ddp(again_cfg, "ddp-again", launcher="nodes")
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


def test_two_rank_checkpoint_on_one_rank(runs: Any) -> None:
    cfg = {**BASE, "num_workers": 0}
    _, killed = runs.ddp_reference({**cfg, **KILL}, "nodes", expect_kill=True)  # test_killed_job_resumes_bitwise's
    checkpoint = str(runner.checkpoints(killed)[-1])
    with pytest.raises(AssertionError, match=r"TopologyError: the checkpoint was written with world size 2 \(2 node"):
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
    assert ": NOT exact: Resuming a checkpoint of world size 2 (2 node(s)) with world size 1 (1 node(s))" in line
    assert "batches per epoch now but had" not in resumed["stderr"]  # the re-deal's length: not a position lost
    assert line.endswith("(restore verified: parameters, optimizer, lr_schedulers)"), line  # DDP: whole on each rank


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
