"""The run manifest: the five things a run depends on (code, data, environment, seeds, hardware) as plain JSON.

:func:`collect_manifest` builds it; :class:`~lightning_repro.DeterminismCallback` collects it once per ``fit`` (in
``setup``), writes it as :data:`MANIFEST_FILE` in the logger's ``log_dir`` (else the ``default_root_dir``; never in a
checkpoint directory: :mod:`~lightning_repro.manifest.files`), stores it in every checkpoint entry and logs it to the
Trainer's loggers as hyperparameters under ``repro/``. :mod:`~lightning_repro.manifest.drift` compares two of them;
``lightning-repro env`` (:mod:`lightning_repro.cli.env`) prints this environment's manifest or its drift from a
saved one.

Sections::

    code         git_commit, dirty, diff_sha256 (every changed or untracked path: kind of change, name, content);
                 outside a git checkout: files_sha256 over the ``.py`` files of the LightningModule's package
    data         fingerprint (given), paths_sha256 and files (``data_paths``), datamodule and its hparams
    environment  python, torch, lightning, numpy, torchmetrics, CUDA, cuDNN and NCCL versions, a digest of the
                 installed distributions, the container image digest (``LIGHTNING_REPRO_IMAGE_DIGEST``), the
                 interpreter's PYTHONHASHSEED, thread counts and thread variables
    seeds        the seed and the determinism flags
    hardware     CPU vendor, model, count and the kernels torch uses on it (capability), torch's BLAS/LAPACK/oneDNN
                 build, GPU names, compute capabilities, driver and count, world size and nodes
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_repro import seeding
from lightning_repro.manifest.codestate import start_code_manifest
from lightning_repro.manifest.datahash import hash_paths
from lightning_repro.manifest.fingerprint import (
    blas_build,
    cpu_capability,
    cpu_model,
    cpu_vendor,
    environment_fingerprint,
)

if TYPE_CHECKING:

    import lightning.pytorch as pl

__all__ = [
    "IMAGE_DIGEST_ENV",
    "MANIFEST_FILE",
    "MANIFEST_VERSION",
    "collect_manifest",
    "manifest_hparams",
    "start_manifest",
    "validate_options",
]

MANIFEST_VERSION = 1
"""The layout of the manifest (its ``"version"`` key)."""

MANIFEST_FILE = "repro_manifest.json"
"""The file name of the manifest, written where the run's metadata goes (see :mod:`~lightning_repro.manifest.files`)."""

IMAGE_DIGEST_ENV = "LIGHTNING_REPRO_IMAGE_DIGEST"
"""The environment variable holding the container image digest (set it in the image, e.g. ``sha256:...``)."""

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


