"""The manifest of a callback's runs: started at ``setup``, finished on first use, published, compared on resume."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from lightning_utilities.core.rank_zero import rank_prefixed_message

from lightning_repro.manifest import collect as _manifest
from lightning_repro.manifest import drift as _drift
from lightning_repro.manifest import files as _files

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro.checkpoint.state import ReproState

__all__ = ["RunManifest"]


class RunManifest:
    """What :class:`~lightning_repro.DeterminismCallback` does with the run manifest (:mod:`~lightning_repro.manifest`).

    :meth:`start` collects everything but the code section at once and starts git as child processes (no thread:
    the run forks dataloader workers); :attr:`value` waits for git on first use.
    """

    def __init__(
        self,
        *,
        seed: int,
        options: Mapping[str, Any],
        data_fingerprint: str | None,
        data_paths: Sequence[str | os.PathLike[str]] | None,
        on_env_drift: Literal["warn", "error"],
    ) -> None:
        self.seed, self.options, self.on_env_drift = seed, dict(options), on_env_drift
        self.data_fingerprint, self.data_paths = data_fingerprint, data_paths
        self._value: dict[str, Any] | None = None
        self._finish: Callable[[], dict[str, Any]] | None = None

    def start(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        """Begin collecting this fit's manifest (git runs meanwhile, once per fit)."""
        self.finish()  # a previous fit's git child, if it was never read
        self._value = None
        self._finish = _manifest.start_manifest(
            trainer=trainer,
            pl_module=pl_module,
            seed=self.seed,
            options=self.options,
            data_fingerprint=self.data_fingerprint,
            data_paths=self.data_paths,
        )

    def finish(self) -> None:
        """Wait for git (a few ms, at most its timeout) and keep the manifest."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._value = finish()

    @property
    def value(self) -> dict[str, Any] | None:
        """The manifest of the last ``fit``, or ``None`` before one."""
        self.finish()
        return self._value

    @value.setter
    def value(self, manifest: dict[str, Any] | None) -> None:
        self.finish()
        self._value = manifest

    def publish(self, trainer: pl.Trainer) -> None:
        """Write it where the run's metadata goes, log it to the loggers (every rank: ``manifest.manifest_dir``)."""
        if self.value is not None:
            _files.publish_manifest(trainer, self.value)

    def check_resumed(
        self, pending: ReproState, trainer: pl.Trainer | None, warn: Callable[[str, type[Warning]], None]
    ) -> None:
        """Compare the checkpoint's manifest (or old environment fingerprint) with this run's; report the drift.

        Under DDP the manifest of a rank > 0 holds its own environment and hardware (``ReproState.of``): each rank
        compares what it ran on with what it runs on, and a rank > 0 says its drift in its own log too.

        Raises:
            EnvironmentDriftError: something that breaks bitwise continuation changed and ``on_env_drift="error"``.
        """
        if not (pending.manifest or pending.environment):
            return
        if pending.manifest and self.value is None:  # a checkpoint read outside fit (validate, test...)
            self.start(trainer, trainer.lightning_module if trainer is not None else None)
        drift = (
            _drift.manifest_drift(pending.manifest, self.value or {})
            if pending.manifest
            else _drift.environment_drift(pending.environment)  # written before the manifest
        )
        rank = int(trainer.global_rank) if trainer is not None else 0

        def say(message: str, category: type[Warning]) -> None:
            warn(message, category)  # a warning on rank 0 only (and the resume line's reason there)
            if rank > 0:  # this rank's own drift (its node, its interpreter: its part's manifest), in its log
                log.warning(rank_prefixed_message(message, rank))

        _drift.report_drift(drift, on_env_drift=self.on_env_drift, warn=say)
