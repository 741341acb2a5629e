"""Seed derivation, process-stream pinning and the determinism flags.

Every random stream of a run is seeded from one user seed and a tuple of keys naming the
stream (see DESIGN.md). Child seeds come from a keyed 64-bit BLAKE2b hash of the seed and the
keys, never from ``seed + i`` arithmetic, so no two streams share a seed by accident.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import struct
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from lightning_repro._warn import warn
from lightning_repro.exceptions import NondeterminismWarning

__all__ = [
    "CUBLAS_WORKSPACE",
    "MAX_SEED",
    "check_hash_seed",
    "derive_seed",
    "export_hash_seed",
    "flags_undone",
    "fold_seed32",
    "mix_seed",
    "seed_everything",
    "seed_process_streams",
    "set_deterministic_flags",
    "validate_seed",
]

log = logging.getLogger(__name__)

MAX_SEED = 2**32 - 1
"""Largest seed accepted from users (the range numpy's global generator accepts)."""

_MASK64 = 2**64 - 1
CUBLAS_WORKSPACE = ":4096:8"
"""The cuBLAS workspace setting that makes cuBLAS deterministic."""
_warned_hash_seed: set[str] = set()
# PYTHONHASHSEED is read once, when the interpreter starts: remember the value it started with.
_INTERPRETER_HASH_SEED = os.environ.get("PYTHONHASHSEED") or None  # empty: CPython hashes at random, as unset


def validate_seed(seed: object, name: str = "seed") -> int:
    """Return ``seed`` if it is an int in ``[0, 2**32 - 1]``.

    Raises:
        TypeError: ``seed`` is not an int (``bool`` is refused too).
        ValueError: ``seed`` is outside ``[0, 2**32 - 1]``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"`{name}` must be an int in [0, 2**32 - 1], got {seed!r} of type {type(seed).__name__};"
            f" pass an integer such as `{name}=42`"
        )
    value = int(seed)
    if not 0 <= value <= MAX_SEED:
        example = f" (for example `{name}=42`)" if " " not in name else ""  # not a sum of flags, nor value % 2**32
        raise ValueError(f"`{name}` must be in [0, 2**32 - 1], got {value}; pick a seed in that range{example}")
    return value


def _encode_key(key: object) -> bytes:
    if isinstance(key, bool):
        return b"b" + (b"\x01" if key else b"\x00")
    if isinstance(key, (int, np.integer)):
        value = int(key)
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        return b"i" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, bytes):
        return b"y" + struct.pack("<I", len(key)) + key
    raise TypeError(f"`keys` of `derive_seed` must be int, str or bytes, got {key!r} of type {type(key).__name__}")


def derive_seed(seed: int, *keys: int | str | bytes) -> int:
    """Derive the 64-bit seed of the stream named by ``keys`` from the user ``seed``.

    The derivation is a BLAKE2b hash of an unambiguous encoding of ``(seed, *keys)``: the same
    inputs give the same seed in every process, and distinct inputs give independent seeds
    (``derive_seed(1, 2) != derive_seed(2, 1)``, ``derive_seed(1, "12") != derive_seed(1, 12)``).

    Args:
        seed: The user seed, in ``[0, 2**32 - 1]``.
        *keys: Names of the stream, ints, strings or bytes.

    Returns:
        An int in ``[0, 2**64 - 1]``.

    Examples:
        >>> derive_seed(42, "sample", 0) == derive_seed(42, "sample", 0)
        True
        >>> derive_seed(42, "sample", 0) != derive_seed(42, "sample", 1)
        True
    """
    seed = validate_seed(seed)
    digest = hashlib.blake2b(digest_size=8, person=b"lrepro-v1")
    digest.update(_encode_key(seed))
    for key in keys:
        digest.update(_encode_key(key))
    return int.from_bytes(digest.digest(), "little")


def mix_seed(base: int, index: int) -> int:
    """Mix a 64-bit ``base`` seed with an ``index`` (SplitMix64 finaliser); the per-sample hot path.

    Examples:
        >>> mix_seed(1, 0) != mix_seed(1, 1)
        True
    """
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def fold_seed32(seed64: int) -> int:
    """Fold a 64-bit seed into the 32 bits numpy's legacy global generator accepts."""
    return (seed64 ^ (seed64 >> 32)) & 0xFFFFFFFF


def seed_process_streams(seed: int) -> None:
    """Seed python ``random``, numpy's global generator, torch CPU and every CUDA device.

    Args:
        seed: Any non-negative int below ``2**64`` (numpy gets it folded to 32 bits).
    """
    random.seed(seed)
    np.random.seed(fold_seed32(seed))
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily when CUDA is not started yet


def seed_everything(seed: int) -> int:
    """Pin python ``random``, numpy, torch CPU and every CUDA device from ``seed``.

    Unlike Lightning's function of the same name this validates ``seed`` strictly, never picks
    one at random and leaves ``os.environ`` alone (no ``PL_GLOBAL_SEED``).

    Args:
        seed: An int in ``[0, 2**32 - 1]``.

    Returns:
        The seed.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: ``seed`` is out of range.

    Examples:
        >>> import torch
        >>> _ = seed_everything(7); a = torch.rand(2)
        >>> _ = seed_everything(7); b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    seed = validate_seed(seed)
    seed_process_streams(seed)
    return seed


def flags_undone(deterministic: bool | Literal["warn"]) -> str | None:
    """What turned off the flags :func:`set_deterministic_flags` set, said; None when nothing did.

    A ``Trainer(deterministic=False)`` or ``Trainer(benchmark=True)`` does: Lightning sets torch's flags when the
    Trainer is built, after the callback.
    """
    if deterministic is False:
        return None
    enabled = torch.are_deterministic_algorithms_enabled()
    # True raises on an operation without a deterministic implementation; warn-only lets it run (a Trainer's "warn")
    warn_only = deterministic is True and enabled and torch.is_deterministic_algorithms_warn_only_enabled()
    undone = [
        *(["deterministic algorithms off"] if not enabled else []),
        *(["deterministic algorithms set to warn only"] if warn_only else []),
        *(["cudnn.benchmark on"] if torch.backends.cudnn.benchmark else []),
    ]
    if not undone:
        return None
    return (
        f"DeterminismCallback(deterministic={deterministic!r}) set torch's deterministic flags, but something turned"
        f" them back ({', '.join(undone)}): a Trainer built with `deterministic=False`, `deterministic=\"warn\"` or"
        " `benchmark=True` does so. Operations without a deterministic implementation now run and results may"
        " differ between runs; leave the Trainer's `deterministic` and `benchmark` unset (the callback sets them),"
        " or pass DeterminismCallback(deterministic=False) (or \"warn\") to choose that."
    )


def set_deterministic_flags(deterministic: bool | Literal["warn"]) -> None:
    """Set torch's deterministic-algorithm flags, cuDNN's and ``CUBLAS_WORKSPACE_CONFIG``.

    Args:
        deterministic: ``True`` raises on operations without a deterministic implementation,
            ``"warn"`` only warns on them, ``False`` leaves torch's flags alone.

    Raises:
        ValueError: ``deterministic`` is not ``True``, ``False`` or ``"warn"``.
    """
    if deterministic is not True and deterministic is not False and deterministic != "warn":
        raise ValueError(
            f"`deterministic` must be True, False or 'warn', got {deterministic!r};"
            " use 'warn' to only warn on operations without a deterministic implementation"
        )
    if deterministic is False:
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            warn(
                "CUDA was initialised before `CUBLAS_WORKSPACE_CONFIG` could be set: cuBLAS may not be"
                f" deterministic. Set `CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}` in the environment, or"
                " create the DeterminismCallback before anything touches CUDA.",
                NondeterminismWarning,
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def check_hash_seed(seed: int) -> None:
    """Warn once when ``PYTHONHASHSEED`` was not fixed when this interpreter started.

    ``PYTHONHASHSEED`` is read when the interpreter starts, so it cannot be changed for the
    running process: ``hash()`` of a str (and the iteration order of a ``set`` of str) differs
    between runs unless it was set before Python started. Any fixed value will do: a value that
    differs from ``seed`` is not warned about. ``os.environ`` is not changed here; see
    :func:`export_hash_seed` for the processes lightning-repro starts.
    """
    current = _INTERPRETER_HASH_SEED
    if current is not None and current != "random":
        return
    said = "is not set" if current is None else "is 'random'"
    message = (
        f"PYTHONHASHSEED {said}: `hash()` of strings and the order of sets of strings differ between"
        f" runs of this process. Start Python with `PYTHONHASHSEED={seed}` (any fixed value) to fix them;"
        f" the processes started during a run (DDP ranks, spawn/forkserver dataloader workers) get"
        f" PYTHONHASHSEED={seed}."
    )
    if message not in _warned_hash_seed:
        _warned_hash_seed.add(message)
        warn(message, NondeterminismWarning)


def export_hash_seed(seed: int) -> Callable[[], None]:
    """Export ``PYTHONHASHSEED`` for the child processes started from now on, and return its undo.

    Processes started by exec (DDP ranks, ``spawn``/``forkserver`` dataloader workers) read
    ``PYTHONHASHSEED`` from the environment they inherit. When it is not set (or is
    ``"random"``) it is set to ``seed`` until the returned function is called, which puts the
    previous value back; a fixed value already there is left as it is.

    Args:
        seed: The value to export.

    Returns:
        A function that restores ``os.environ["PYTHONHASHSEED"]`` as it was; call it once.

    Examples:
        >>> undo = export_hash_seed(5)
        >>> undo()
    """
    previous = os.environ.get("PYTHONHASHSEED")
    if previous and previous != "random":  # empty is unset to CPython
        return lambda: None
    os.environ["PYTHONHASHSEED"] = str(seed)

    def undo() -> None:
        if previous is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = previous

    return undo
