"""FSDP2 on CPU over gloo: the single-file layout with bf16, tensor parallelism, the seeding and topology rules.

The reference job trains with ``precision="bf16-mixed"`` and FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters in
the forward, fp32 gradient reduction) and writes single-file checkpoints (``save_distributed_checkpoint=False``);
one such job is killed after 8 batches and resumed from its mid-epoch checkpoint. Its checkpoint is then resumed
with tensor parallelism 2 (data parallel 1), re-dealt with ``on_topology_change="reseed"``. A
short job with tensor parallelism 2 builds its model on the meta device. The distributed layout is in
``tests/test_sharded.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import runner
import torch

pytestmark = [pytest.mark.sharded, pytest.mark.ddp, pytest.mark.slow]
# two "nodes" started warm by the tests' fork server (Lightning's launcher starts rank 1 in a fresh interpreter:
# seconds of imports a job); the tensor-parallel meta-init job keeps Lightning's launcher
NODES = "nodes"

SHARDED: dict[str, Any] = {
    "sharded": {"dp": 2, "tp": 1, "layout": "file", "mp_policy": True},
    "precision": "bf16-mixed",
    "strategy": "model_parallel_repro",
    "max_epochs": 2,
    "num_workers": 2,
    "mp_context": "forkserver",  # workers of a rank started by a fork server (see tests/test_ddp.py)
    "ckpt_every_n_steps": 3,
}
TENSOR_PARALLEL = {"dp": 1, "tp": 2, "layout": "file", "mp_policy": True}
IGNORED = (  # as tests/test_accumulate_checkpoints.py: the checkout's state when each fit started, the entry's seal
    "/callbacks/DeterminismCallback/manifest/code/",
    "/callbacks/DeterminismCallback/entry_sha256",
)


@pytest.fixture(scope="module")
def reference(runs: Any) -> tuple[dict[str, Any], str]:
    return runs.ddp_reference(SHARDED, NODES)


@pytest.fixture(scope="module")
def killed(runs: Any) -> tuple[list[Path], str]:
    _, out = runs.ddp_reference({**SHARDED, "kill_after_batches": 8}, NODES, expect_kill=True)
    return runner.checkpoints(out), out


def test_single_file_bf16_job_resumes_bitwise(
    runs: Any, reference: tuple[dict[str, Any], str], killed: tuple[list[Path], str]
) -> None:
    expected, ref_out = reference
    checkpoints, killed_out = killed
    assert [p.name for p in checkpoints] == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    assert all(p.is_file() for p in checkpoints)
    entry = torch.load(checkpoints[0], weights_only=True)["callbacks"]["DeterminismCallback"]
    assert len(entry["ranks"]) == 2  # every rank's part in the file rank 0 writes
    resumed, out = runs.ddp({**SHARDED, "resume": str(checkpoints[0])}, "sharded-file-resumed", launcher=NODES)
    for rank in (0, 1):
        assert resumed["ranks"][rank]["params"] == expected["ranks"][rank]["params"], f"rank {rank} shard"
        assert resumed["ranks"][rank]["optimizer"] == expected["ranks"][rank]["optimizer"], f"rank {rank} state"
        steps = runner.stitched(killed_out, out, rank)
        assert steps == runner.steps(ref_out, rank), f"rank {rank} steps"
    for rank in (0, 1):
        assert resumed["ranks"][rank]["metrics"] == expected["ranks"][rank]["metrics"], f"rank {rank} logged"
    assert "(restore verified: parameters, optimizer, lr_schedulers, process streams, data" in resumed["stderr"]
    # the checkpoint decisions and every value of the files the resumed job writes (full weights, optimizer, entry)
    later = ["epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "epoch=1-step=9.ckpt"]
    assert not runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=later)


def test_another_split_is_re_dealt(runs: Any, killed: tuple[list[Path], str]) -> None:
    """dp 2 x tp 1 resumed as dp 1 x tp 2 (the same world size) with "reseed": a deterministic re-deal.

    Without "reseed" it is a TopologyError (``tests/test_shards.py`` checks that rule in one process; a job spent on
    it here would cost the stage 20 s): the warning below shows the job read the split from the strategy.

    Lightning reshards the weights (a full state dict into tensor-parallel shards); the rest of the epoch, the
    samples no rank had consumed, goes to the one data-parallel replica, whose two ranks read the same batches and
    draw the same dropout masks (one stream per tensor-parallel group).
    """
    checkpoints, killed_out = killed
    cfg = {**SHARDED, "sharded": TENSOR_PARALLEL, "resume": str(checkpoints[0]), "ckpt_every_n_steps": 0}
    reseed = {**cfg, "on_topology_change": "reseed", "max_steps": 9}
    resumed, out = runs.ddp(reseed, "sharded-split-reseed", launcher=NODES)
    assert "Resuming a checkpoint of world size 2 (2 node(s)) with world size 2 (2 node(s), data parallel 1 x tensor"\
        " parallel 2) (on_topology_change='reseed')" in resumed["stderr"]
    # the shards dealt anew are not "the state restored differs" (their digests are of other shards), nor is the
    # loader's length under one replica a position "that cannot be restored exactly": both were said
    assert "SHA-256 mismatch" not in resumed["stderr"]
    assert "batches per epoch now but had" not in resumed["stderr"]
    [line] = [s for s in resumed["stderr"].splitlines() if s.startswith("lightning-repro: resumed from")]
    assert line.endswith("(restore verified: lr_schedulers)"), line
    rank0, rank1 = runner.steps(out, 0), runner.steps(out, 1)
    assert [(s["epoch"], s["global_step"]) for s in rank0] == [(0, step) for step in range(3, 9)]
    assert rank0 == rank1  # one replica: the same batches, losses and dropout masks on both ranks
    killed_steps = [s for rank in (0, 1) for s in runner.steps(killed_out, rank)]
    before = [i for s in killed_steps if s["global_step"] < 3 for i in s["indices"]]
    after = [i for s in rank0 for i in s["indices"]]
    assert sorted(before + after) == list(range(96))  # no sample of the epoch repeated or missed


def test_tensor_parallel_meta_init_is_the_unsharded_init(runs: Any, reference: tuple[dict[str, Any], str]) -> None:
    """Built on the meta device and sharded over 2 tensor-parallel ranks, the model is initialised as without
    sharding (the gathered shards equal the eagerly built model), and the group shares its streams."""
    expected, _ = reference
    sharded = {**TENSOR_PARALLEL, "empty_init": True}
    cfg = {**SHARDED, "sharded": sharded, "ckpt_every_n_steps": 0, "max_steps": 3, "num_workers": 0, "val": "off"}
    result, out = runs.ddp(cfg, "sharded-tp-meta")
    assert result["ranks"][0]["init_full"] == result["ranks"][1]["init_full"] == expected["init"]
    rank0, rank1 = runner.steps(out, 0), runner.steps(out, 1)
    assert len(rank0) == 3
    assert rank0 == rank1  # the same batches, losses and dropout masks within the tensor-parallel group
