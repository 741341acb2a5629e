"""Helpers for users' own test suites: a training is reproducible, and it resumes bit for bit.

Example (a pytest test module of your project)::

    from lightning_repro.testing import assert_reproducible, assert_resume_bitwise

    def make_module():  # module level: the resume check imports it in fresh processes
        return MyModel(hidden=16)

    def make_data():  # a DataLoader or a LightningDataModule
        return DataLoader(MyDataset(64), batch_size=8, shuffle=True)

    def test_reproducible():
        assert_reproducible(make_module, make_data, max_steps=4)

    def test_resumes_bitwise():
        assert_resume_bitwise(make_module, make_data, stop_at=(2, 5), max_steps=8)

:func:`assert_reproducible` trains twice in this process. :func:`assert_resume_bitwise` runs every training in a
fresh process, forked from a ``multiprocessing`` forkserver that has torch and Lightning imported (``spawn`` where
there is no forkserver), so ``make_module`` and ``make_data`` must be importable: module-level functions, or
``"module:function"`` strings. The runs are quiet: no logger, progress bar or summary, and a child's output goes to a
log whose end is shown when the child fails. When the step trace is available (``DeterminismCallback(trace=...)``),
every run writes one and a failure message includes ``lightning-repro diff``'s explanation.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import logging
import os
import signal
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_repro.callback import DeterminismCallback
from lightning_repro.checkpoint.verify import digest_value
from lightning_repro.exceptions import InputError
from lightning_repro.manifest.fingerprint import digest_tensors
from lightning_repro.stats.process import end_process_group, fork_server, lead_process_group
from lightning_repro.trace.diff import diff_trace_paths

__all__ = ["assert_reproducible", "assert_resume_bitwise"]

_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)
KILLED = -_KILL
"""The exit code of a run killed hard (``SIGKILL``, as by the OOM killer) right after its checkpoint was written."""
_QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}


class _Recorder(Callback):
    """Appends ``{"step", "loss"}`` (the loss's exact bits) per training batch to a JSON-lines file, at once."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        bits = float(loss).hex() if loss is not None else None
        with open(self.path, "a") as file:
            file.write(json.dumps({"step": trainer.global_step, "loss": bits}) + "\n")


class _Stopper(Callback):
    """Writes a checkpoint after optimizer step ``step`` and kills the process at once (``SIGKILL``)."""

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            os.kill(os.getpid(), _KILL)


def _explain(a: Path, b: Path) -> str:
    """``lightning-repro diff``'s finding for the two runs' traces (rank by rank), or ``""`` when one is missing."""
    if not (a.exists() and b.exists()):
        return ""
    try:
        return f"\ntrace diff: {diff_trace_paths(a, b)}"
    except InputError as error:  # the explanation is a bonus: never hide the failure behind it
        return f"\n(no trace diff: {error})"


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _train(
    make_module: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    *,
    seed: int,
    max_steps: int,
    trainer_kwargs: dict[str, Any] | None,
    steps: Path,
    trace: Path,
    stop: _Stopper | None = None,
    resume: str | None = None,
    save: str | None = None,
) -> dict[str, Any]:
    """One training (in this process); returns the SHA-256 of the final weights and optimizer state."""
    extra: dict[str, Any] = {"trace": str(trace)}
    callback = DeterminismCallback(seed, **extra)  # before the model: its initialisation is pinned
    module, data = make_module(), make_data()
    options = {**_QUIET, **(trainer_kwargs or {})}
    theirs = options.pop("callbacks", None) or []  # each run a copy of them as given: their state does not carry over
    theirs = copy.deepcopy(list(theirs) if isinstance(theirs, (list, tuple)) else [theirs])
    callbacks: list[Callback] = [callback, _Recorder(str(steps)), *theirs, *([stop] if stop else [])]
    with _quiet_lightning():
        trainer = pl.Trainer(callbacks=callbacks, max_steps=max_steps, **options)
        if isinstance(data, pl.LightningDataModule):
            trainer.fit(module, datamodule=data, ckpt_path=resume)
        else:
            trainer.fit(module, data, ckpt_path=resume)
        if save:
            trainer.save_checkpoint(save)
    return {
        "weights": digest_tensors(module.state_dict()),
        "optimizer": digest_value([optimizer.state_dict() for optimizer in trainer.optimizers]),
        "global_step": trainer.global_step,
    }


def _check_trainer_kwargs(trainer_kwargs: dict[str, Any] | None) -> None:
    """Refuse ``max_steps`` (the helper's own argument) and ``callbacks`` that are not callbacks."""
    if trainer_kwargs and "max_steps" in trainer_kwargs:
        raise ValueError("pass `max_steps` as the helper's own argument, not in `trainer_kwargs`")
    theirs = (trainer_kwargs or {}).get("callbacks") or []
    if not all(isinstance(c, Callback) for c in (theirs if isinstance(theirs, (list, tuple)) else [theirs])):
        raise TypeError(f"`trainer_kwargs['callbacks']` must be a Callback or a list of them, got {theirs!r}")


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Put back what ``DeterminismCallback`` set process-wide: streams, deterministic flags, CUBLAS_WORKSPACE_CONFIG."""
    import torch

    from lightning_repro.rng import capture_process_streams, restore_process_streams

    streams, cublas = capture_process_streams(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        yield
    finally:
        restore_process_streams(streams)
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def _losses(path: Path) -> dict[int, str | None]:
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): r["loss"] for r in records}


def _first_loss_difference(expected: dict[int, Any], got: dict[int, Any]) -> str:
    for step in sorted(set(expected) | set(got)):
        if expected.get(step) != got.get(step):
            return f"the loss of step {step} differs: {expected.get(step)} vs {got.get(step)}"
    return ""


def _differences(expected: dict[str, Any], got: dict[str, Any], losses: str) -> list[str]:
    found = [losses] if losses else []
    for key, what in (("global_step", "the global step"), ("weights", "the final weights' SHA-256")):
        if expected[key] != got[key]:
            found.append(f"{what} differs: {expected[key]} vs {got[key]}")
    if expected["optimizer"] != got["optimizer"]:
        found.append("the final optimizer state differs")
    return found


def assert_reproducible(
    make_module: Callable[[], pl.LightningModule],
    make_data: Callable[[], Any],
    *,
    seed: int = 0,
    max_steps: int = 4,
    trainer_kwargs: dict[str, Any] | None = None,
) -> None:
    """Train twice in this process with ``DeterminismCallback(seed)`` and assert both runs are bitwise equal.

    Compared: every step's loss (exact bits, the first step's first), the final weights' and optimizer state's
    SHA-256, and the global step.

    Args:
        make_module: Returns a new ``LightningModule`` (called after the callback pinned the RNG streams).
        make_data: Returns the train ``DataLoader`` (or a ``LightningDataModule``).
        seed: The run's seed.
        max_steps: How many optimizer steps each run trains.
        trainer_kwargs: More ``Trainer`` arguments (the defaults are quiet: no logger, progress bar, summary or
            checkpointing); ``callbacks`` run beside the helper's, each run with a copy of them as given.

    What the callback sets process-wide (the RNG streams, torch's and cuDNN's deterministic flags,
    ``CUBLAS_WORKSPACE_CONFIG``) is put back as it was when the helper returns.

    Raises:
        AssertionError: the two runs differ; the message says where.
        ValueError: ``trainer_kwargs`` holds ``max_steps`` (the helper's own argument).
        TypeError: ``trainer_kwargs["callbacks"]`` is not a Callback or a list of them.
    """
    _check_trainer_kwargs(trainer_kwargs)
    with tempfile.TemporaryDirectory(prefix="lightning-repro-") as tmp, _process_state_kept():
        root = Path(tmp)
        runs = [
            _train(
                make_module,
                make_data,
                seed=seed,
                max_steps=max_steps,
                trainer_kwargs=trainer_kwargs,
                steps=root / f"steps-{name}.jsonl",
                trace=root / f"trace-{name}.jsonl",
            )
            for name in ("a", "b")
        ]
        losses = _first_loss_difference(_losses(root / "steps-a.jsonl"), _losses(root / "steps-b.jsonl"))
        found = _differences(runs[0], runs[1], losses)
        if found:
            raise AssertionError(
                f"two trainings with seed {seed} ({max_steps} steps) are not bitwise equal: " + "; ".join(found)
                + _explain(root / "trace-a.jsonl", root / "trace-b.jsonl")
            )


# ---------------------------------------------------------------------------------------- fresh processes
def _reference(value: Any, name: str) -> str:
    """``"module:function"`` of a module-level function (a fresh process imports it)."""
    if isinstance(value, str):
        if ":" not in value:
            raise ValueError(f"`{name}` must be 'module:function', got {value!r}")
        return value
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not callable(value) or not module or module == "__main__" or "<" in qualname:
        raise TypeError(
            f"`{name}` must be an importable module-level function or a 'module:function' string (each run is a"
            f" fresh process that imports it), got {value!r}"
        )
    return f"{module}:{qualname}"


def _resolve(reference: str) -> Any:
    module_name, _, path = reference.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _child(config: dict[str, Any]) -> None:
    """One run in a fresh process: output to its log, the result to ``result.json``."""
    lead_process_group()  # its workers die with it when it is killed hard (`_run`)
    with open(config["log"], "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    stop = _Stopper(config["kill_at"], config["checkpoint"]) if config.get("kill_at") else None
    result = _train(
        _resolve(config["make_module"]),
        _resolve(config["make_data"]),
        seed=config["seed"],
        max_steps=config["max_steps"],
        trainer_kwargs=config["trainer_kwargs"],
        steps=Path(config["steps"]),
        trace=Path(config["trace"]),
        stop=stop,
        resume=config.get("resume"),
        save=config.get("save"),
    )
    Path(config["result"]).write_text(json.dumps(result))


def _run(context: Any, config: dict[str, Any], timeout: float, expected: int) -> dict[str, Any]:
    process = context.Process(target=_child, args=(config,))  # not a daemon: its loaders may start workers
    process.start()
    try:
        process.join(timeout)
    finally:  # timed out, or Ctrl-C here: the run does not outlive it, nor do its workers
        if process.exitcode is None:
            process.kill()
            process.join()
        end_process_group(process.pid)
    if process.exitcode != expected:
        tail = Path(config["log"]).read_text(errors="replace")[-3000:] if Path(config["log"]).exists() else ""
        raise RuntimeError(f"a training run ended with exit code {process.exitcode}, not {expected}:\n{tail}")
    result: dict[str, Any] = json.loads(Path(config["result"]).read_text()) if expected == 0 else {}
    return result


def assert_resume_bitwise(
    make_module: Callable[[], pl.LightningModule] | str,
    make_data: Callable[[], Any] | str,
    *,
    stop_at: Sequence[int] = (2,),
    hard_kill: bool = True,
    seed: int = 0,
    max_steps: int = 4,
    trainer_kwargs: dict[str, Any] | None = None,
    timeout: float = 300.0,
) -> None:
    """Assert that a training stopped at each step of ``stop_at`` and resumed continues bit for bit.

    Every training runs in a fresh process: once uninterrupted to ``max_steps``, then for each ``k`` in ``stop_at``
    once stopped after step ``k`` with a checkpoint (``hard_kill``: ``SIGKILL`` right after the checkpoint is
    written; else the run ends at ``max_steps=k`` and saves one) and once resumed from that checkpoint to
    ``max_steps``. Compared with the uninterrupted run: every step's loss (exact bits), the final weights' and
    optimizer state's SHA-256, the global step.

    Args:
        make_module: A module-level function returning a new ``LightningModule``, or ``"module:function"``.
        make_data: A module-level function returning the train ``DataLoader`` or a ``LightningDataModule``, or
            ``"module:function"``.
        stop_at: The optimizer steps after which a run is stopped (each in ``[1, max_steps - 1]``).
        hard_kill: Kill the stopped run hard right after its checkpoint, instead of ending it normally.
        seed: The run's seed.
        max_steps: How many optimizer steps the whole training has.
        trainer_kwargs: More ``Trainer`` arguments (picklable; ``callbacks`` run beside the helper's).
        timeout: Seconds each run may take.

    Raises:
        AssertionError: a resumed run differs from the uninterrupted one; the message says where, for each stop.
        TypeError: ``make_module`` or ``make_data`` cannot be imported by a fresh process.
        ValueError: a step of ``stop_at`` is not in ``[1, max_steps - 1]``.
        RuntimeError: a run crashed (the message holds the end of its output).
    """
    _check_trainer_kwargs(trainer_kwargs)
    for step in stop_at:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 < step < max_steps:
            raise ValueError(f"`stop_at` must hold steps in [1, {max_steps - 1}] (max_steps - 1), got {step!r}")
    base = {
        "make_module": _reference(make_module, "make_module"),
        "make_data": _reference(make_data, "make_data"),
        "seed": seed,
        "trainer_kwargs": trainer_kwargs,
    }
    preload = ["torch", "lightning.pytorch", "lightning_repro"]
    with fork_server(preload) as context, tempfile.TemporaryDirectory(prefix="lightning-repro-") as tmp:
        root = Path(tmp)

        def files(name: str) -> dict[str, str]:
            return {key: str(root / f"{name}-{key}.{ext}") for key, ext in _FILES}

        reference = _run(context, {**base, **files("reference"), "max_steps": max_steps}, timeout, 0)
        expected = _losses(root / "reference-steps.jsonl")
        report = []
        for k in stop_at:
            stopped, resumed = files(f"stop{k}"), files(f"resume{k}")
            checkpoint = str(root / f"stop{k}.ckpt")
            shared = {"steps": stopped["steps"], "trace": stopped["trace"]}  # one record, as one run would write
            if hard_kill:
                _run(context, {**base, **stopped, "max_steps": max_steps, "kill_at": k, "checkpoint": checkpoint},
                     timeout, KILLED)  # fmt: skip
            else:
                _run(context, {**base, **stopped, "max_steps": k, "save": checkpoint}, timeout, 0)
            got = _run(context, {**base, **resumed, **shared, "max_steps": max_steps, "resume": checkpoint}, timeout, 0)
            losses = _first_loss_difference(expected, _losses(Path(stopped["steps"])))
            found = _differences(reference, got, losses)
            if found:
                how = "killed" if hard_kill else "stopped"
                explanation = _explain(root / "reference-trace.jsonl", Path(stopped["trace"]))
                report.append(f"{how} after step {k} and resumed: " + "; ".join(found) + explanation)
        if report:
            raise AssertionError(
                f"a resumed training (seed {seed}, {max_steps} steps) does not continue bitwise:\n" + "\n".join(report)
            )


_FILES = (("log", "log"), ("result", "json"), ("steps", "jsonl"), ("trace", "jsonl"))
