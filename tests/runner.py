"""Run ``tests/scenario.py`` (and other scripts) in their own processes and compare runs.

Each run is its own process. By default it is forked from a warm fork server (``tests/forkserver.py``,
started once per pytest process) that has torch, numpy and Lightning imported, which saves the ~6 s a fresh
interpreter spends importing them; ``REPRO_TEST_FORKSERVER=0`` runs every command in a fresh interpreter
instead (the digests are the same either way).
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

SCENARIO = Path(__file__).with_name("scenario.py")
FORKSERVER = Path(__file__).with_name("forkserver.py")
DDP_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
KILLED = -signal.SIGKILL
"""The exit code of a scenario run that killed itself (``kill_after_batches``: SIGKILL, as a scheduler does)."""
ROOT = SCENARIO.parents[1]
# what every run's interpreter starts with (the fork server's too)
RUN_ENV = {"PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# read once when an interpreter (or torch's thread pools) starts: a command that sets them otherwise than the
# fork server runs in a fresh interpreter
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC_")
_DISTRIBUTED_KEYS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run: this process's, without a distributed job's variables, with ``RUN_ENV``."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_KEYS}
    return {**env, **RUN_ENV, **(extra or {})}


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


class _ForkServer:
    """The client side of ``tests/forkserver.py``: one server per pytest process, started on first use."""

    def __init__(self) -> None:
        self.env = run_env()
        self.log = tempfile.NamedTemporaryFile(prefix="repro-forkserver-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(FORKSERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=self.env,
            cwd=ROOT,
        )
        self.lock = threading.Lock()
        self.ready = False

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with self.lock:
            if not self.ready:
                self._read()  # the server's {"ready": true} once its imports are done
                self.ready = True
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the fork server died:\n{self.log.read().decode(errors='replace')[-4000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def can_run(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and _startup_vars(env) == _startup_vars(self.env)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


_SERVER: _ForkServer | None = None


def start_fork_server() -> None:
    """Start this process's fork server in the background (its imports take seconds); a no-op when started."""
    global _SERVER
    if _SERVER is None and os.environ.get("REPRO_TEST_FORKSERVER", "1") != "0":
        _SERVER = _ForkServer()
        atexit.register(_SERVER.close)


