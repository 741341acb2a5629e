"""Our warnings, attributed to the user's line, on rank 0; and the one visible line a resume prints.

:func:`warn` is what every warning of lightning-repro goes through. Like Lightning's ``rank_zero_warn`` it warns on
global rank 0 only, but it attributes the warning to the user's frame: the first frame, walking out of the call,
that belongs neither to lightning-repro nor to Lightning, lightning_utilities, torch, jsonargparse or the standard
library (the line that constructed the ``DeterminismCallback``, called ``trainer.fit``, or the user's hook that
made Lightning build a loader). Where no such frame exists (a dataloader worker, a thread), it is the line of
lightning-repro that warned. A fixed ``stacklevel`` cannot do this: the depth of Lightning's call stack differs
from hook to hook. Filtering by category works as for any warning (``warnings.filterwarnings("ignore",
category=NotExactWarning)``).

:class:`WarningCache` is Lightning's ``WarningCache`` (each message once) with :func:`warn` behind it. While a resume
runs it keeps the messages of every :class:`~lightning_repro.NotExactWarning` given (:meth:`WarningCache.collect`,
also those that go straight through :func:`warn`), so the line that says whether the resume is exact gives the reasons.

:data:`resume_log` is the logger of that line: a child of ``lightning.pytorch``, whose handler (the one Lightning
installs when the root logger has none) shows INFO records, as it shows Lightning's "Restored all states from the
checkpoint" line. lightning-repro adds no handler; ``logging.getLogger("lightning.pytorch.lightning_repro")
.setLevel(logging.WARNING)`` silences the line.

This module is at the bottom of the package: of lightning-repro it imports only :mod:`lightning_repro.exceptions`.
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any

from lightning_utilities.core.rank_zero import WarningCache as _LightningWarningCache
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_repro.exceptions import NotExactWarning

__all__ = [
    "PREFIX",
    "RESUME_LOGGER",
    "WarningCache",
    "from_every_rank",
    "is_rank_zero",
    "ranks_text",
    "resume_log",
    "say",
    "user_frame",
    "warn",
]

RESUME_LOGGER = "lightning.pytorch.lightning_repro"
"""The name of :data:`resume_log`: a child of Lightning's ``lightning.pytorch`` logger."""

resume_log = logging.getLogger(RESUME_LOGGER)

PREFIX = "lightning-repro: "
"""What every line of :data:`resume_log` starts with."""

# top-level packages whose frames are never the user's line
_LIBRARIES = frozenset(
    {
        "lightning_repro",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_utilities",
        "torch",
        "jsonargparse",  # LightningCLI builds the callback through it
        "typing_extensions",
    }
)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))
_collecting: list[list[str]] = []  # the notes lists of the caches collecting now (a resume in progress)


def _note(message: str) -> None:
    for notes in _collecting:
        if message not in notes:
            notes.append(message)


def _library(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__")
    if not isinstance(name, str):
        return False
    top = name.partition(".")[0]
    return top in _LIBRARIES or top in _STDLIB or frame.f_code.co_filename.startswith("<frozen ")


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outwards that is the user's (see the module docstring), or ``None``."""
    while frame is not None:
        if not _library(frame):
            return frame
        frame = frame.f_back
    return None


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (Lightning's ``rank_zero_only.rank``; 0 before a Trainer set it)."""
    return getattr(rank_zero_only, "rank", 0) == 0


def warn(message: str, category: type[Warning], *, note: bool = True) -> None:
    """Warn with ``category`` on global rank 0, attributed to the user's line (see the module docstring).

    Args:
        message: The warning's text.
        category: Its category (one of ours).
        note: A :class:`~lightning_repro.NotExactWarning` is a reason for the resume line while a resume runs
            (:meth:`WarningCache.collect`); ``False`` for one the caller reports there itself.
    """
    if note and issubclass(category, NotExactWarning):
        _note(message)
    if not is_rank_zero():
        return
    here = inspect.currentframe()
    caller = here.f_back if here is not None else None
    if caller is None:  # no frame support (not CPython): the default attribution
        warnings.warn(message, category, stacklevel=2)
        return
    while caller.f_back is not None and caller.f_globals.get("__name__") == __name__:
        caller = caller.f_back  # the line of lightning-repro that asked for the warning
    frame = user_frame(caller) or caller
    module_globals = frame.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=registry,
        # no module_globals: linecache would ask the frame's __loader__ for the source, and a frame of a
        # ``python -c`` fork server's __main__ has the BuiltinImporter there, which raises ImportError
    )


def from_every_rank(value: Any, world_size: int) -> list[Any] | None:
    """Every rank's ``value`` in rank order, for a line rank 0 says of every rank.

    ``None`` without a process group (one process, or a world of one). A collective under DDP (one
    ``all_gather_object`` of a small value): every rank calls it, at the same point.
    """
    import torch.distributed as dist

    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 1-3``, ``ranks 0, 2, 5-7``: ranks as a line names them (runs of neighbours joined)."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    spans: list[str] = []
    for run in runs:  # two neighbours are listed, three or more are a span
        spans += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(rank) for rank in run]
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def say(message: str) -> None:
    """Log ``PREFIX + message`` at INFO on rank 0 through :data:`resume_log` (shown by default)."""
    if is_rank_zero():
        resume_log.info(PREFIX + message)


class WarningCache(_LightningWarningCache):
    """Lightning's ``WarningCache`` (each message once per cache), warning through :func:`warn`.

    While :meth:`collect` is on, the message of every :class:`~lightning_repro.NotExactWarning` given (also a
    repeated one, and on every rank) is kept in :attr:`notes`: what a resume says it lost.
    """

    def __init__(self, warned: Iterable[str] = ()) -> None:  # a set's copy and pickle pass its items
        super().__init__(warned)
        self.notes: list[str] | None = None
        self._infos: set[str] = set()

    def collect(self) -> None:
        """Start keeping the messages of :class:`~lightning_repro.NotExactWarning` (a fit begins)."""
        self.take_notes()
        self.notes = []
        _collecting.append(self.notes)

    def take_notes(self) -> list[str]:
        """The messages kept since :meth:`collect`; stop keeping them."""
        notes, self.notes = self.notes, None
        if notes is None:
            return []
        for index, collecting in enumerate(_collecting):
            if collecting is notes:
                del _collecting[index]
                break
        return notes

    def warn(self, message: str, stacklevel: int = 5, *, note: bool = True, **kwargs: Any) -> None:
        """Warn ``message`` once with ``category=`` (``note``: see :func:`warn`); ``stacklevel`` is not used."""
        category = kwargs.get("category", UserWarning)
        if note and self.notes is not None and issubclass(category, NotExactWarning) and message not in self.notes:
            self.notes.append(message)
        if message not in self:
            self.add(message)
            warn(message, category, note=note)

    def info_once(self, logger: logging.Logger, message: str) -> None:
        """Log ``message`` at INFO on rank 0, once per cache (a supported, exact case: not a warning)."""
        if message not in self._infos:
            self._infos.add(message)
            if is_rank_zero():
                logger.info(message)
