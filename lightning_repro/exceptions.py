"""Errors and warnings raised by lightning-repro."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointReadError",
    "CorruptStateError",
    "DivergenceError",
    "EnvironmentDriftError",
    "InputError",
    "NondeterminismWarning",
    "NotExactWarning",
    "ReproError",
    "ReproWarning",
    "RestoreError",
    "SeedMismatchError",
    "SeedRunError",
    "TopologyError",
]


class ReproError(RuntimeError):
    """A mismatch found at run time that would make the run not reproducible."""


class SeedMismatchError(ReproError):
    """A checkpoint written with another seed than the one configured now."""


class CorruptStateError(ReproError):
    """Our checkpoint entry is damaged or does not match its fingerprint.

    The message always ends with what to do next: resume from an earlier checkpoint, or load this
    one without its lightning-repro entry (``DeterminismCallback(seed, ignore_checkpoint_state=True)``),
    which gives up exactness.
    """

    def __str__(self) -> str:
        return (
            f"{super().__str__()}. Resume from an earlier checkpoint to continue exactly; or, to go on without"
            " exactness, pass `ignore_checkpoint_state=True` to DeterminismCallback, which loads this checkpoint"
            " (weights, optimizer, loops) but ignores its lightning-repro entry"
        )


class CheckpointReadError(ReproError):
    """A checkpoint file could not be read (truncated, damaged or not a checkpoint)."""


class EnvironmentDriftError(ReproError):
    """The environment changed since the checkpoint was written in a way that can break bitwise continuation.

    Raised on resume with ``DeterminismCallback(..., on_env_drift="error")``; the message lists each such field
    (saved -> current).
    """


class DivergenceError(ReproError):
    """A run differs from the run it must continue or repeat (the message names the step, the field and the cause).

    Raised by the continuation check of a resumed run (``DeterminismCallback(trace=..., on_divergence="error")``).
    """


class InputError(ReproError, ValueError):
    """A file or argument given to a reader or to the CLI is missing or malformed (the CLI exits 2 on it).

    The message is one line that names the input and says what is wrong with it.
    """


class SeedRunError(ReproError):
    """One or more seeds of :func:`~lightning_repro.stats.seeds.run_seeds` failed (raised, crashed or timed out).

    Attributes:
        failures: ``{seed: one-line reason}`` for each seed that failed.
        report: The :class:`~lightning_repro.stats.seeds.SeedReport` of the seeds that succeeded, or ``None``.
    """

    def __init__(self, message: str, *, failures: dict[int, str], report: Any = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.report = report


class RestoreError(ReproError):
    """What a resume restored differs from what the checkpoint saved (the message names the components)."""


class TopologyError(ReproError):
    """World size, node count or dataloader workers changed between save and resume."""


class ReproWarning(UserWarning):
    """Something about reproducibility the user should know."""


class NotExactWarning(ReproWarning):
    """Something will not be bitwise exact (for example a resume from a foreign checkpoint)."""


class NondeterminismWarning(ReproWarning):
    """A source of nondeterminism that cannot be fixed from inside the running process."""
