"""A wrapper we made around a train loader we prepared (webdataset's ``WebLoader``), and the loader inside it.

Lightning iterates the wrapper; whatever looks for the train loaders (their positions, their samplers, the
generators their datasets hold) looks at the prepared loader inside (:func:`unwrap`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PREPARED_INSIDE", "unwrap"]

PREPARED_INSIDE = "_lightning_repro_loader"
"""The attribute of a wrapper we made around a loader we prepared (``data/webloader.py``): that loader."""


def unwrap(loader: Any) -> Any:
    """The prepared loader a wrapper of ours iterates (webdataset's ``WebLoader``); any other object as it is."""
    try:
        return vars(loader).get(PREPARED_INSIDE, loader)
    except TypeError:  # no __dict__
        return loader
