"""The streaming libraries that split the data by rank, under DDP on 2 ranks (gloo), killed mid-epoch and resumed.

HF ``datasets.distributed.split_dataset_by_node``, litdata's own split, webdataset's ``wds.split_by_node`` +
``wds.split_by_worker`` (with ``wds.detshuffle``) and a ``torchdata.nodes`` pipeline over a ``DistributedSampler``, as
tests/streaming_pipelines.py builds them, with 2 workers a
rank (started by each rank's fork server, which preloads the library); litdata with workers 0 too. Each job runs as
two warm "nodes" (the split by rank is the libraries', Lightning's launcher is not what is tested). Every rank's steps,
the weights, the optimizer state and every value of the checkpoint files are compared with the uninterrupted job. A
file of its own so that xdist runs it beside tests/test_streaming_libs.py (the ``streaming`` stage of
scripts/test.sh).
"""

from __future__ import annotations

from typing import Any

import pytest
import runner
import streaming_pipelines
import torch
from streaming_pipelines import rows

pytestmark = [pytest.mark.streaming, pytest.mark.slow, pytest.mark.ddp]

BASE: dict[str, Any] = {"batch_size": 4, "dim": streaming_pipelines.DIM, "val": "off", "max_epochs": 3}
FORKSERVER = {"mp_context": "forkserver"}  # as tests/ddp_cases.py: a rank forking its workers itself hung once


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


# 20 items a rank, 5 or 6 batches a rank and epoch (2 workers: 3 each, the last short); checkpoints every 2 steps (the
# resumed job writes some too), killed after 9 batches: step 8, in epoch 1.
CKPT = {"ckpt_every_n_steps": 2}
DDP_KILL = {**CKPT, "kill_after_batches": 9}

# webdataset's split_by_node reads the rank in a worker from RANK and WORLD_SIZE (a fork server's worker has no
# process group): exported as torchrun does. Its workers persistent: each counts detshuffle's passes itself.
WDS = {"rank_env": True, "persistent_workers": True}

# (library, workers, extra config)
CASES = [
    pytest.param("hf", 2, {}, id="hf-split_dataset_by_node-2"),
    # workers 0; the module's on_train_batch_end moves an EMA teacher with the batch (each rank's own, kept in the
    # batch-end file); the same pipeline without the teacher was a case of its own (CI time)
    pytest.param("litdata", 0, {"teacher": True}, id="litdata-0-teacher"),
    pytest.param("litdata", 2, {}, id="litdata-2"),
    pytest.param("wds_det", 2, WDS, id="webdataset-split_by_node-detshuffle-persistent-2"),
    # torchdata.nodes: a DistributedSampler's split, the items mapped in 2 worker processes (forkserver) a rank
    # (2 epochs: the resumed job reads the rest of epoch 1)
    pytest.param("nodes", 2, {"max_epochs": 2}, id="torchdata-nodes-DistributedSampler-process-2"),
]


@pytest.mark.parametrize(("lib", "workers", "extra"), CASES)
def test_ddp_job_killed_mid_epoch_resumes_bitwise(
    runs: Any, data: str, lib: str, workers: int, extra: dict[str, Any]
) -> None:
    cfg = {**BASE, "pipeline": {"lib": lib, "data": data}, "num_workers": workers, **FORKSERVER, **extra}
    ref, ref_out = runs.ddp_reference({**cfg, **CKPT}, "nodes")
    _, killed = runs.ddp({**cfg, **DDP_KILL}, "ddp-killed", launcher="nodes", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[0] == 8
    assert runner.checkpoint_position(last)[2] == 1, "the test means to resume mid-epoch 1"
    resumed, out = runs.ddp({**cfg, **CKPT, "resume": str(last)}, "ddp-resumed", launcher="nodes")
    assert (resumed["params"], resumed["optimizer"]) == (ref["params"], ref["optimizer"])
    for rank in (0, 1):
        assert rows(runner.stitched(killed, out, rank)) == rows(runner.steps(ref_out, rank)), f"rank {rank}"
        assert resumed["ranks"][rank]["params"] == ref["params"]
    streaming_pipelines.assert_same_files(ref_out, killed, out)  # every file either job wrote: every rank's part
    for epoch in (0, 1):  # each epoch's items split between the ranks (the split may change with the epoch)
        shards = [{i for s in runner.steps(ref_out, r) if s["epoch"] == epoch for i in s["indices"]} for r in (0, 1)]
        assert not shards[0] & shards[1], "the library did not split the data by rank"
        assert shards[0] | shards[1] == set(range(streaming_pipelines.N))
    lines = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, resumed["stderr"][-3000:]  # rank 0 says it
    assert ": exact (restore verified:" in lines[0], lines[0]


def test_two_loaders_whose_lengths_differ_by_rank_resume_bitwise(runs: Any, data: str) -> None:
    """Each rank reads its own files of an HF stream, in two loaders the other way round (rank 0: shards 0-2 in the
    first, shard 3 in the second; rank 1: shard 3, then shards 0-2), no workers (the other cases have them; the
    order in which loaders run out is the point here), in a ``CombinedLoader`` of mode
    ``max_size_cycle``: the short loader runs out (and is cycled) in the second loader on rank 0 and in the first on
    rank 1, and each rank's epoch ends once its long one ran out (8 batches on both). Killed after the short ones ran
    out (checkpoint at step 5) and resumed: each rank must know which of its own loaders ran out (rank 0's mask on
    rank 1 ended its epoch 2 batches early and the job hung)."""
    pipeline = {"lib": "hf", "data": data, "pair": "max_size_cycle", "by_rank": [[0, 1, 2], [3]]}
    cfg = {**BASE, "pipeline": pipeline, "two_loaders": True, "num_workers": 0, "max_epochs": 2}
    ckpt = {"ckpt_every_n_steps": 5}
    ref, ref_out = runs.ddp_reference({**cfg, **ckpt}, "nodes")
    per_epoch = [sum(1 for s in runner.steps(ref_out, rank) if s["epoch"] == 0) for rank in (0, 1)]
    assert per_epoch == [8, 8], per_epoch
    _, killed = runs.ddp({**cfg, **ckpt, "kill_after_batches": 6}, "ddp-killed", launcher="nodes", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:3] == (5, 5, 0), "the test means to resume in epoch 0, after step 5"
    parts = torch.load(last, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"]
    assert [part.get("ran_out") for part in parts] == [2, 1], "each rank's short loader is the other one"
    resumed, out = runs.ddp({**cfg, **ckpt, "resume": str(last)}, "ddp-resumed", launcher="nodes")
    assert (resumed["params"], resumed["optimizer"]) == (ref["params"], ref["optimizer"])
    for rank in (0, 1):
        assert rows(runner.stitched(killed, out, rank)) == rows(runner.steps(ref_out, rank)), f"rank {rank}"
    streaming_pipelines.assert_same_files(ref_out, killed, out)
    lines = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, resumed["stderr"][-3000:]
    assert ": exact (restore verified:" in lines[0], lines[0]
