"""Run ``tests/scenario.py`` in fresh processes and compare runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCENARIO = Path(__file__).with_name("scenario.py")
DDP_TIMEOUT_S = 240
ROOT = SCENARIO.parents[1]


def run(cfg: dict[str, Any], *, expect_kill: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one scenario in a fresh interpreter; return its result (or {} when it was killed)."""
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ddp(
    cfg: dict[str, Any], *, launcher: str = "lightning", expect_kill: bool = False, ranks: int = 2
) -> dict[str, Any]:
    """Run a scenario on ``ranks`` gloo processes: Lightning's launcher, torchrun, or one "node" per process.

    Returns rank 0's result with every rank's result under ``"ranks"`` (or {} when the job was killed).
    """
    base_env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK"):
        base_env.pop(key, None)
    script = [str(SCENARIO)]
    if launcher == "lightning":
        config = {**cfg, "strategy": cfg.get("strategy", "ddp_repro"), "devices": ranks}
        commands = [([sys.executable, *script, json.dumps(config)], base_env)]
    elif launcher == "torchrun":
        config = {**cfg, "strategy": cfg.get("strategy", "ddp_repro"), "devices": ranks}
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1"]
        torchrun += ["--master_addr=127.0.0.1", f"--master_port={base_env['MASTER_PORT']}"]
        commands = [([*torchrun, *script, json.dumps(config)], base_env)]
    elif launcher == "nodes":
        config = {**cfg, "strategy": cfg.get("strategy", "ddp_repro"), "devices": 1, "num_nodes": ranks}
        commands = [
            (
                [sys.executable, *script, json.dumps(config)],
                {**base_env, "NODE_RANK": str(node), "LOCAL_RANK": "0", "WORLD_SIZE": str(ranks)},
            )
            for node in range(ranks)
        ]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
    logs = [Path(cfg["out"], f"job-{i}.log").open("w+") for i in range(len(commands))]  # noqa: SIM115 (closed below)
    procs = [
        subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for (command, env), log in zip(commands, logs, strict=True)
    ]
    deadline = time.monotonic() + DDP_TIMEOUT_S
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    for proc in procs:  # the whole job: ranks, their workers, fork servers, torchrun's children
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(("", log.read()))
        log.close()
    if hung:
        stderr = "\n".join(err for _, err in outputs)
        raise AssertionError(f"DDP job hung for {DDP_TIMEOUT_S} s and was killed:\n{stderr[-6000:]}")
    codes = [proc.returncode for proc in procs]
    stderr = "\n".join(err for _, err in outputs)
    if expect_kill:
        if all(code == 0 for code in codes):
            raise AssertionError(f"expected the job to be killed, it finished:\n{stderr[-4000:]}")
        return {}
    if any(code != 0 for code in codes):
        raise AssertionError(f"DDP scenario failed ({codes}):\n{stderr[-8000:]}")
    result: dict[str, Any] = json.loads(Path(cfg["out"], "result.json").read_text())
    result["ranks"] = [json.loads(Path(cfg["out"], f"result-rank{r}.json").read_text()) for r in range(ranks)]
    result["stderr"] = stderr
    return result


def steps(out: str | Path, rank: int | None = None) -> list[dict[str, Any]]:
    path = Path(out, "steps.jsonl" if rank is None else f"steps-rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stitched(interrupted: str | Path, resumed: str | Path, rank: int | None = None) -> list[dict[str, Any]]:
    """The interrupted run's steps before the resumed run's first step, then the resumed run's."""
    after = steps(resumed, rank)
    if not after:
        return steps(interrupted, rank)
    first = (after[0]["epoch"], after[0]["batch_idx"])
    before = [s for s in steps(interrupted, rank) if (s["epoch"], s["batch_idx"]) < first]
    return before + after


def checkpoints(out: str | Path) -> list[Path]:
    return sorted(Path(out, "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


def epochs(out: str | Path) -> dict[int, dict[str, str]]:
    """Epoch-level logged values per finished epoch (the last record of an epoch wins)."""
    path = Path(out, "epochs.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["epoch"]: r["values"] for r in records}
