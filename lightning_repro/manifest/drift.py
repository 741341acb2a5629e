"""Environment drift: what changed since a checkpoint's manifest, and whether it can break bitwise continuation.

Every changed field falls in one of three classes:

- **breaks**: can change the numbers the resumed steps compute, so the run may not continue bit for bit:
  the python, torch, lightning, numpy, torchmetrics, lightning-repro, CUDA, cuDNN and NCCL versions, the platform,
  PYTHONHASHSEED, thread counts and thread variables, the seed and the determinism flags, the CPU vendor and model,
  the CPU kernels torch uses (its CPU capability, ``AVX2``, ``AVX512``...), torch's BLAS/LAPACK/oneDNN build, the GPU
  names and compute capabilities. ``on_env_drift="error"`` raises :class:`~lightning_repro.EnvironmentDriftError`
  on these.
- **inputs**: the code (git commit, uncommitted diff, package files), the data (fingerprint, files, datamodule
  hyperparameters), the other installed distributions and the container image. The resumed run computes with the
  new ones: it continues bitwise only if the change does not touch what it computes, which lightning-repro cannot
  tell. Often deliberate (a fixed log line, a new commit), so they always warn and never raise.
- **recorded**: cannot break continuation: the GPU driver (torch ships its kernels compiled), the CPU and GPU
  counts, the world size and node count (a changed topology is ``on_topology_change``'s business). An INFO line.

Checkpoints written before the manifest hold only the environment fingerprint: every change there is "breaks".
Checkpoints written before the CPU fields (:data:`~.fingerprint.CPU_FIELDS`) were recorded lack them:
those fields are no change but :attr:`Drift.not_recorded`, reported as "hardware not recorded" (a
:class:`~lightning_repro.ReproWarning`: the resume may well be exact, it cannot be checked).
"""

from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_repro.exceptions import (
    CheckpointReadError,
    EnvironmentDriftError,
    InputError,
    NotExactWarning,
    ReproWarning,
)
from lightning_repro.manifest.fingerprint import CPU_FIELDS, environment_fingerprint

__all__ = [
    "LAUNCHER_SET",
    "Change",
    "Drift",
    "drift_from_here",
    "environment_drift",
    "find_manifest",
    "flatten",
    "manifest_drift",
    "report_drift",
]

log = logging.getLogger(__name__)

Kind = Literal["breaks", "inputs", "recorded"]

_INPUT_SECTIONS = ("code.", "data.")
_INPUTS = {"environment.distributions_sha256", "environment.distributions", "environment.image_digest"}
_RECORDED = {
    "version",
    "hardware.gpu_driver",
    "hardware.cpu_count",
    "hardware.gpu_count",
    "hardware.world_size",
    "hardware.num_nodes",
}
_WORDING: dict[str, str] = {
    "breaks": "these can break bitwise continuation, so the resumed run may differ from the uninterrupted one",
    "inputs": "the code, data or installed packages changed: the resumed run continues bitwise only if the change"
    " does not touch what it computes",
    "recorded": "recorded only, these cannot break bitwise continuation",
}


def _kind(field: str) -> Kind:
    if field in _RECORDED:
        return "recorded"
    if field.startswith(_INPUT_SECTIONS) or field in _INPUTS:
        return "inputs"
    return "breaks"


@dataclass(frozen=True)
class Change:
    """One changed field: its dotted name, the saved and the current value, and its class (see the module)."""

    field: str
    saved: Any
    current: Any
    kind: Kind

    def __str__(self) -> str:
        return f"{self.field}: {self.saved!r} -> {self.current!r}"


_UNRECORDED = frozenset((*CPU_FIELDS, *(f"hardware.{name}" for name in CPU_FIELDS)))
"""Fields an older entry (fingerprint) or manifest lacks: absent there means "not recorded", not "changed"."""