# ---------------------------------------------------------------------------------------- data
def _plain(value: Any) -> Any:
    """``value`` as plain JSON values: containers recursively, anything else as its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _data_manifest(
    trainer: pl.Trainer | None, fingerprint: str | None, paths: Sequence[str | os.PathLike[str]] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"fingerprint": fingerprint, "paths_sha256": None, "files": 0}
    if paths:
        digest = hash_paths(paths)
        out.update(paths_sha256=digest.sha256, files=digest.files)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    out["datamodule"] = type(datamodule).__qualname__ if datamodule is not None else None
    out["datamodule_hparams"] = _plain(dict(getattr(datamodule, "hparams", {}) or {}))
    return out


# ---------------------------------------------------------------------------------------- environment
_DISTRIBUTIONS: dict[tuple[tuple[str, int], ...], tuple[str, int]] = {}


def _distributions() -> tuple[str, int]:
    """A digest of the installed distributions: the names of their metadata directories on ``sys.path``.

    ``torch-2.6.0.dist-info`` names the distribution and its version; listing the directories costs about a
    millisecond where reading every distribution's metadata through ``importlib.metadata`` costs ~100 ms. The
    result is kept for the process while no directory of ``sys.path`` changes (their modification times).
    """
    key = tuple((entry, _mtime(entry or ".")) for entry in sys.path)
    if key not in _DISTRIBUTIONS:
        names: set[str] = set()
        for entry in sys.path:
            try:
                with os.scandir(entry or ".") as found:
                    names.update(e.name for e in found if e.name.endswith((".dist-info", ".egg-info")))
            except OSError:  # a zip file, a missing directory
                continue
        _DISTRIBUTIONS.clear()
        _DISTRIBUTIONS[key] = hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest(), len(names)
    return _DISTRIBUTIONS[key]


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _version(module: str) -> str | None:
    """``module.__version__`` (cheaper than ``importlib.metadata``, which reads the distribution's metadata)."""
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return None


def _nccl() -> str | None:
    try:
        if not torch.cuda.is_available():
            return None
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        return None


def _environment(fingerprint: dict[str, str]) -> dict[str, Any]:
    distributions, count = _distributions()
    return {
        "python": fingerprint["python"],
        "implementation": platform.python_implementation(),
        "platform": fingerprint["platform"],
        "torch": fingerprint["torch"],
        "lightning": fingerprint["lightning"],
        "numpy": fingerprint["numpy"],
        "torchmetrics": _version("torchmetrics"),
        "lightning_repro": _version("lightning_repro"),
        "cuda": torch.version.cuda,
        "cudnn": None if fingerprint["cudnn"] == "None" else fingerprint["cudnn"],
        "nccl": _nccl(),
        "distributions_sha256": distributions,
        "distributions": count,
        "image_digest": os.environ.get(IMAGE_DIGEST_ENV) or None,
        "pythonhashseed": seeding._INTERPRETER_HASH_SEED,  # what this interpreter hashes with, not what it exports
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "env": {name: os.environ.get(name) for name in _THREAD_VARS},
    }


def _seeds(fingerprint: dict[str, str], seed: int | None, options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "seed": seed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "float32_matmul_precision": fingerprint["float32_matmul_precision"],
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),  # DeterminismCallback sets it
        **{name: _plain(value) for name, value in sorted(options.items())},
    }


# ---------------------------------------------------------------------------------------- hardware
def _driver() -> str | None:
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  ..."
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def _hardware(trainer: pl.Trainer | None) -> dict[str, Any]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "cpu_vendor": cpu_vendor(),
        "cpu_model": cpu_model(),
        "cpu_capability": cpu_capability(),  # the kernels torch dispatches to: AVX2 and AVX512 round differently
        "blas_build": blas_build(),
        "cpu_count": os.cpu_count(),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(count)],
        "gpu_capabilities": [".".join(map(str, torch.cuda.get_device_capability(i))) for i in range(count)],
        "gpu_driver": _driver() if count else None,
        "gpu_count": count,
        "world_size": int(trainer.world_size) if trainer is not None else 1,
        "num_nodes": int(trainer.num_nodes) if trainer is not None else 1,
    }


# ---------------------------------------------------------------------------------------- the whole manifest
def validate_options(
    *, on_env_drift: object, data_fingerprint: object, data_paths: object
) -> tuple[Literal["warn", "error"], str | None, list[str] | None]:
    """Check the callback's manifest options; return them (``data_paths`` as a list of strings).

    Raises:
        ValueError: ``on_env_drift`` is not "warn" or "error".
        TypeError: ``data_fingerprint`` is not a string, or ``data_paths`` is not a sequence of paths.
    """
    if on_env_drift not in ("warn", "error"):
        raise ValueError(
            f"`on_env_drift` must be 'warn' or 'error', got {on_env_drift!r}; 'error' refuses to resume when"
            " something that can break bitwise continuation changed"
        )
    if data_fingerprint is not None and not isinstance(data_fingerprint, str):
        raise TypeError(f"`data_fingerprint` must be a str or None, got {data_fingerprint!r}")
    paths = None
    if data_paths is not None:
        if isinstance(data_paths, (str, bytes, os.PathLike)) or not isinstance(data_paths, Sequence):
            raise TypeError(
                f"`data_paths` must be a list of files or folders, got {data_paths!r}; wrap one path in a list"
            )
        if not all(isinstance(p, (str, os.PathLike)) for p in data_paths):
            raise TypeError(f"`data_paths` must hold str or os.PathLike paths, got {data_paths!r}")
        paths = [os.fspath(p) for p in data_paths]
    return on_env_drift, data_fingerprint, paths  # type: ignore[return-value]


