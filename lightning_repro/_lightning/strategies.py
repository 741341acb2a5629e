"""Lightning's parallel strategies with a public seam around the configuration of their launcher; data-parallel ranks.

``strategies/ddp.py: DDPStrategy._configure_launcher``, ``strategies/model_parallel.py:
ModelParallelStrategy._configure_launcher`` and ``strategies/fsdp.py: FSDPStrategy._configure_launcher`` (Lightning
2.5, 2.6) create the launcher that starts the ranks; :class:`LauncherSeam` overrides it once, here, so that the
strategies of lightning-repro subclass public names only: :meth:`~LauncherSeam.before_launcher` runs before the
launcher is created and :meth:`~LauncherSeam.wrap_launch` wraps its ``launch`` (the call that starts the ranks).
:class:`LauncherHooks` is that seam on ``DDPStrategy``.

:func:`data_parallel` reads this process's place among the data-parallel replicas from the strategy's
``distributed_sampler_kwargs`` (what Lightning gives its ``DistributedSampler``): under DDP and FSDP every rank is a
replica, under ``ModelParallelStrategy`` the ranks of one tensor-parallel group are one replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

__all__ = ["LauncherHooks", "LauncherSeam", "data_parallel", "repro_counterpart"]


class LauncherSeam:
    """A mixin for a Lightning strategy whose launcher configuration calls :meth:`before_launcher`, :meth:`wrap_launch`.

    Put it before the Lightning strategy in the bases (``class S(LauncherSeam, ModelParallelStrategy)``).
    """

    launcher: Any

    def _configure_launcher(self) -> None:
        self.before_launcher()
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self.launcher
        if launcher is not None:
            launcher.launch = self.wrap_launch(launcher.launch)  # type: ignore[method-assign]

    def before_launcher(self) -> None:
        """Runs right before Lightning creates the launcher (default: nothing)."""

    def wrap_launch(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        """The launcher's ``launch`` as the ranks are started with it (default: unchanged)."""
        return launch


class LauncherHooks(LauncherSeam, DDPStrategy):
    """A ``DDPStrategy`` whose launcher configuration calls :meth:`before_launcher` and :meth:`wrap_launch`."""


def data_parallel(trainer: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel replicas.

    ``(global_rank, world_size)``, but under tensor parallelism, where the ranks of one tensor-parallel group share a
    replica (and its batches). Under ``ModelParallelStrategy`` read from its device mesh's ``"data_parallel"``
    dimension, as its ``distributed_sampler_kwargs`` reads it, without building that sub-mesh (milliseconds, at
    every checkpoint).
    """
    strategy = getattr(trainer, "strategy", None)
    mesh: Any = getattr(strategy, "_device_mesh", None)  # ModelParallelStrategy's, once set up
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "data_parallel" in names:
        dim = names.index("data_parallel")
        return int(mesh.get_local_rank(dim)), int(mesh.size(dim))
    kwargs = None
    try:
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    except RuntimeError:  # ModelParallelStrategy before its device mesh exists
        kwargs = None
    if isinstance(kwargs, dict) and isinstance(kwargs.get("rank"), int) and isinstance(kwargs.get("num_replicas"), int):
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return int(trainer.global_rank), int(trainer.world_size)


def repro_counterpart(strategy: Any) -> str:
    """The lightning-repro strategy a user of ``strategy`` should pass instead, as the advice names it."""
    if isinstance(strategy, ModelParallelStrategy):
        return "`strategy='model_parallel_repro'` (ReproModelParallelStrategy)"
    if isinstance(strategy, FSDPStrategy):
        return "`strategy='fsdp_repro'` (ReproFSDPStrategy)"
    return "`strategy='ddp_repro'` (ReproDDPStrategy)"
