"""The replay of one training step, for ``lightning-repro doctor TARGET``: which modules replay differently.

:func:`load_target` imports ``module:function`` and calls it for ``(LightningModule, batch)``; :func:`replay_step` runs
one training step twice from the same state (parameters, buffers and process streams put back in between) with
forward hooks on every submodule and a hook on every parameter's accumulated gradient, and returns a :class:`Replay`
naming the modules whose outputs or gradients differ (the first in execution order first), and the operations torch
reports as having no deterministic implementation. The verb itself is :mod:`lightning_repro.cli.doctor`.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_repro.checkpoint.verify import digest_value
from lightning_repro.exceptions import InputError
from lightning_repro.rng import capture_process_streams, restore_process_streams

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Replay", "load_target", "replay_step"]

_NONDETERMINISTIC = " does not have a deterministic implementation"


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


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def load_target(target: str) -> tuple[pl.LightningModule, Any]:
    """Import TARGET and call it for ``(module, batch)``.

    TARGET is ``module:function`` (the current directory on ``sys.path``) or ``path/to/file.py:function``.

    Raises:
        InputError: the target is malformed, not importable, or does not return ``(LightningModule, batch)``.
    """
    import lightning.pytorch as pl

    from lightning_repro.stats.process import module_from_path

    module_name, sep, function_name = target.rpartition(":")
    if not sep or not module_name or not function_name:
        looks_like_a_checkpoint = target.endswith((".ckpt", ".pt", ".pth")) or os.path.isdir(target)
        hint = "; to look at a checkpoint, run `lightning-repro inspect CKPT`" if looks_like_a_checkpoint else ""
        raise InputError(f"TARGET must be 'module:function' or 'path/to/file.py:function', got {target!r}{hint}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function: Any = (
            module_from_path(Path(module_name)) if module_name.endswith(".py") else importlib.import_module(module_name)
        )
        for part in function_name.split("."):
            function = getattr(function, part)
    except InputError:
        raise
    except (Exception, SystemExit) as error:  # the user's import (argparse at import exits): bad input, one line
        raise InputError(f"cannot import TARGET {target!r}: {_one_line(error)}") from None
    if not callable(function):
        raise InputError(f"TARGET {target!r} is not callable")
    try:
        result = function()
    except (Exception, SystemExit) as error:  # `sys.exit(0)` in it read as "nothing wrong" (exit 0, no output)
        raise InputError(f"TARGET {target!r} raised {_one_line(error)}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], pl.LightningModule)):
        got = type(result).__name__  # of a pair, what is in it: "(Linear, Tensor)" says which part is wrong
        if isinstance(result, tuple) and len(result) == 2:
            got = f"({type(result[0]).__name__}, {type(result[1]).__name__})"
        raise InputError(f"TARGET {target!r} must return (LightningModule, batch), got {got}")
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
        except (Exception, SystemExit) as error:
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
