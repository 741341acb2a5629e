"""Environment and state fingerprints: what a run depended on, so drift is seen."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from typing import Any

import numpy as np
import torch

from lightning_repro import seeding

__all__ = ["cpu_model", "digest_tensors", "environment_fingerprint"]

_ENV_VARS = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what :mod:`platform` knows).

    Examples:
        >>> isinstance(cpu_model(), str)
        True
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.hexdigest()
