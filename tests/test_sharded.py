"""FSDP2 (``ModelParallelStrategy``, data parallel 2) on CPU over gloo: a killed job resumes bitwise.

Two ranks launched by Lightning, ``fully_shard`` on each ``Linear`` and on the whole net, dropout, AdamW and a
scheduler, a shuffled loader with augmentation and 2 workers. One uninterrupted reference job (with the step trace)
is shared by every case; one job checkpoints at step 3 (mid-epoch: 6 batches per rank and epoch) and step 6 (the
epoch's last batch) in the distributed layout (a directory) and is killed hard after 8 batches; it is resumed from
each. The single-file layout, bf16, the seeding rule under tensor parallelism and the topology rule are in
``tests/test_sharded_topology.py``.
"""

from __future__ import annotations

import os
import shutil
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
    "sharded": {"dp": 2, "tp": 1},
    "strategy": "model_parallel_repro",
    "max_epochs": 2,
    "num_workers": 2,
    "mp_context": "forkserver",  # workers of a rank started by a fork server (see tests/test_ddp.py)
    "trace": True,
    "ckpt_every_n_steps": 3,  # every job: the resumed jobs' checkpoints are compared with the reference's
}
KILL = {"kill_after_batches": 8}
IGNORED = (  # as tests/test_sharded_topology.py: the checkout's state when each fit started, the entry's seal
    "/callbacks/DeterminismCallback/manifest/code/",
    "/callbacks/DeterminismCallback/entry_sha256",
)


def _per_rank(out: str, rank: int, resumed: str | None = None) -> list[tuple[Any, ...]]:
    records = runner.stitched(out, resumed, rank) if resumed else runner.steps(out, rank)
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in records]


@pytest.fixture(scope="module")
def reference(runs: Any) -> tuple[dict[str, Any], str]:
    return runs.ddp_reference(SHARDED, NODES)


@pytest.fixture(scope="module")
def killed(runs: Any) -> list[Path]:
    _, out = runs.ddp_reference({**SHARDED, **KILL}, NODES, expect_kill=True)
    return runner.checkpoints(out)


