"""Run ``tests/scenario.py`` in fresh processes and compare runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCENARIO = Path(__file__).with_name("scenario.py")
ROOT = SCENARIO.parents[1]


def run(cfg: dict[str, Any], *, expect_kill: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one scenario in a fresh interpreter; return its result (or {} when it was killed)."""
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
    )
    if expect_kill:
        if proc.returncode != 17:
            raise AssertionError(
                f"expected the run to be killed (exit 17), got {proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        return {}
    if proc.returncode != 0:
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(Path(cfg["out"], "result.json").read_text())
    result["stderr"] = proc.stderr
    return result


def steps(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out, "steps.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stitched(interrupted: str | Path, resumed: str | Path) -> list[dict[str, Any]]:
    """The interrupted run's steps before the resumed run's first step, then the resumed run's."""
    after = steps(resumed)
    if not after:
        return steps(interrupted)
    first = (after[0]["epoch"], after[0]["batch_idx"])
    before = [s for s in steps(interrupted) if (s["epoch"], s["batch_idx"]) < first]
    return before + after


def checkpoints(out: str | Path) -> list[Path]:
    return sorted(Path(out, "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


def epochs(out: str | Path) -> dict[int, dict[str, str]]:
    """Epoch-level logged values per finished epoch (the last record of an epoch wins)."""
    path = Path(out, "epochs.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["epoch"]: r["values"] for r in records}
