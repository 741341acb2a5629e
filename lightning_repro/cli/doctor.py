"""``lightning-repro doctor``: what decides reproducibility here, and which modules of a model replay differently.

Without a target it audits the environment: versions, hardware, determinism flags, ``PYTHONHASHSEED``,
``CUBLAS_WORKSPACE_CONFIG``, cuDNN, TF32 and thread counts. It runs in a fresh interpreter, where
:class:`~lightning_repro.DeterminismCallback` has not set anything yet, so each row says whether it is fine, will be
set by the callback, or must be fixed outside the process (and how).

With ``TARGET`` (``module:function`` returning ``(LightningModule, batch)``) it also runs one training step twice
from the same state (parameters, buffers and process streams put back in between) with forward hooks on every
submodule and a hook on every parameter's accumulated gradient, and names the modules whose outputs or gradients
differ (the first in execution order first), and the operations torch reports as having no deterministic
implementation: :mod:`lightning_repro.cli.replay`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_repro.checkpoint.hashing import checksum_status
from lightning_repro.cli.replay import Replay, load_target, replay_step
from lightning_repro.data import fastrng as _fastrng
from lightning_repro.manifest.fingerprint import cpu_model, environment_fingerprint

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["Finding", "audit_environment", "collect_environment", "doctor_command"]

Status = Literal["ok", "callback", "warn", "problem"]
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
            "checksum_kernel": checksum_status(),
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
    if "checksum_kernel" in info:  # speed only, as above
        rows.append(Finding("checksum kernel", info["checksum_kernel"]))
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
