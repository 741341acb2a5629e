"""Protocols for the duck-typed checks: what lightning-repro asks of objects it does not own."""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable

__all__ = ["Stateful", "is_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """An object whose position can be saved and restored, as torch's ``Stateful`` and torchdata's loaders do."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state, as plain values and tensors."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back a state from :meth:`state_dict`."""


def is_stateful(obj: Any) -> TypeGuard[Stateful]:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict`` (``None`` attributes do not count).

    Examples:
        >>> is_stateful(object()), is_stateful(type("S", (), {"state_dict": dict, "load_state_dict": print})())
        (False, True)
    """
    return all(callable(getattr(obj, name, None)) for name in ("state_dict", "load_state_dict"))
