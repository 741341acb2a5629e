"""What the tests of the streaming libraries share (``tests/test_streaming_libs*.py``): the runs' options, the
resume line, and a killed run resumed compared with the uninterrupted one."""

from __future__ import annotations

from typing import Any

import runner
import streaming_pipelines
from streaming_pipelines import rows

BASE: dict[str, Any] = {"batch_size": 4, "dim": streaming_pipelines.DIM, "val": "off", "max_epochs": 2}
KILL = {"ckpt_every_n_steps": 6, "kill_after_batches": 14}  # the last checkpoint: step 12, epoch 1's third batch


def base_cfg(data: str, lib: str, workers: int, **spec: Any) -> dict[str, Any]:
    """A run of ``lib``'s pipeline; ``spec``: the pipeline's options (``streaming_pipelines.train_loader``)."""
    return {**BASE, "pipeline": {"lib": lib, "data": data, **spec}, "num_workers": workers}


def resume_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def assert_same_run(ref: dict[str, Any], ref_out: str, outs: list[str], resumed: dict[str, Any]) -> None:
    """``outs``: the killed run's folder, then each run resumed from the one before (``resumed``: the last's result)."""
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert rows(runner.stitched_runs(outs)) == rows(runner.steps(ref_out)), "the logged step rows differ"
    finished = runner.epochs(outs[-1])
    assert finished, "the resumed run finished no epoch"
    assert finished == {e: v for e, v in runner.epochs(ref_out).items() if e in finished}
    streaming_pipelines.assert_same_files(ref_out, *outs)  # every file each run wrote, every value


def killed_and_resumed(runs: Any, cfg: dict[str, Any], twice: bool) -> tuple[list[str], dict[str, Any]]:
    """Killed after 14 batches and resumed from step 12; ``twice``: that run killed again after its step-18
    checkpoint and resumed from that file (a file written after a resume must hold what the uninterrupted run's
    holds, so a second resume is exact too). The folders of the runs, and the last run's result."""
    killed = runs.killed({**cfg, **KILL})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:2] == (12, 12), "the test means to resume mid-epoch 1"
    outs = [killed]
    if twice:
        again = {**cfg, **KILL, "kill_after_batches": 7, "resume": str(last)}
        _, out = runs.run(again, "killed-again", expect_kill=True)
        last = runner.checkpoints(out)[-1]
        assert runner.checkpoint_position(last)[:2] == (18, 18), "the second resume is meant from epoch 1's 9th batch"
        outs.append(out)
    resumed, out = runs.run({**cfg, "ckpt_every_n_steps": 6, "resume": str(last)}, "resumed")
    return [*outs, out], resumed
