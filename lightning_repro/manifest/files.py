"""The manifest's file: where it goes beside a run (never in a checkpoint directory), written and published.

:func:`manifest_dir` chooses the directory (the logger's ``log_dir``, else the ``default_root_dir``; ``None`` when that
is a ``ModelCheckpoint``'s ``dirpath``), :func:`write_manifest` writes
:data:`~lightning_repro.manifest.collect.MANIFEST_FILE` there, and :func:`publish_manifest` does both on global rank 0
and logs the manifest to the Trainer's loggers as hyperparameters
(:func:`~lightning_repro.manifest.collect.manifest_hparams`). The manifest itself is collected in
:mod:`~lightning_repro.manifest.collect`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_repro.manifest.collect import MANIFEST_FILE, manifest_hparams

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["checkpoint_dirs", "manifest_dir", "publish_manifest", "write_manifest"]

log = logging.getLogger(__name__)


def _same_dir(a: str, b: str) -> bool:
    """Whether two directories are one (local paths resolved; fsspec URLs compared as written)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def checkpoint_dirs(trainer: pl.Trainer) -> list[str]:
    """The directories the Trainer's checkpoint callbacks write to (``ModelCheckpoint.dirpath``, set at ``setup``)."""
    found = (getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks)
    return [str(dirpath) for dirpath in found if dirpath]


def manifest_dir(trainer: pl.Trainer) -> str | None:
    """Where the manifest file goes: where Lightning puts a run's metadata, never in a checkpoint directory.

    ``trainer.log_dir``: the first logger's ``log_dir`` for ``TensorBoardLogger`` and ``CSVLogger`` (beside their
    ``hparams.yaml``), another logger's ``save_dir``; without one (or without a logger) the trainer's
    ``default_root_dir``. ``None``, no file, in three cases: without a logger and without a checkpoint callback, and
    with ``fast_dev_run`` (Lightning writes nothing to disk, neither do we), and when that directory is also a
    ``ModelCheckpoint``'s ``dirpath`` (it then holds only what Lightning writes). The manifest is in every
    checkpoint either way.

    Call it on every rank: ``trainer.log_dir`` broadcasts rank 0's directory.
    """
    if getattr(trainer, "fast_dev_run", False):  # Lightning writes nothing: dummy loggers, checkpoints skipped
        return None
    if trainer.loggers:
        directory = str(trainer.log_dir or trainer.default_root_dir)  # a logger's `save_dir` may be a Path
    elif trainer.checkpoint_callbacks:
        directory = str(trainer.default_root_dir)
    else:
        return None
    if any(_same_dir(directory, dirpath) for dirpath in checkpoint_dirs(trainer)):
        if trainer.is_global_zero:
            log.info(
                f"{directory} is the run's directory and a ModelCheckpoint's dirpath: no {MANIFEST_FILE} there, so it"
                " holds only what Lightning writes (the manifest is in every checkpoint: `lightning-repro env"
                " --compare CKPT` reads it)"
            )
        return None
    return directory


def write_manifest(manifest: Mapping[str, Any], directory: str | os.PathLike[str]) -> str:
    """Write ``manifest`` as :data:`MANIFEST_FILE` in ``directory`` (created if needed, fsspec URLs too); its path."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    fs = get_filesystem(str(directory))
    fs.makedirs(str(directory), exist_ok=True)
    path = os.path.join(str(directory), MANIFEST_FILE)
    with fs.open(path, "w") as out:
        out.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def publish_manifest(trainer: pl.Trainer, manifest: Mapping[str, Any]) -> str | None:
    """Write the manifest in :func:`manifest_dir` (global rank 0) and log it to every logger as hyperparameters.

    Call it on every rank (see :func:`manifest_dir`).

    Returns:
        The path of the file written, or ``None`` (another rank, or no directory for it: see :func:`manifest_dir`).
    """
    path = None
    directory = manifest_dir(trainer)  # on every rank: trainer.log_dir is a collective
    if trainer.is_global_zero and directory is not None:
        path = write_manifest(manifest, directory)
    if trainer.loggers:
        from lightning.pytorch.loggers import TensorBoardLogger

        hparams = manifest_hparams(manifest)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                # metrics={}: without metrics it logs a placeholder `hp_metric=-1` at step 0 (default_hp_metric), a
                # row plain Lightning logs only for a module with hyperparameters; the manifest is in hparams.yaml
                logger.log_hyperparams(hparams, metrics={})
            else:
                logger.log_hyperparams(hparams)
    return path
