"""Lightning's ``DDPStrategy`` with a public seam around the configuration of its launcher.

``strategies/ddp.py: DDPStrategy._configure_launcher`` (Lightning 2.5, 2.6) creates the launcher that starts the
ranks; :class:`LauncherHooks` overrides it once, here, so that the strategies of lightning-repro subclass public
names only: :meth:`~LauncherHooks.before_launcher` runs before the launcher is created and
:meth:`~LauncherHooks.wrap_launch` wraps its ``launch`` (the call that starts the ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

__all__ = ["LauncherHooks"]


class LauncherHooks(DDPStrategy):
    """A ``DDPStrategy`` whose launcher configuration calls :meth:`before_launcher` and :meth:`wrap_launch`."""

    @override
    def _configure_launcher(self) -> None:
        self.before_launcher()
        super()._configure_launcher()
        launcher = self.launcher
        if launcher is not None:
            launcher.launch = self.wrap_launch(launcher.launch)  # type: ignore[method-assign]

    def before_launcher(self) -> None:
        """Runs right before Lightning creates the launcher (default: nothing)."""

    def wrap_launch(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        """The launcher's ``launch`` as the ranks are started with it (default: unchanged)."""
        return launch