class Job:
    """A started ``python ARGS`` in its own session: forked from the fork server or a fresh interpreter."""

    def __init__(self, args: list[str], *, env: dict[str, str], stdout: Path, stderr: Path, cwd: Path) -> None:
        self.returncode: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        start_fork_server()
        if _SERVER is not None and _SERVER.can_run(env):
            message = {"op": "spawn", "argv": args, "cwd": str(cwd), "env": env}
            self.pid = int(_SERVER.request({**message, "stdout": str(stdout), "stderr": str(stderr)})["pid"])
            return
        with stdout.open("ab") as out:
            err: IO[bytes] | int = subprocess.STDOUT if stderr == stdout else stderr.open("ab")
            self._popen = subprocess.Popen(
                [sys.executable, *args], env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True
            )
            if not isinstance(err, int):
                err.close()
        self.pid = self._popen.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            else:
                assert _SERVER is not None
                self.returncode = _SERVER.request({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds; the exit code (``-SIGNAL`` when a signal ended it), else None."""
        deadline = time.monotonic() + timeout
        pause = 0.005
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        return self.returncode

    def kill_group(self) -> None:
        """Kill what is left of the job's process group (its workers, fork servers, ranks), then reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait(60)


def execute(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT_S,
    while_running: Callable[[list[Job]], None] | None = None,
) -> tuple[int, str, str]:
    """Run ``python ARGS`` with ``run_env(env)`` to its end (its process group killed after ``timeout`` s).

    Returns its exit code (``-SIGNAL`` when a signal ended it), stdout and stderr. ``while_running([job])`` is
    called every few milliseconds while it runs (to signal it from outside, say).
    """
    with tempfile.TemporaryDirectory(prefix="repro-run-") as tmp:
        stdout, stderr = Path(tmp, "stdout"), Path(tmp, "stderr")
        job = Job(args, env=run_env(env), stdout=stdout, stderr=stderr, cwd=Path.cwd())
        if while_running is None:
            code = job.wait(timeout)
        else:
            deadline = time.monotonic() + timeout
            while (code := job.poll()) is None and time.monotonic() < deadline:
                while_running([job])
                time.sleep(0.01)
        job.kill_group()
        if code is None:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stderr=stderr.read_bytes())
        return code, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")


def run(
    cfg: dict[str, Any],
    *,
    expect_kill: bool = False,
    exit_code: int | None = None,
    env: dict[str, str] | None = None,
    while_running: Callable[[list[Job]], None] | None = None,
) -> dict[str, Any]:
    """Run one scenario in its own process; return its result (only ``{"stderr": ...}`` when it was killed).

    ``exit_code``: the run is expected to end with this code before it writes a result (a run stopped by a signal,
    say); returns ``{"stderr": ...}`` then. ``while_running``: see :func:`execute`.
    """
    code, _, stderr = execute([str(SCENARIO), json.dumps(cfg)], env=env, while_running=while_running)
    if expect_kill:
        if code != KILLED:
            raise AssertionError(f"expected the run to be killed (SIGKILL), got {code}:\n{stderr[-4000:]}")
        return {"stderr": stderr}
    if exit_code is not None:
        if code != exit_code or Path(cfg["out"], "result.json").exists():
            raise AssertionError(f"expected the run to stop with exit {exit_code}, got {code}:\n{stderr[-4000:]}")
        return {"stderr": stderr}
    if code != 0:
        raise AssertionError(f"scenario failed ({code}):\n{stderr[-6000:]}")
    result: dict[str, Any] = json.loads(Path(cfg["out"], "result.json").read_text())
    result["stderr"] = stderr
    return result


def _free_port() -> int:
    """A port that was free a moment ago: a job that finds it taken is run again on another (``run_ddp``)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# rank 0's TCPStore could not listen: another process took the port between _free_port and the bind
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
PORT_ATTEMPTS = 3
FAILED_GRACE_S = 20  # once a process of the job failed, how long the others may take to notice before they are killed


def _ddp_commands(
    cfg: dict[str, Any], launcher: str, ranks: int, port: int
) -> list[tuple[list[str], dict[str, str]]]:
    """The processes to start for one job: ``(python args, environment)`` each."""
    base_env = run_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if cfg.get("unset_hash_seed"):  # as a user's shell starts it (a fresh interpreter: not the fork server's)
        del base_env["PYTHONHASHSEED"]
    script = str(SCENARIO)
    config = {**cfg, "strategy": cfg.get("strategy", "ddp_repro"), "devices": ranks}
    if launcher == "lightning":
        return [([script, json.dumps(config)], base_env)]
    if launcher == "torchrun":
        torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1"]
        torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
        return [([*torchrun, script, json.dumps(config)], base_env)]
    if launcher == "nodes":
        config = {**config, "devices": 1, "num_nodes": ranks}
        node_env = {"LOCAL_RANK": "0", "WORLD_SIZE": str(ranks)}
        own = config.get("node_env") or {}  # a node's own variables (its machine), by node rank
        return [
            ([script, json.dumps(config)], {**base_env, **node_env, "NODE_RANK": str(n), **own.get(str(n), {})})
            for n in range(ranks)
        ]
    if launcher == "slurm":  # srun's tasks: one process per rank, SLURM's variables (SLURMEnvironment reads them)
        slurm = {"SLURM_NTASKS": str(ranks), "SLURM_NTASKS_PER_NODE": str(ranks), "SLURM_NODELIST": "127.0.0.1"}
        tasks = [{"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(ranks)]
        return [([script, json.dumps(config)], {**base_env, **slurm, **task}) for task in tasks]
    raise ValueError(f"unknown launcher {launcher!r}")


def _run_job(
    cfg: dict[str, Any],
    launcher: str,
    ranks: int,
    expect_kill: bool,
    timeout: float = DDP_TIMEOUT_S,
    while_running: Callable[[list[Job]], None] | None = None,
) -> tuple[list[int | None], str]:
    """Start the job's processes, wait for them (``timeout`` s), kill what is left; their codes and logs.

    ``while_running(jobs)`` is called every few milliseconds while they run (to signal them from outside, say).
    """
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    commands = _ddp_commands(cfg, launcher, ranks, _free_port())
    logs = [out / f"job-{i}.log" for i in range(len(commands))]
    jobs = [
        Job(args, env=env, stdout=log, stderr=log, cwd=ROOT) for (args, env), log in zip(commands, logs, strict=True)
    ]
    deadline = time.monotonic() + timeout
    pause = 0.005
    while time.monotonic() < deadline:
        if while_running is not None:
            while_running(jobs)
        codes = [job.poll() for job in jobs]
        if all(code is not None for code in codes):
            break
        if any(code not in (None, 0) and not (expect_kill and code == KILLED) for code in codes):
            deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
        time.sleep(pause)
        pause = min(0.05, pause * 2)
    codes = [job.poll() for job in jobs]
    for job in jobs:  # the whole job: ranks, their workers, fork servers, torchrun's children
        job.kill_group()
    return codes, "\n".join(log.read_text(errors="replace") for log in logs)


def run_ddp(
    cfg: dict[str, Any],
    *,
    launcher: str = "lightning",
    expect_kill: bool = False,
    exit_code: int | None = None,
    ranks: int = 2,
    timeout: float = DDP_TIMEOUT_S,
    while_running: Callable[[list[Job]], None] | None = None,
) -> dict[str, Any]:
    """Run a scenario on ``ranks`` gloo processes: Lightning's launcher, torchrun, or one "node" per process.

    Returns rank 0's result with every rank's result under ``"ranks"`` (or {} when the job was killed). A job that
    has not ended after ``timeout`` s fails the call (its processes are killed). ``exit_code``: every process started
    is expected to end with this code before the job writes a result (a job stopped by a signal); returns
    ``{"stderr": ...}`` then. ``while_running``: see :func:`_run_job`. A job whose rendezvous port was taken by
    another process meanwhile is run again on another port.
    """
    for attempt in range(PORT_ATTEMPTS):
        codes, stderr = _run_job(cfg, launcher, ranks, expect_kill, timeout, while_running)
        if not any(code not in (0, KILLED) for code in codes) or not _PORT_TAKEN.search(stderr):
            break
        if attempt + 1 < PORT_ATTEMPTS:
            shutil.rmtree(cfg["out"])  # nothing trained: the port is taken before the first step
    if any(code is None for code in codes):
        raise AssertionError(f"DDP job hung for {timeout} s and was killed ({codes}):\n{stderr[-6000:]}")
    if expect_kill:
        if all(code == 0 for code in codes):
            raise AssertionError(f"expected the job to be killed, it finished:\n{stderr[-4000:]}")
        return {}
    if exit_code is not None:
        if any(code != exit_code for code in codes) or Path(cfg["out"], "result.json").exists():
            raise AssertionError(f"expected the job to stop with exit {exit_code}, got {codes}:\n{stderr[-6000:]}")
        return {"stderr": stderr}
    if any(code != 0 for code in codes):
        raise AssertionError(f"DDP scenario failed ({codes}):\n{stderr[-8000:]}")
    result: dict[str, Any] = json.loads(Path(cfg["out"], "result.json").read_text())
    result["ranks"] = [json.loads(Path(cfg["out"], f"result-rank{r}.json").read_text()) for r in range(ranks)]
    result["stderr"] = stderr
    return result


def signal_when_reached(out: str | Path, ranks: int, signum: int) -> Callable[[list[Job]], None]:
    """A ``while_running`` for :func:`run_ddp` (``ranks=1``: :func:`run`): once every rank wrote
    ``<out>/reached-rank<R>`` (the scenario's
    ``reached_marker_at``), send ``signum`` once to each job's whole process group (ranks, dataloader workers, fork
    servers), as a scheduler preempting the job does."""
    sent: list[bool] = []

    def check(jobs: list[Job]) -> None:
        if sent or not all(Path(out, f"reached-rank{rank}").exists() for rank in range(ranks)):
            return
        for job in jobs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.pid, signum)
        sent.append(True)

    return check


@contextlib.contextmanager
def plain_lightning_bug(what: str) -> Iterator[None]:
    """Around an assertion of the correct behaviour that plain Lightning does not have today (a control).

    The test is reported as xfailed, with the first line of the failed assertion, while Lightning has the bug,
    and passes once Lightning fixes it, so such a fix does not turn CI red. Only ``AssertionError`` raised
    inside the block counts: a run that crashed before it fails the test as usual.
    """
    try:
        yield
    except AssertionError as error:
        import pytest

        first = (str(error).splitlines() or ["assertion failed"])[0]
        pytest.xfail(f"plain Lightning: {what} ({first})")


def steps(out: str | Path, rank: int | None = None) -> list[dict[str, Any]]:
    path = Path(out, "steps.jsonl" if rank is None else f"steps-rank{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_steps(out: str | Path, rank: int | None = None) -> list[tuple[Any, ...]]:
    """Every step of a run's folder, the last record of a step winning (a run resumed in the folder of the one it
    resumes appends to its steps file): ``((epoch, batch_idx), global_step, indices, loss, dropout)`` each."""
    last = {(s["epoch"], s["batch_idx"]): s for s in steps(out, rank)}
    return [(k, s["global_step"], s["indices"], s["loss"], s["dropout"]) for k, s in sorted(last.items())]


def csv_rows(out: str | Path, *, drop_empty: bool = False) -> list[dict[str, str]]:
    """The rows of the scenario's CSV logger (``csv_logger``; none before the logger first wrote its file);
    ``drop_empty``: each row without its empty cells (a file written earlier in the run has fewer columns)."""
    path = Path(out, "logs", "metrics.csv")
    if not path.exists():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in row.items() if v != ""} for row in rows] if drop_empty else rows


def stitched(interrupted: str | Path, resumed: str | Path, rank: int | None = None) -> list[dict[str, Any]]:
    """The interrupted run's steps before the resumed run's first step, then the resumed run's."""
    return stitched_runs([interrupted, resumed], rank)


