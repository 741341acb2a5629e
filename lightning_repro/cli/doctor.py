"""``lightning-repro doctor``: what decides reproducibility here, and which modules of a model replay differently.

Without a target it audits the environment: versions, hardware, determinism flags, ``PYTHONHASHSEED``,
``CUBLAS_WORKSPACE_CONFIG``, cuDNN, TF32 and thread counts. It runs in a fresh interpreter, where
:class:`~lightning_repro.DeterminismCallback` has not set anything yet, so each row says whether it is fine, will be
set by the callback, or must be fixed outside the process (and how).

With ``TARGET`` (``module:function`` returning ``(LightningModule, batch)``) it also runs one training step twice
from the same state (parameters, buffers and process streams put back in between) with forward hooks on every
submodule and a hook on every parameter's accumulated gradient, and names the modules whose outputs or gradients
differ (the first in execution order first), and the operations torch reports as having no deterministic
implementation.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_repro.checkpoint.verify import digest_value
from lightning_repro.data import fastrng as _fastrng
from lightning_repro.exceptions import InputError
from lightning_repro.manifest.fingerprint import cpu_model, environment_fingerprint
from lightning_repro.rng import capture_process_streams, restore_process_streams

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from rich.console import Console

__all__ = [
    "Finding",
    "Replay",
    "audit_environment",
    "collect_environment",
    "doctor_command",
    "load_target",
    "replay_step",
]

Status = Literal["ok", "callback", "warn", "problem"]
_NONDETERMINISTIC = " does not have a deterministic implementation"
_CUBLAS_OK = (":4096:8", ":16:8")
_LABELS = {
    "ok": "[green]ok[/]",
    "callback": "[cyan]set by DeterminismCallback[/]",
    "warn": "[yellow]warn[/]",
    "problem": "[bold red]problem[/]",
}


@dataclass(frozen=True)
class Finding:
    """One row of the audit, with its fix.

    ``status`` is ``ok``, ``callback`` (DeterminismCallback sets it), ``warn`` (matters across machines) or
    ``problem`` (breaks reproducibility and cannot be fixed inside the process).
    """

    name: str
    value: str
    status: Status = "ok"
    fix: str = ""


@dataclass
class Replay:
    """What one training step replayed from the same state did differently (empty lists: nothing)."""

    outputs: list[str] = field(default_factory=list)  # modules whose forward outputs differ, in execution order
    gradients: list[str] = field(default_factory=list)  # modules whose parameters' gradients differ
    operations: list[str] = field(default_factory=list)  # operations without a deterministic implementation
    loss_equal: bool = True
    order_equal: bool = True  # both replays called the same modules in the same order

    @property
    def clean(self) -> bool:
        """Nothing differed and no operation lacks a deterministic implementation."""
        return not (self.outputs or self.gradients or self.operations) and self.loss_equal and self.order_equal


# ---------------------------------------------------------------------------------------- the environment
def collect_environment() -> dict[str, str]:
    """Everything the audit reads, as plain strings (the environment fingerprint plus a few values of its own).

    Examples:
        >>> collect_environment()["torch"] == torch.__version__
        True
    """
    import torchmetrics

    info = dict(environment_fingerprint())
    info.update(
        {
            "torchmetrics": str(torchmetrics.__version__),
            "cpu": f"{cpu_model()} ({os.cpu_count()} logical cores)",
            "cuda_available": str(torch.cuda.is_available()),
            "cuda_initialized": str(torch.cuda.is_initialized()),  # type: ignore[no-untyped-call]
            "hash_randomization": str(sys.flags.hash_randomization),
            "interop_threads": str(torch.get_num_interop_threads()),
            "tf32_matmul": str(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": str(torch.backends.cudnn.allow_tf32),
            "seeding_kernel": _fastrng.native_status(),
        }
    )
    return info


def _flag(info: dict[str, str], key: str, name: str, good: str, fix: str) -> Finding:
    value = info.get(key, "")
    return Finding(name, value, "ok" if value == good else "callback", "" if value == good else fix)


def audit_environment(info: dict[str, str]) -> list[Finding]:
    """Judge what :func:`collect_environment` found: one :class:`Finding` per row of the table.

    Examples:
        >>> rows = {f.name: f for f in audit_environment({"hash_randomization": "1", "env:PYTHONHASHSEED": ""})}
        >>> rows["PYTHONHASHSEED"].status, rows["PYTHONHASHSEED"].fix
        ('problem', 'set PYTHONHASHSEED=0 before starting Python (it cannot be changed in a running interpreter)')
    """
    cuda = info.get("cuda_available") == "True"
    rows = [Finding(name, info.get(key, "?")) for name, key in _VERSIONS]
    rows.append(Finding("cpu", info.get("cpu", "?")))
    rows.append(Finding("gpus", info.get("gpus", "none")))
    rows += [
        _flag(info, "deterministic_algorithms", "deterministic algos", "True", "use_deterministic_algorithms(True)"),
        _flag(info, "cudnn_deterministic", "cudnn.deterministic", "True", "torch.backends.cudnn.deterministic = True"),
        _flag(info, "cudnn_benchmark", "cudnn.benchmark", "False", "torch.backends.cudnn.benchmark = False"),
    ]
    for key, name, setting in (
        ("tf32_matmul", "TF32 matmul", "torch.backends.cuda.matmul.allow_tf32"),
        ("tf32_cudnn", "TF32 cuDNN", "torch.backends.cudnn.allow_tf32"),
    ):
        value = info.get(key, "?")
        if cuda and value == "True":
            fix = f"{setting} = False: TF32 rounds differently on other GPU generations (and on CPU)"
            rows.append(Finding(name, value, "warn", fix))
        else:
            rows.append(Finding(name, value if cuda else f"{value} (no CUDA: not used)"))
    precision = info.get("float32_matmul_precision", "?")
    rows.append(
        Finding("float32 matmul precision", precision)
        if precision == "highest"
        else Finding(
            "float32 matmul precision",
            precision,
            "warn",
            "torch.set_float32_matmul_precision('highest'): lower precisions differ between hardware",
        )
    )
    seed = info.get("env:PYTHONHASHSEED", "")
    if info.get("hash_randomization") == "0":
        rows.append(Finding("PYTHONHASHSEED", seed or "0"))
    else:
        fix = "set PYTHONHASHSEED=0 before starting Python (it cannot be changed in a running interpreter)"
        rows.append(Finding("PYTHONHASHSEED", f"{seed or 'unset'} (str hashes are randomized)", "problem", fix))
    cublas = info.get("env:CUBLAS_WORKSPACE_CONFIG", "")
    if not cuda:
        rows.append(Finding("CUBLAS_WORKSPACE_CONFIG", f"{cublas or 'unset'} (no CUDA: not needed)"))
    elif cublas in _CUBLAS_OK:
        rows.append(Finding("CUBLAS_WORKSPACE_CONFIG", cublas))
    elif info.get("cuda_initialized") == "True":
        fix = "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process touches CUDA"
        rows.append(Finding("CUBLAS_WORKSPACE_CONFIG", cublas or "unset", "problem", fix))
    else:
        fix = "DeterminismCallback sets :4096:8 before CUDA starts (create it before anything touches CUDA)"
        rows.append(Finding("CUBLAS_WORKSPACE_CONFIG", cublas or "unset", "callback", fix))
    threads = info.get("num_threads", "?")
    omp = info.get("env:OMP_NUM_THREADS", "")
    if omp:
        rows.append(Finding("torch threads (intra-op)", f"{threads} (OMP_NUM_THREADS={omp})"))
    else:
        fix = "pin OMP_NUM_THREADS (or torch.set_num_threads): CPU reductions can split by thread count"
        rows.append(Finding("torch threads (intra-op)", f"{threads} (OMP_NUM_THREADS unset)", "warn", fix))
    rows.append(Finding("torch threads (inter-op)", info.get("interop_threads", "?")))
    rows.append(Finding("MKL_NUM_THREADS", info.get("env:MKL_NUM_THREADS", "") or "unset"))
    if "seeding_kernel" in info:  # speed only: the values are the same either way
        rows.append(Finding("seeding kernel", info["seeding_kernel"]))
    return rows


_VERSIONS = (
    ("python", "python"),
    ("platform", "platform"),
    ("torch", "torch"),
    ("lightning", "lightning"),
    ("numpy", "numpy"),
    ("torchmetrics", "torchmetrics"),
    ("CUDA", "cuda"),
    ("cuDNN", "cudnn"),
)


# ---------------------------------------------------------------------------------------- the model replay
def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def load_target(target: str) -> tuple[pl.LightningModule, Any]:
    """Import ``module:function`` (the current directory on ``sys.path``) and call it for ``(module, batch)``.

    Raises:
        InputError: the target is malformed, not importable, or does not return ``(LightningModule, batch)``.
    """
    import lightning.pytorch as pl

    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise InputError(f"TARGET must be 'module:function', got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function: Any = importlib.import_module(module_name)
        for part in function_name.split("."):
            function = getattr(function, part)
    except Exception as error:  # the user's import: any error is bad input, in one line
        raise InputError(f"cannot import TARGET {target!r}: {_one_line(error)}") from None
    if not callable(function):
        raise InputError(f"TARGET {target!r} is not callable")
    try:
        result = function()
    except Exception as error:
        raise InputError(f"TARGET {target!r} raised {_one_line(error)}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], pl.LightningModule)):
        raise InputError(f"TARGET {target!r} must return (LightningModule, batch), got {type(result).__name__}")
    return result[0], result[1]


def _step(module: pl.LightningModule, batch: Any) -> tuple[list[tuple[str, str]], dict[str, str], str]:
    """One forward and backward of ``training_step(batch, 0)``: output digests per module call, gradient digests."""
    outputs: list[tuple[str, str]] = []
    grads: dict[str, str] = {}
    handles = []
    for name, sub in module.named_modules():

        def record(_: Any, __: Any, output: Any, name: str = name or "(root)") -> None:
            outputs.append((name, digest_value(output)))

        handles.append(sub.register_forward_hook(record))
    for name, param in module.named_parameters():
        if param.requires_grad:

            def accumulated(p: torch.Tensor, name: str = name) -> None:
                grads[name] = digest_value(p.grad)

            handles.append(param.register_post_accumulate_grad_hook(accumulated))  # type: ignore[no-untyped-call]
    try:
        module.zero_grad(set_to_none=True)
        try:
            result = module.training_step(batch, 0)
            loss = result.get("loss") if isinstance(result, dict) else result
            if not isinstance(loss, torch.Tensor):
                raise InputError(
                    f"training_step returned {type(result).__name__}, not a loss: doctor replays automatic"
                    " optimization only (a tensor, or a dict with 'loss')"
                )
            loss.backward()  # type: ignore[no-untyped-call]
        except InputError:
            raise
        except Exception as error:
            raise InputError(f"training_step(batch, 0) of the TARGET's module raised {_one_line(error)}") from None
        return outputs, grads, digest_value(loss)
    finally:
        for handle in handles:
            handle.remove()
        module.zero_grad(set_to_none=True)


def _owner(parameter: str) -> str:
    return parameter.rpartition(".")[0] or "(root)"


def replay_step(module: pl.LightningModule, batch: Any) -> Replay:
    """Run ``module.training_step(batch, 0)`` and its backward twice from the same state, and compare.

    Parameters, buffers and the process streams (python, numpy, torch, CUDA) are put back before each replay and
    left as they were found; torch's determinism flags are set with ``warn_only=True`` meanwhile, so operations
    without a deterministic implementation are collected instead of raising.

    Examples:
        >>> import lightning.pytorch as pl
        >>> class Tiny(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(2, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(torch.nn.functional.dropout(batch, 0.5)).sum()
        >>> replay_step(Tiny(), torch.ones(4, 2)).clean
        True
    """
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    saved = {name: value.detach().clone() for name, value in module.state_dict().items()}
    streams = capture_process_streams()
    training = module.training
    runs = []
    operations: list[str] = []
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        module.train()
        for _ in range(2):
            module.load_state_dict(saved)
            restore_process_streams(streams)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runs.append(_step(module, batch))
            for warning in caught:
                text = str(warning.message)
                if _NONDETERMINISTIC in text:
                    operation = text.split(_NONDETERMINISTIC)[0].strip()
                    if operation not in operations:
                        operations.append(operation)
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]
        module.load_state_dict(saved)
        restore_process_streams(streams)
        module.train(training)
    (outputs_a, grads_a, loss_a), (outputs_b, grads_b, loss_b) = runs
    replay = Replay(operations=operations, loss_equal=loss_a == loss_b)
    replay.order_equal = [n for n, _ in outputs_a] == [n for n, _ in outputs_b]
    for (name, a), (_, b) in zip(outputs_a, outputs_b, strict=False):
        if a != b and name not in replay.outputs:
            replay.outputs.append(name)
    order = list(dict.fromkeys(name for name, _ in outputs_a))  # modules in the order their forward finished
    rank = {name: i for i, name in enumerate(order)}
    differing = {_owner(p) for p in set(grads_a) | set(grads_b) if grads_a.get(p) != grads_b.get(p)}
    replay.gradients = sorted(differing, key=lambda name: (rank.get(name, len(rank)), name))
    return replay


# ---------------------------------------------------------------------------------------- the command
def _report(rows: list[Finding], replay: Replay | None, target: str | None) -> dict[str, Any]:
    problems = [row.name for row in rows if row.status == "problem"]
    if replay is not None and not replay.clean:
        problems.append("model replay")
    return {
        "environment": [asdict(row) for row in rows],
        "target": target,
        "replay": None if replay is None else {**asdict(replay), "clean": replay.clean},
        "problems": problems,
    }


def _print_table(console: Console, rows: list[Finding], replay: Replay | None, target: str | None) -> None:
    from rich.table import Table

    table = Table(title="lightning-repro doctor: what decides reproducibility here")
    for column in ("check", "value", "status", "fix"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, row.value, _LABELS[row.status], row.fix)
    console.print(table)
    if replay is None:
        return
    if replay.clean:
        console.print(f"[green]{target}: one training step replayed twice from the same state: bitwise equal[/]")
        return
    replayed = Table(title=f"{target}: one training step replayed twice from the same state")
    replayed.add_column("what differs")
    replayed.add_column("where (first in execution order first)")
    if replay.outputs:
        replayed.add_row("module outputs", ", ".join(replay.outputs))
    if replay.gradients:
        replayed.add_row("parameter gradients", ", ".join(replay.gradients))
    if not replay.order_equal:
        replayed.add_row("module call order", "the two replays called other modules")
    if not replay.loss_equal:
        replayed.add_row("loss", "differs")
    if replay.operations:
        replayed.add_row("no deterministic implementation", ", ".join(replay.operations))
    console.print(replayed)
    if replay.outputs:
        console.print(f"[bold red]first module whose output differs: {replay.outputs[0]}[/]")


def doctor_command(args: argparse.Namespace, console: Console) -> int:
    """``lightning-repro doctor [TARGET] [--json]``: 0 nothing wrong, 1 a problem found, 2 bad input."""
    target: str | None = getattr(args, "target", None)
    replay = None
    if target:
        module, batch = load_target(target)
        replay = replay_step(module, batch)
    rows = audit_environment(collect_environment())
    report = _report(rows, replay, target)
    if getattr(args, "json", False):
        console.print(json.dumps(report, indent=2), markup=False, highlight=False)
    else:
        _print_table(console, rows, replay, target)
    return 1 if report["problems"] else 0
