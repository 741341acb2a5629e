"""The streaming libraries that split the data by rank, under DDP on 2 ranks (gloo), killed mid-epoch and resumed.

HF ``datasets.distributed.split_dataset_by_node`` and litdata's own split, as tests/streaming_pipelines.py builds
them; every rank's steps and the weights compared with the uninterrupted job. A file of its own so that xdist runs it
beside tests/test_streaming_libs.py (the ``streaming`` stage of scripts/test.sh).
"""

from __future__ import annotations

from typing import Any

import pytest
import runner
import streaming_pipelines

pytestmark = [pytest.mark.streaming, pytest.mark.slow, pytest.mark.ddp]

BASE: dict[str, Any] = {"batch_size": 4, "dim": streaming_pipelines.DIM, "val": "off", "max_epochs": 2}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


def _rows(steps: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in steps]


# 20 items a rank, 5 batches a rank and epoch; checkpoints every 4 steps, killed after 9 batches: step 8, in epoch 1.
# Workers 0: the split by rank is the library's (workers are tests/test_streaming_libs.py's part), and no worker
# re-imports the library through a fork server (seconds each).
DDP_KILL = {"ckpt_every_n_steps": 4, "kill_after_batches": 9}


@pytest.mark.parametrize("lib", ["hf", "litdata"], ids=["hf-split_dataset_by_node", "litdata"])
def test_ddp_job_killed_mid_epoch_resumes_bitwise(runs: Any, data: str, lib: str) -> None:
    cfg = {**BASE, "pipeline": {"lib": lib, "data": data}, "num_workers": 0}
    ref, ref_out = runs.ddp_reference({**cfg, "ckpt_every_n_steps": 4})
    _, killed = runs.ddp({**cfg, **DDP_KILL}, "ddp-killed", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[0] == 8
    assert runner.checkpoint_position(last)[2] == 1, "the test means to resume mid-epoch 1"
    resumed, out = runs.ddp({**cfg, "ckpt_every_n_steps": 4, "resume": str(last)}, "ddp-resumed")
    assert (resumed["params"], resumed["optimizer"]) == (ref["params"], ref["optimizer"])
    for rank in (0, 1):
        assert _rows(runner.stitched(killed, out, rank)) == _rows(runner.steps(ref_out, rank)), f"rank {rank}"
        assert resumed["ranks"][rank]["params"] == ref["params"]
    for epoch in (0, 1):  # each epoch's items split between the ranks (the split may change with the epoch)
        shards = [{i for s in runner.steps(ref_out, r) if s["epoch"] == epoch for i in s["indices"]} for r in (0, 1)]
        assert not shards[0] & shards[1], "the library did not split the data by rank"
        assert shards[0] | shards[1] == set(range(streaming_pipelines.N))
    lines = [line for line in resumed["stderr"].splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, resumed["stderr"][-3000:]  # rank 0 says it
    assert ": exact (restore verified:" in lines[0], lines[0]