def test_the_reference_seeds_data_parallel_ranks_apart_and_initialises_alike(
    reference: tuple[dict[str, Any], str],
) -> None:
    result, out = reference
    ranks = result["ranks"]
    # identical init on every rank before sharding, and the gathered shards are that init
    assert ranks[0]["init"] == ranks[1]["init"] == ranks[0]["init_full"] == ranks[1]["init_full"]
    assert ranks[0]["params"] != ranks[1]["params"]  # each rank digests its own shard
    rank0, rank1 = runner.steps(out, 0), runner.steps(out, 1)
    assert len(rank0) == len(rank1) == 12
    assert all(a["dropout"] != b["dropout"] for a, b in zip(rank0, rank1, strict=True))  # masks differ per rank
    for epoch in (0, 1):  # the two data-parallel ranks split each epoch
        seen = [i for steps in (rank0, rank1) for s in steps if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(seen) == list(range(96))


def test_the_checkpoint_is_a_directory_with_every_rank_s_entry(killed: list[Path]) -> None:
    assert [p.name for p in killed] == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    for path in killed:
        assert path.is_dir()
        assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        meta = torch.load(path / "meta.pt", weights_only=True)  # where Lightning keeps the non-tensor state
        entry = meta["callbacks"]["DeterminismCallback"]
        assert entry["topology"]["world_size"] == 2
        assert "data_parallel_size" not in entry["topology"]  # data parallel only: as DDP writes it
        parts = entry["ranks"]
        assert len(parts) == 2
        assert parts[0]["restore_sha256"]["parameters"] != parts[1]["restore_sha256"]["parameters"]  # per shard


def test_inspect_reads_the_directory(killed: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_repro.cli.main import main

    assert main(["inspect", str(killed[0])]) == 0
    out = capsys.readouterr().out
    assert "sealed, every part checks" in out
    assert "world size 2" in out
    assert "rank 1: 3 batch(es) of the epoch read" in out


def test_inspect_finds_a_directory_missing_or_cutting_a_tensor_file(
    killed: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # it read only meta.pt, and said "sealed, every part checks" of a directory torch cannot load
    from lightning_repro.cli.main import main

    shard = sorted(p.name for p in killed[0].glob("*.distcp"))[-1]
    damages = {
        "cut": (lambda d: os.truncate(d / shard, 100), f"its tensor file {shard} is cut short (100 bytes"),
        "shard-gone": (lambda d: (d / shard).unlink(), f"its tensor file {shard} is missing"),
        "index-gone": (lambda d: (d / ".metadata").unlink(), "its .metadata (the index of its tensor files) is missi"),
    }
    for name, (damage, said) in damages.items():
        copy = tmp_path / name / killed[0].name
        shutil.copytree(killed[0], copy)
        damage(copy)
        assert main(["inspect", str(copy)]) == 1, name
        assert f"{copy}: damaged: {said}" in capsys.readouterr().out
    assert main(["inspect", str(killed[0] / shard)]) == 2  # one file of it: its directory is what to pass
    assert f"is one file of a distributed checkpoint: pass its directory, {str(killed[0])!r}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def resumed(runs: Any, killed: list[Path]) -> Any:
    """The killed job resumed from its checkpoint ``which`` (0: mid-epoch, traced; 1: the epoch's end), once each."""
    done: dict[int, tuple[dict[str, Any], str]] = {}

    def resume(which: int) -> tuple[dict[str, Any], str]:
        if which not in done:
            # the continuation check appends to the killed job's trace files: one resume of it is traced
            cfg = {**SHARDED, "trace": which == 0, "resume": str(killed[which])}
            done[which] = runs.ddp(cfg, f"sharded-resumed-{which}", launcher=NODES)
        return done[which]

    return resume


@pytest.mark.parametrize("which", [0, 1], ids=["mid-epoch", "epoch-end"])
def test_killed_job_resumes_bitwise(
    resumed: Any, reference: tuple[dict[str, Any], str], killed: list[Path], which: int
) -> None:
    expected, ref_out = reference
    checkpoint = killed[which]
    traced = which == 0
    result, out = resumed(which)
    for rank in (0, 1):
        assert result["ranks"][rank]["params"] == expected["ranks"][rank]["params"], f"rank {rank} shard"
        assert result["ranks"][rank]["optimizer"] == expected["ranks"][rank]["optimizer"], f"rank {rank} state"
        assert _per_rank(str(checkpoint.parents[1]), rank, out) == _per_rank(ref_out, rank), f"rank {rank} steps"
    assert result["lr"] == expected["lr"]
    for rank in (0, 1):  # the logged values (epoch aggregates and torchmetrics states restored), rank by rank
        assert result["ranks"][rank]["metrics"] == expected["ranks"][rank]["metrics"], f"rank {rank} logged"
    step = 3 if which == 0 else 6
    [line] = [s for s in result["stderr"].splitlines() if s.startswith("lightning-repro: resumed from")]
    assert f"at step {step}" in line
    # (not ": exact": a checkout edited between the killed and the resumed job makes the manifest say so)
    assert "(restore verified: parameters, optimizer, lr_schedulers, process streams, data position" in line
    if traced:
        for rank in (0, 1):
            assert f"[rank: {rank}] continuation verified: steps 4..8 bitwise" in result["stderr"]
        assert "lightning-repro: continuation verified on every rank (2): steps 4..8 bitwise" in result["stderr"]
    # the checkpoint decisions, and every value of the directories the resumed job writes: meta.pt (the entry too)
    # and the shards' tensors, whole, by SHA-256
    later = [p.name for p in runner.checkpoints(ref_out) if runner.checkpoint_position(p)[0] > step]
    assert later == (["epoch=0-step=6.ckpt"] if step == 3 else []) + ["epoch=1-step=9.ckpt", "epoch=1-step=12.ckpt"]
    untraced = () if traced else tuple(f"/callbacks/DeterminismCallback/ranks[{r}]/trace" for r in (0, 1))
    assert not runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED + untraced, names=later)


def test_diff_reads_the_traces_of_a_sharded_job(
    resumed: Any, reference: tuple[dict[str, Any], str], killed: list[Path], tmp_path: Path
) -> None:
    """The killed job's traces (a file per rank, the resume appended) equal the reference's: ``diff`` says so."""
    from lightning_repro.cli.main import main
    from lightning_repro.trace import diff_trace_paths

    resumed(0)  # its steps 4..12 appended to the killed job's trace files
    for path in Path(reference[1], "ckpt").glob("trace-rank*.jsonl"):  # the reference's, beside its checkpoints
        shutil.copy(path, tmp_path)
    ref_out = str(tmp_path)
    found = diff_trace_paths(ref_out, killed[0].parent)
    assert sorted(found.a) == sorted(found.b) == [0, 1]
    assert not any(d.diverged for d in found.diffs)
    for rank, trace in found.b.items():  # the killed job's steps 1..8, then the resumed job's 4..12, appended
        assert [run.resumed_from_step for run in trace.runs] == [None, 3]
        assert [r.step for r in trace.records] == list(range(1, 13))
        assert [r.step for r in trace.records if r.params] == [10]  # the shards' digest, every 10 steps
        assert {r.rank for r in trace.records} == {rank}
    assert main(["diff", ref_out, str(killed[0].parent)]) == 0


DOCTOR_TARGET = '''
import lightning.pytorch as pl
import scenario
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def trained():
    """The sharded job's model as its distributed checkpoint holds it (unsharded: torch's converter), and a batch."""
    dcp_to_torch_save(CHECKPOINT, "weights.pt")  # the shards' tensors, whole, into one file
    model = scenario.Model({**scenario.DEFAULTS, **CFG, "out": "."})
    model.load_state_dict(torch.load("weights.pt", weights_only=True)["state_dict"])  # strict: every tensor
    g = torch.Generator().manual_seed(0)
    return model, (torch.randn(8, model.cfg["dim"], generator=g), torch.randn(8, 1, generator=g), torch.arange(8))
'''


def test_doctor_replays_a_sharded_job_s_checkpoint(
    killed: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``doctor TARGET`` on the model a distributed checkpoint holds: replayed unsharded, with the job's trained
    weights and its dropout, it is bitwise equal (the step, every module's output and gradient)."""
    import json
    import sys

    from test_doctor import GOOD_ENV

    from lightning_repro.cli import doctor
    from lightning_repro.cli.main import main

    cfg = {k: v for k, v in SHARDED.items() if k not in ("sharded", "strategy", "trace")}
    source = f"CHECKPOINT = {str(killed[0])!r}\nCFG = {cfg!r}\n{DOCTOR_TARGET}"
    (tmp_path / "sharded_target.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(doctor, "collect_environment", lambda: dict(GOOD_ENV))
    try:
        assert main(["doctor", "sharded_target:trained", "--json"]) == 0
    finally:
        sys.modules.pop("sharded_target", None)
    report = json.loads(capsys.readouterr().out)
    assert report["replay"]["clean"], report["replay"]
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)["state_dict"]
    shards = runner.checkpoint_values(killed[0], killed[0].parents[1])
    for name, tensor in weights.items():  # the replayed weights are the job's: each whole tensor, by SHA-256
        digest = runner.flat_values({"t": tensor})["/t"]
        assert shards[f"/<distributed>/state_dict/{name}"] == digest, name


def test_a_sharded_teacher_moved_in_the_modules_hook_resumes_bitwise(runs: Any) -> None:
    """DINO under FSDP2: the module's ``on_train_batch_end`` moves an EMA teacher sharded as the student (a DTensor
    buffer, each rank its shard) and logs its sum (``full_tensor()``: a collective in the hook, then ``sync_dist``);
    ``ModelCheckpoint(every_n_train_steps=4)`` saves before the hook runs. Killed after 6 batches and resumed from
    step 4 (workers 2): every rank runs the hook again for the checkpoint's batch, so the teacher's shards in every
    later directory, the epoch means logged and the training equal the uninterrupted job's. The scheduler is a
    OneCycleLR sized by ``estimated_stepping_batches``: the train loader is built in ``configure_optimizers``, which
    the sharded strategy runs before it restores the checkpoint (the loader got no position: the resume replayed the
    epoch from its first batch, "restore check failed: data position differs")."""
    cfg = {**SHARDED, "trace": False, "teacher": True, "ckpt_every_n_steps": 4, "scheduler": "onecycle"}
    expected, ref_out = runs.ddp(cfg, "sharded-teacher-ref", launcher=NODES)
    killed_job = {**cfg, "kill_after_batches": 6}
    _, killed = runs.ddp(killed_job, "sharded-teacher-killed", launcher=NODES, expect_kill=True)
    checkpoint = Path(killed, "ckpt", "epoch=0-step=4.ckpt")
    entry = torch.load(checkpoint / "meta.pt", weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["remainder"]["callbacks"] == [["<LightningModule>", -1]]
    result, out = runs.ddp({**cfg, "resume": str(checkpoint)}, "sharded-teacher-resumed", launcher=NODES)
    [line] = [s for s in result["stderr"].splitlines() if s.startswith("lightning-repro: resumed from")]
    assert "NOT exact" not in line
    for rank in (0, 1):
        assert result["ranks"][rank]["params"] == expected["ranks"][rank]["params"], f"rank {rank} shard"
        assert result["ranks"][rank]["optimizer"] == expected["ranks"][rank]["optimizer"], f"rank {rank} state"
    synced = [  # the values synced across the ranks (train_loss_epoch is each rank's own: the last writer wins)
        {e: {k: v for k, v in values.items() if k != "train_loss_epoch"} for e, values in runner.epochs(o).items()}
        for o in (out, ref_out)
    ]
    assert synced[0] == synced[1]
    assert "teacher_epoch" in synced[0][0]
    later = [p.name for p in runner.checkpoints(ref_out) if runner.checkpoint_position(p)[0] > 4]
    assert later == ["epoch=1-step=8.ckpt", "epoch=1-step=12.ckpt"]
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED, names=later)
    assert not problems, "\n".join(problems)
    teacher = [k for k in runner.checkpoint_values(Path(out, "ckpt", later[-1]), out) if "teacher" in k]
    assert teacher, "the teacher's shards are in the checkpoint"


def test_each_ranks_own_batchnorm_statistics_come_back(runs: Any) -> None:
    """FSDP2 leaves BatchNorm's running statistics plain, each rank's own (updated by its batches); the distributed
    checkpoint keeps one copy of them. Validation every 3 batches (``sync_dist``: every rank's statistics count),
    killed after 7 batches, resumed from ``last.ckpt`` (step 6) in its folder: every file equals the uninterrupted
    job's (before, the ranks resumed with one rank's statistics: the validation losses differed, the resume said
    "restore check failed"); each rank's own statistics are in the entry."""
    cfg = {**SHARDED, "trace": False, "batchnorm": True, "val": 3, "ckpt_every_n_steps": 3, "save_last": True}
    expected, ref_out = runs.ddp(cfg, "sharded-bn-ref", launcher=NODES)
    _, out = runs.ddp({**cfg, "kill_after_batches": 7}, "sharded-bn-killed", launcher=NODES, expect_kill=True)
    checkpoint = Path(out, "ckpt", "last.ckpt")
    parts = torch.load(checkpoint / "meta.pt", weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"]
    means = [part["replica"]["buffers"]["net.1.running_mean"] for part in parts]
    assert not torch.equal(means[0], means[1]), "the ranks' statistics are meant to differ"
    result = runner.run_ddp({**cfg, "out": out, "resume": str(checkpoint)}, launcher=NODES)
    [line] = [s for s in result["stderr"].splitlines() if s.startswith("lightning-repro: resumed from")]
    assert ": exact (restore verified: parameters," in line, line
    for rank in (0, 1):
        assert result["ranks"][rank]["params"] == expected["ranks"][rank]["params"], f"rank {rank} shard"
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