def collect_manifest(
    *,
    trainer: pl.Trainer | None = None,
    pl_module: pl.LightningModule | None = None,
    seed: int | None = None,
    options: Mapping[str, Any] | None = None,
    data_fingerprint: str | None = None,
    data_paths: Sequence[str | os.PathLike[str]] | None = None,
    source: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The manifest of this run as plain JSON values (see the module docstring for its sections).

    Args:
        trainer: The Trainer (world size, nodes, the datamodule's hyperparameters); ``None`` outside a run.
        pl_module: The LightningModule: git runs in the directory of its source file.
        seed: The run's seed.
        options: Other settings that decide the run's streams (the callback's options), put in ``seeds``.
        data_fingerprint: A string naming the data's version (a dataset hash, a DVC revision...).
        data_paths: Files or directories whose contents are hashed (cached on size and mtime).
        source: Where git runs when there is no ``pl_module`` (default: the current directory).

    Examples:
        >>> manifest = collect_manifest(seed=3)
        >>> sorted(manifest)
        ['code', 'data', 'environment', 'hardware', 'seeds', 'version']
        >>> manifest["environment"]["torch"] == str(torch.__version__)
        True
    """
    return start_manifest(
        trainer=trainer,
        pl_module=pl_module,
        seed=seed,
        options=options,
        data_fingerprint=data_fingerprint,
        data_paths=data_paths,
        source=source,
    )()


def _source_file(cls: type) -> str | None:
    """The file ``cls`` is defined in, or None: a class of ``python -c``, a notebook cell or exec'd text has none."""
    try:
        return inspect.getsourcefile(cls)
    except (OSError, TypeError):  # OSError for `__main__` without a file, TypeError for a module not in sys.modules
        return None


def start_manifest(
    *,
    trainer: pl.Trainer | None = None,
    pl_module: pl.LightningModule | None = None,
    seed: int | None = None,
    options: Mapping[str, Any] | None = None,
    data_fingerprint: str | None = None,
    data_paths: Sequence[str | os.PathLike[str]] | None = None,
    source: str | os.PathLike[str] | None = None,
) -> Callable[[], dict[str, Any]]:
    """Start :func:`collect_manifest` (same arguments); the returned function finishes it and returns the manifest.

    Everything but the code section is collected now; ``git status`` runs as a child process meanwhile (no
    thread: a run forks dataloader workers), so the caller's work hides its cost.
    """
    where = (_source_file(type(pl_module)) if pl_module is not None else None) or source or os.getcwd()
    module = type(pl_module).__module__ if pl_module is not None else None
    code = start_code_manifest(where, module=module)
    fingerprint = environment_fingerprint()
    rest = {
        "data": _data_manifest(trainer, data_fingerprint, data_paths),
        "environment": _environment(fingerprint),
        "seeds": _seeds(fingerprint, seed, options or {}),
        "hardware": _hardware(trainer),
    }
    return lambda: {"version": MANIFEST_VERSION, "code": code(), **rest}


def manifest_hparams(manifest: Mapping[str, Any], prefix: str = "repro/") -> dict[str, Any]:
    """The manifest flattened for a logger's ``log_hyperparams``: ``{"repro/environment/torch": "2.6.0", ...}``.

    Lists and ``None`` become strings (loggers take scalars); nested dicts become ``/``-joined keys.

    Examples:
        >>> manifest_hparams({"hardware": {"gpu_names": ["A", "B"], "gpu_count": 2}, "version": 1})
        {'repro/hardware/gpu_names': 'A,B', 'repro/hardware/gpu_count': 2, 'repro/version': 1}
    """
    out: dict[str, Any] = {}
    for key, value in manifest.items():
        if isinstance(value, Mapping):
            out.update(manifest_hparams(value, f"{prefix}{key}/"))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = ",".join(map(str, value))
        else:
            out[f"{prefix}{key}"] = "None" if value is None else value
    return out
