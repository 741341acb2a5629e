"""Environment and state fingerprints: what a run depended on, so drift is seen."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import sys
from typing import Any

import numpy as np
import torch

from lightning_repro import seeding
from lightning_repro.shards import local_shard, shard_layout

__all__ = [
    "CPU_FIELDS",
    "blas_build",
    "cpu_capability",
    "cpu_model",
    "cpu_vendor",
    "digest_tensors",
    "environment_fingerprint",
]

_ENV_VARS = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


CPU_FIELDS = ("cpu_capability", "cpu_vendor", "cpu_model", "blas_build")
"""What makes float results on the CPU differ between machines, in the fingerprint and the manifest's hardware.

The kernels torch dispatches to (``AVX2``, ``AVX512``... per :func:`cpu_capability`), the CPU that runs them and
the BLAS/LAPACK/oneDNN torch was built with: the same program gives other last bits when one of them changes.
An entry or manifest written before these were recorded lacks them: its drift says "hardware not recorded".
"""


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, str]:
    """``(vendor_id, model name)`` from ``/proc/cpuinfo`` (empty strings where it or the line is missing)."""
    vendor = model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "model name" and not model:
                    model = value.strip()
                if vendor and model:
                    break
    except OSError:
        pass
    return vendor, model


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what :mod:`platform` knows).

    Examples:
        >>> isinstance(cpu_model(), str)
        True
    """
    return _cpuinfo()[1] or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor (``vendor_id`` in ``/proc/cpuinfo``: ``GenuineIntel``, ``AuthenticAMD``), else ``""``.

    Example:
        >>> isinstance(cpu_vendor(), str)
        True
    """
    return _cpuinfo()[0]


def cpu_capability() -> str:
    """The CPU kernels torch dispatches to (``torch.backends.cpu.get_cpu_capability()``: ``"AVX2"``, ``"AVX512"``).

    Example:
        >>> cpu_capability() == torch.backends.cpu.get_cpu_capability()
        True
    """
    return str(torch.backends.cpu.get_cpu_capability())


@functools.lru_cache(maxsize=1)
def blas_build() -> str:
    """The BLAS, LAPACK, MKL and oneDNN torch was built with, from ``torch.__config__.show()``.

    Only build facts, nothing that changes per run (thread counts) or per machine (the CPU capability), e.g.
    ``"BLAS_INFO=mkl, LAPACK_INFO=mkl, MKL 2024.2-Product Build 20240605, oneDNN v3.12.0 (Git Hash 80afa71...)"``.

    Example:
        >>> blas_build() == blas_build() and isinstance(blas_build(), str)
        True
    """
    text = torch.__config__.show()
    parts = [f"{key}={value}" for key, value in re.findall(r"\b(BLAS_INFO|LAPACK_INFO)=([^,\s]*)", text)]
    mkl = re.search(r"Math Kernel Library Version (.+?)(?: for .*)?$", text, re.MULTILINE)
    if mkl:
        parts.append(f"MKL {mkl.group(1).strip()}")
    onednn = re.search(r"(?:MKL-DNN|oneDNN) (v\S+.*?)\s*$", text, re.MULTILINE)
    if onednn:
        parts.append(f"oneDNN {onednn.group(1)}")
    return ", ".join(parts) or "unknown"


def environment_fingerprint() -> dict[str, str]:
    """Versions, hardware and flags that can change a run's numbers, as plain strings.

    Examples:
        >>> fp = environment_fingerprint()
        >>> fp["torch"] == torch.__version__
        True
    """
    import lightning

    info: dict[str, str] = {
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "torch": str(torch.__version__),
        "lightning": str(lightning.__version__),
        "numpy": str(np.__version__),
        "cuda": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "None",  # type: ignore[no-untyped-call]
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": str(torch.get_num_threads()),
        "cpu_capability": cpu_capability(),
        "cpu_vendor": cpu_vendor(),
        "cpu_model": cpu_model(),
        "blas_build": blas_build(),
    }
    if torch.cuda.is_available():
        info["gpus"] = ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    for name in _ENV_VARS:
        info[f"env:{name}"] = os.environ.get(name, "")
    # the value hashing depends on is the one this interpreter started with, not one exported for children
    info["env:PYTHONHASHSEED"] = seeding._INTERPRETER_HASH_SEED or ""
    return info


def digest_tensors(tensors: dict[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes of a dict of tensors (sorted by name).

    A ``DTensor`` (a sharded parameter) contributes its layout and this rank's local shard: compare such digests
    rank by rank.

    Examples:
        >>> a = {"w": torch.ones(2)}
        >>> digest_tensors(a) == digest_tensors({"w": torch.ones(2)})
        True
        >>> digest_tensors(a) == digest_tensors({"w": torch.zeros(2)})
        False
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            layout = shard_layout(value)
            if layout is not None:  # a DTensor: its layout and this rank's local shard
                h.update(layout.encode())
                value = local_shard(value)
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()