def stitched_runs(outs: list[str | Path], rank: int | None = None) -> list[dict[str, Any]]:
    """The steps of runs each resumed from a checkpoint of the one before: each run's steps before the next run's
    first step, then the last run's."""
    rows: list[dict[str, Any]] = []
    for out in outs:
        after = steps(out, rank)
        if after:
            first = (after[0]["epoch"], after[0]["batch_idx"])
            rows = [s for s in rows if (s["epoch"], s["batch_idx"]) < first] + after
    return rows


def checkpoint_position(path: str | Path) -> tuple[int, int, int]:
    """Where in training a checkpoint was written, read from the file: (global step, batches started, epoch).

    A distributed checkpoint (a directory, ``ModelParallelStrategy``) is read from its metadata file (``meta.pt``).
    """
    import torch

    if Path(path).is_dir():
        path = Path(path, "meta.pt")
    checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    batches = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    return int(checkpoint["global_step"]), int(batches.get("total", {}).get("ready", 0)), int(checkpoint["epoch"])


def stream_record(path: str | Path, rank: int = 0, loader: int = 0) -> dict[str, Any]:
    """The per-worker position of a streaming train loader in a checkpoint's entry (its ``streaming`` field)."""
    import torch

    entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
    record: dict[str, Any] = entry["ranks"][rank]["streaming"][str(loader)]
    return record


