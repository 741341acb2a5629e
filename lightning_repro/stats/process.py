"""One seed of a training function in a fresh process: the target, the child's side, and what came back.

:func:`run_in_fresh_process` starts a process (``spawn``, or ``forkserver``, which imports ``lightning_repro``
once in its server and forks a child per seed), calls ``fn(seed)`` there with its stdout and stderr in a log
file, and returns a :class:`SeedOutcome`: the metric values, or a :class:`SeedFailure` naming the seed and
what went wrong (the exception and its traceback, or the signal or exit code of a process that died, with
the end of its log). ``lightning_repro.stats.seeds`` builds the statistics on top.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.context
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_repro.exceptions import InputError
from lightning_repro.seeding import export_hash_seed

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = [
    "HASH_SEED",
    "START_METHODS",
    "SeedFailure",
    "SeedOutcome",
    "StartMethod",
    "TrainFunction",
    "describe_target",
    "end_process_group",
    "fork_server",
    "lead_process_group",
    "module_from_path",
    "resolve_target",
    "run_in_fresh_process",
]

StartMethod = Literal["spawn", "forkserver"]
START_METHODS: tuple[str, ...] = ("spawn", "forkserver")
TrainFunction = Callable[[int], Mapping[str, Any]]
HASH_SEED = 0
"""``PYTHONHASHSEED`` of the seeds' processes when the parent's is not fixed: the same for every seed and both
start methods, so a seed's result depends on the seed alone."""
_LOG_TAIL_LINES = 20
_STARTED = ("started",)  # the child's first message: it is up, its function is about to run
_START_LIMIT_S = 600.0
_JOIN_GRACE_S = 30.0


def resolve_target(target: str) -> TrainFunction:
    """The function a ``"module:function"`` (or ``"path/to/file.py:function"``) string names.

    Raises:
        InputError: the string is malformed, the module cannot be imported, or the name is missing or not callable.
    """
    module_name, sep, name = target.rpartition(":")
    if not sep or not module_name or not name:
        raise InputError(f"TARGET must be 'module:function' or 'path/to/file.py:function', got {target!r}")
    try:
        if module_name.endswith(".py"):
            module = module_from_path(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except InputError:
        raise
    except Exception as error:
        raise InputError(
            f"TARGET {target!r}: cannot import {module_name!r} ({type(error).__name__}: {error}); run from the"
            " directory that holds it, or add that directory to PYTHONPATH"
        ) from error
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise InputError(f"TARGET {target!r}: module {module_name!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"TARGET {target!r}: {name!r} is a {type(obj).__name__}, not a function taking a seed")
    function: TrainFunction = obj
    return function


def module_from_path(path: Path) -> Any:
    """Import the Python file ``path`` (a ``path/to/file.py:function`` TARGET) as a module of its own.

    Raises:
        InputError: no such file, or not a Python file.
    """
    if not path.is_file():
        raise InputError(f"TARGET: no file {str(path)!r}")
    name = f"lightning_repro_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"TARGET: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def describe_target(fn: str | TrainFunction) -> str:
    """The name a report gives ``fn``; checks that a callable can be sent to a fresh process (by name).

    Raises:
        InputError: a string target that :func:`resolve_target` refuses.
        TypeError: a callable that cannot be pickled (a lambda, a function defined inside another).
    """
    if isinstance(fn, str):
        resolve_target(fn)
        return fn
    if not callable(fn):
        raise TypeError(f"`fn` must be a function taking a seed or a 'module:function' string, got {fn!r}")
    try:
        pickle.dumps(fn)
    except Exception as error:
        raise TypeError(
            f"`fn` must be a module-level function (it is sent to a fresh process by name), got {fn!r}"
            f" ({type(error).__name__}: {error}); define it at the top level of a module, or pass"
            " 'module:function'"
        ) from error
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module == "__main__":  # a script's function: name the script
        module = getattr(sys.modules["__main__"], "__file__", None) or module
    return f"{module}:{qualname}" if module and qualname else repr(fn)


@dataclass(frozen=True)
class SeedFailure:
    """A seed whose run did not return metrics: ``reason`` is one line, ``details`` a traceback or a log tail."""

    seed: int
    reason: str
    details: str = ""

    def __str__(self) -> str:
        return f"seed {self.seed}: {self.reason}"


@dataclass(frozen=True)
class SeedOutcome:
    """What one seed's process gave back: ``values`` (metric -> float) or ``failure``.

    ``bad`` holds the values that are not numbers (metric -> description) and ``not_a_mapping`` a description of
    a result that is not a dict; both are the user's function's fault, reported as bad input.
    """

    seed: int
    values: dict[str, float] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)
    not_a_mapping: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    failure: SeedFailure | None = None


@contextlib.contextmanager
def fork_server(preload: list[str]) -> Iterator[Any]:
    """A ``forkserver`` context whose server imports ``preload`` once; the process's preload list put back after.

    multiprocessing keeps one fork server per process, started at its first use with the modules set then. The
    server (and the resource tracker it starts) is left running, as multiprocessing leaves it: stopping either waits
    for it to exit, which a run's orphaned worker can hold off for as long as it lives (the CI's suite hung in the
    tracker's). The preload list set for it is put back, so a server started again later (after a fork, say) imports
    what the process had asked for. A server running before is used as it is. ``spawn`` where there is no fork
    server (the platform has none).
    """
    try:
        context: Any = multiprocessing.get_context("forkserver")
    except ValueError:  # no forkserver on this platform
        yield multiprocessing.get_context("spawn")
        return
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # the process's singleton
    before = list(getattr(server, "_preload_modules", ["__main__"]))
    context.set_forkserver_preload(preload)  # read only when the server starts: this block's first process
    try:
        yield context
    finally:
        context.set_forkserver_preload(before)


def lead_process_group() -> None:
    """Make this (fresh) process the leader of a process group of its own, which what it starts joins.

    A run's dataloader workers, and the fork server a process forked from a fork server starts them through, live in
    its group: :func:`end_process_group` ends them with it. Otherwise a run killed hard left them running for good
    (their parent, that fork server, lived on; they held what the run held open). Nothing where the platform has no
    process groups.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpgid(0, 0)


def end_process_group(pid: int | None) -> None:
    """``SIGKILL`` what is left of the process group ``pid`` led (:func:`lead_process_group`), once it has ended."""
    if pid is None or pid <= 1:  # never started; never the whole session or every process
        return
    with contextlib.suppress(AttributeError, OSError):  # ProcessLookupError: nothing left (or no group made)
        os.killpg(pid, signal.SIGKILL)


def run_in_fresh_process(
    fn: str | TrainFunction, seed: int, *, start_method: StartMethod, log_path: Path, timeout: float | None
) -> SeedOutcome:
    """Run ``fn(seed)`` in a new process; its output goes to ``log_path``. Never raises for the run's faults."""
    context: multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext
    if start_method == "forkserver":  # the server imports `__main__` and lightning_repro once (`fork_server`)
        context = multiprocessing.get_context("forkserver")
    else:
        context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child, args=(fn, seed, str(log_path), sender), name=f"lightning-repro seed {seed}", daemon=False
    )
    undo = export_hash_seed(HASH_SEED)  # read when the interpreter (or the fork server) starts
    try:
        process.start()
    finally:
        undo()
        sender.close()
    message: Any = None
    timed_out = False
    try:
        # the seed's time starts once its process is up: a fork server's first start (its imports) is not counted
        if receiver.poll(_START_LIMIT_S) and receiver.recv() == _STARTED and receiver.poll(timeout):
            message = receiver.recv()
        else:
            timed_out = True
    except EOFError:  # the process ended without sending: it crashed or exited
        pass
    except BaseException:  # Ctrl-C or another error here: the seed's process does not outlive it
        process.kill()
        process.join()
        end_process_group(process.pid)
        raise
    finally:
        receiver.close()
    if timed_out:
        process.kill()
    process.join(_JOIN_GRACE_S)
    if process.exitcode is None:
        process.kill()
        process.join()
    end_process_group(process.pid)  # its workers (and their fork server), left by a seed killed or crashed
    if message is None:
        reason = f"did not finish within {timeout} s; its process was killed" if timed_out else _death(process.exitcode)
        return SeedOutcome(seed, failure=SeedFailure(seed, reason, _log_tail(log_path)))
    kind = message[0]
    if kind == "error":
        return SeedOutcome(seed, failure=SeedFailure(seed, f"raised {message[1]}", message[2]))
    if kind == "not_a_mapping":
        return SeedOutcome(seed, not_a_mapping=message[1])
    return SeedOutcome(seed, values=message[1], bad=message[2], environment=message[3])


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"its process was killed by {signal.Signals(-code).name} before returning a result"
        return f"its process was killed by signal {-code} before returning a result"
    return f"its process exited with code {code} before returning a result"


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    if not lines:
        return ""
    return f"last lines of its output ({path}):\n" + "\n".join(lines[-_LOG_TAIL_LINES:])


