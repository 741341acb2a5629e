"""Errors and warnings raised by lightning-repro."""

from __future__ import annotations

__all__ = [
    "CorruptStateError",
    "NondeterminismWarning",
    "NotExactWarning",
    "ReproError",
    "ReproWarning",
    "SeedMismatchError",
    "TopologyError",
]


class ReproError(RuntimeError):
    """A mismatch found at run time that would make the run not reproducible."""


class SeedMismatchError(ReproError):
    """A checkpoint written with another seed than the one configured now."""


class CorruptStateError(ReproError):
    """Our checkpoint entry is damaged or does not match its fingerprint."""


class TopologyError(ReproError):
    """World size, node count or dataloader workers changed between save and resume."""


class ReproWarning(UserWarning):
    """Something about reproducibility the user should know."""


class NotExactWarning(ReproWarning):
    """Something will not be bitwise exact (for example a resume from a foreign checkpoint)."""


class NondeterminismWarning(ReproWarning):
    """A source of nondeterminism that cannot be fixed from inside the running process."""