def checkpoints(out: str | Path) -> list[Path]:
    """The checkpoints in ``<out>/ckpt``, the latest last: ordered by the position stored in each file.

    Not by modification time, whose resolution and clock can tie or misorder files written in one second.
    """
    return sorted(Path(out, "ckpt").glob("*.ckpt"), key=lambda p: (checkpoint_position(p), p.name))


def killed_then_resumed(cfg: dict[str, Any], out: Path, *, workers: int = 2) -> dict[str, Any]:
    """``cfg`` checkpointed every 5 steps and killed hard after 8 batches (``out/killed``), then resumed in a
    fresh process from its last checkpoint (``out/resumed``), both with ``workers``: the resumed run's result."""
    killed = {**cfg, "num_workers": workers, "ckpt_every_n_steps": 5, "kill_after_batches": 8}
    run({**killed, "out": str(out / "killed")}, expect_kill=True)
    last = checkpoints(out / "killed")[-1]
    return run({**cfg, "num_workers": workers, "resume": str(last), "out": str(out / "resumed")})


def epochs(out: str | Path) -> dict[int, dict[str, str]]:
    """Epoch-level logged values per finished epoch (the last record of an epoch wins)."""
    path = Path(out, "epochs.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["epoch"]: r["values"] for r in records}


def _distributed_tensors(path: Path) -> dict[str, Any]:
    """The tensors (and other values) a distributed checkpoint keeps through ``torch.distributed.checkpoint``, read
    in this process without a process group: every sharded tensor whole, as the ranks saved its shards."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def flat_values(value: Any, out: str | Path = "") -> dict[str, str]:
    """Every value of a nest of dicts, lists and tensors by its key path (see :func:`checkpoint_values`)."""
    import hashlib

    import torch

    root = str(out)
    flat: dict[str, str] = {}

    def plain(text: str) -> str:
        return text.replace(root, "<out>") if root else text

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{plain(str(key))}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item)
        elif isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            flat[prefix] = f"{value.dtype} {tuple(value.shape)} {hashlib.sha256(data).hexdigest()}"
        elif isinstance(value, float):
            flat[prefix] = value.hex()
        elif isinstance(value, str):
            flat[prefix] = repr(plain(value))
        else:
            flat[prefix] = repr(value)

    walk("", value)
    return flat


def checkpoint_values(path: str | Path, out: str | Path) -> dict[str, str]:
    """Every value a checkpoint holds, by its key path, comparable between runs in different directories.

    Tensors by dtype, shape and a SHA-256 of their bytes, floats by their bits, other values by ``repr``; the run's
    directory ``out`` is written ``<out>`` in every key and string (``ModelCheckpoint`` keeps absolute paths). A
    distributed checkpoint (a directory, ``ModelParallelStrategy``): the values of its ``meta.pt``, and under
    ``/<distributed>`` those its shard files hold (weights and optimizer states, each tensor whole).
    """
    import torch

    path = Path(path)
    if not path.is_dir():
        return flat_values(torch.load(path, weights_only=True, map_location="cpu"), out)
    meta = torch.load(path / "meta.pt", weights_only=True, map_location="cpu")
    return {**flat_values(meta, out), **flat_values({"<distributed>": _distributed_tensors(path)}, out)}


def compare_checkpoint_files(
    expected: str | Path, got: str | Path, *, ignore: tuple[str, ...] = (), names: list[str] | None = None
) -> list[str]:
    """What differs between the checkpoints two runs keep in ``<out>/ckpt`` (an empty list: nothing).

    The file (or distributed checkpoint folder) names, then every value of each (:func:`checkpoint_values`), except
    the key paths starting with one of ``ignore``. ``names``: the files ``got`` must keep, each compared with the
    file of that name ``expected`` keeps (a resumed run writes those after its checkpoint); default: the same files.
    """
    found = {run: sorted(p.name for p in Path(run, "ckpt").glob("*.ckpt")) for run in (expected, got)}
    wanted = found[expected] if names is None else sorted(names)
    problems = [] if found[got] == wanted else [f"files: {wanted} != {found[got]}"]
    for name in sorted(set(wanted) & set(found[expected]) & set(found[got])):
        values = [checkpoint_values(Path(run, "ckpt", name), run) for run in (expected, got)]
        keys = sorted(set(values[0]) | set(values[1]))
        differ = [k for k in keys if not k.startswith(ignore) and values[0].get(k) != values[1].get(k)]
        if differ:
            shown = ", ".join(f"{k} ({values[0].get(k)} != {values[1].get(k)})" for k in differ[:3])
            problems.append(f"{name}: {len(differ)} value(s) differ: {shown}")
    return problems