# ------------------------------------------------------------------------------------------- the child's side
def _child(fn: str | TrainFunction, seed: int, log_path: str, connection: Connection) -> None:
    """Run in the seed's process: call ``fn(seed)`` and send back the values, or the error with its traceback."""
    lead_process_group()
    _redirect_output(log_path)
    connection.send(_STARTED)
    message: tuple[Any, ...]
    try:
        function = resolve_target(fn) if isinstance(fn, str) else fn
        result = function(seed)
        if isinstance(result, Mapping):
            values, bad = _numbers(result)
            message = ("ok", values, bad, _environment())
        else:
            message = ("not_a_mapping", f"returned {type(result).__name__}, not a dict of metric name -> number")
    except BaseException as error:  # everything goes back to the parent, which names the seed
        traceback.print_exc()  # into the log too
        message = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    connection.send(message)
    connection.close()


def _redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so native code's too) to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr)  # a crash in native code leaves the Python stack in the log


def _numbers(result: Mapping[Any, Any]) -> tuple[dict[str, float], dict[str, str]]:
    values: dict[str, float] = {}
    bad: dict[str, str] = {}
    for key, value in result.items():
        name = str(key)
        try:  # python and numpy numbers, one-element tensors; not text ("0.5" reads as a number to float())
            if isinstance(value, (str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):  # OverflowError: an int past float's range
            bad[name] = f"{type(value).__name__} {value!r:.60}"
            continue
        values[name] = number  # non-finite values too: the statistics say which seed gave them
    return values, bad


def _environment() -> dict[str, str]:
    """The environment the seed ran in (a manifest summary can take this place)."""
    from lightning_repro.manifest.fingerprint import environment_fingerprint

    return environment_fingerprint()