@dataclass(frozen=True)
class Drift:
    """Every changed field between a saved manifest and the current one, sorted by name.

    ``not_recorded`` names the CPU fields the saved side lacks (written before they were recorded): they are not
    changes, and :meth:`not_recorded_message` says so.
    """

    changes: tuple[Change, ...]
    not_recorded: tuple[str, ...] = ()

    def of(self, kind: Kind) -> list[Change]:
        """The changes of one class."""
        return [c for c in self.changes if c.kind == kind]

    @property
    def breaks(self) -> bool:
        """Whether a change can break bitwise continuation."""
        return bool(self.of("breaks"))

    def message(self, kind: Kind) -> str:
        """One sentence listing the changes of ``kind`` (empty when there are none)."""
        changes = self.of(kind)
        if not changes:
            return ""
        head = (
            "The environment changed since the checkpoint was written"
            if kind != "inputs"
            else "The code or data changed since the checkpoint was written"
        )
        return f"{head}; {_WORDING[kind]}: " + "; ".join(map(str, changes))

    def not_recorded_message(self) -> str:
        """One sentence saying which CPU fields the checkpoint does not record (empty when it records them all)."""
        if not self.not_recorded:
            return ""
        return (
            "Hardware not recorded: the checkpoint was written by an older lightning-repro, without "
            + ", ".join(self.not_recorded)
            + ". Another CPU, other CPU kernels or another BLAS build change float results in their last bits, so"
            " the resumed run may differ from the uninterrupted one without this being reported; resume on the"
            " machine and torch build it was written with to continue bitwise"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: ``{"breaks": bool, "changes": [{"field", "saved", "current", "kind"}, ...], "not_recorded"}``."""
        return {
            "breaks": self.breaks,
            "changes": [
                {"field": c.field, "saved": c.saved, "current": c.current, "kind": c.kind} for c in self.changes
            ],
            "not_recorded": list(self.not_recorded),
        }


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nest of dicts as one dict of dotted names (``{"environment.env.OMP_NUM_THREADS": "1", ...}``)."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, Mapping):
            out.update(flatten(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item
    return out


_ABSENT = "(absent)"


def _compare(saved: Mapping[str, Any], current: Mapping[str, Any], kind: Callable[[str], Kind]) -> Drift:
    """The changed fields (a CPU field the saved side lacks is not recorded, not changed)."""
    unrecorded = tuple(sorted(key for key in set(current) & _UNRECORDED if key not in saved))
    keys = sorted((set(saved) | set(current)) - set(unrecorded))
    return Drift(
        tuple(
            Change(key, saved.get(key, _ABSENT), current.get(key, _ABSENT), kind(key))
            for key in keys
            if saved.get(key, _ABSENT) != current.get(key, _ABSENT)
        ),
        unrecorded,
    )


def manifest_drift(saved: Mapping[str, Any], current: Mapping[str, Any]) -> Drift:
    """Every field that differs between two manifests, classified (see the module docstring).

    Examples:
        >>> old = {"environment": {"torch": "2.6.0"}, "data": {"fingerprint": "v1"}}
        >>> new = {"environment": {"torch": "2.7.0"}, "data": {"fingerprint": "v1"}}
        >>> [str(c) for c in manifest_drift(old, new).changes]
        ["environment.torch: '2.6.0' -> '2.7.0'"]
        >>> manifest_drift(old, new).breaks, manifest_drift(new, new).changes
        (True, ())
    """
    return _compare(flatten(saved), flatten(current), _kind)


def environment_drift(saved: Mapping[str, str], current: Mapping[str, str] | None = None) -> Drift:
    """The drift from an environment fingerprint of a checkpoint written before the manifest: every change breaks.

    Examples:
        >>> [str(c) for c in environment_drift({"torch": "2.6"}, {"torch": "2.7"}).changes]
        ["torch: '2.6' -> '2.7'"]
    """
    return _compare(saved, environment_fingerprint() if current is None else current, lambda key: "breaks")


def report_drift(
    drift: Drift,
    *,
    on_env_drift: Literal["warn", "error"] = "warn",
    warn: Callable[[str, type[Warning]], None] | None = None,
) -> None:
    """Say what drifted: raise or warn for what breaks continuation, warn for inputs and unrecorded hardware.

    What cannot break continuation gets an INFO line.

    Args:
        drift: The drift (:func:`manifest_drift`, :func:`environment_drift`).
        on_env_drift: ``"error"`` raises when a change can break bitwise continuation; ``"warn"`` warns.
        warn: ``warn(message, category)``, e.g. a ``WarningCache``'s ``warn`` (once per cause); default
            :func:`lightning_repro._warn.warn` (rank 0, at the user's line).

    Raises:
        EnvironmentDriftError: ``on_env_drift="error"`` and a change can break bitwise continuation.
    """
    if warn is None:
        from lightning_repro._warn import warn as repro_warn

        warn = repro_warn

    if drift.breaks:
        message = drift.message("breaks")
        if on_env_drift == "error":
            also = drift.message("inputs")
            raise EnvironmentDriftError(
                f"{message}. Resume in the environment the checkpoint was written in, or pass"
                " `on_env_drift='warn'` to DeterminismCallback to continue anyway" + (f". {also}" if also else "")
            )
        warn(message, NotExactWarning)
    if drift.of("inputs"):
        warn(drift.message("inputs"), NotExactWarning)
    if drift.not_recorded:
        warn(drift.not_recorded_message(), ReproWarning)
    if drift.of("recorded"):
        log.info(drift.message("recorded"))


# ---------------------------------------------------------------------------------------- the CLI side
_RUN_SECTIONS: tuple[str, ...] = ("data", "seeds")
_RUN_SET_LEGACY = (
    "deterministic_algorithms",
    "deterministic_warn_only",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "env:CUBLAS_WORKSPACE_CONFIG",
)  # set by DeterminismCallback in the run


def _without(values: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in keys}


def find_manifest(path: str | Path) -> tuple[dict[str, Any], bool]:
    """The manifest in a manifest JSON file or a checkpoint, and whether it is a pre-manifest environment fingerprint.

    A checkpoint is a file or a distributed checkpoint directory (its ``meta.pt``).

    Raises:
        InputError: the file is missing, is neither JSON nor a checkpoint, or holds no manifest.
    """
    file = Path(path)
    from lightning_repro.checkpoint.reading import cut_short

    if file.is_dir() or zipfile.is_zipfile(file) or cut_short(file):
        return _from_checkpoint(file)
    if not file.is_file():
        raise InputError(f"{str(path)!r} does not exist or is not a file; pass a manifest JSON or a .ckpt")
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise InputError(f"{str(path)!r} is neither a checkpoint nor JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("environment"), dict):
        raise InputError(f"{str(path)!r} is JSON but not a lightning-repro manifest (no 'environment' section)")
    return data, False


def _from_checkpoint(file: Path) -> tuple[dict[str, Any], bool]:
    from lightning_repro.checkpoint.reading import entries_in, load_for_reading

    try:
        entries = [entry for _, entry in entries_in(load_for_reading(file))]
    except CheckpointReadError as error:  # nothing to compare with: bad input here
        raise InputError(str(error)) from None
    for entry in entries:
        if isinstance(entry.get("manifest"), dict):
            return entry["manifest"], False
    for entry in entries:
        if isinstance(entry.get("environment"), dict) and entry["environment"]:
            return entry["environment"], True
    raise InputError(
        f"the checkpoint {str(file)!r} holds no lightning-repro manifest (written without DeterminismCallback?)"
    )


def drift_from_here(saved: dict[str, Any], legacy: bool, current: dict[str, Any]) -> tuple[Drift, list[str]]:
    """The drift of this process's manifest ``current`` from a saved one, and the sections not compared.

    ``legacy``: ``saved`` is a pre-manifest environment fingerprint. Not compared: what a run sets or chooses
    itself, which a process outside it cannot know.
    """
    if legacy:
        drift = environment_drift(*(_without(m, _RUN_SET_LEGACY) for m in (saved, environment_fingerprint())))
        return drift, list(_RUN_SET_LEGACY)
    # the seed, the flags and the data are the run's settings, which this process does not know; nor does it know
    # the module whose package a run outside git digested
    skip = _RUN_SECTIONS + (("code",) if not (saved.get("code") or {}).get("git_commit") else ())
    compared = [{k: v for k, v in m.items() if k not in skip} for m in (saved, current)]
    world = int((saved.get("hardware") or {}).get("world_size") or 1)
    if world > 1 and ((current.get("environment") or {}).get("env") or {}).get("OMP_NUM_THREADS") is None:
        # a launcher (Lightning's, torchrun) sets OMP_NUM_THREADS and torch's threads in each rank where it is unset
        compared = [_without_threads(m) for m in compared]
        skip += (LAUNCHER_SET,)
    return manifest_drift(*compared), list(skip)


LAUNCHER_SET = "environment.num_threads and OMP_NUM_THREADS"
"""What a multi-process run's launcher set in each rank (where ``OMP_NUM_THREADS`` was unset), not compared from a
shell that leaves it unset (:func:`drift_from_here`)."""


def _without_threads(manifest: dict[str, Any]) -> dict[str, Any]:
    environment = dict(manifest.get("environment") or {})
    environment.pop("num_threads", None)
    environment["env"] = {k: v for k, v in (environment.get("env") or {}).items() if k != "OMP_NUM_THREADS"}
    return {**manifest, "environment": environment}
