"""A train iterator Lightning made before the checkpoint was restored, made again once it is.

``loops/fit_loop.py: FitLoop.setup_data`` builds the train loader, loads the loaders' own saved states
(``_load_combined_loader_states``, only while the loop restarts) and creates the iterator
(``iter(self._data_fetcher)``). Called before the restore (``trainer.estimated_stepping_batches`` in
``configure_optimizers``, as a ``OneCycleLR`` sized by it does; a callback reading ``trainer.train_dataloader`` in
``setup``), it did all three for a fresh run, and Lightning runs none of them again on resume: the iterator is of a
fresh run's first epoch, and the loaders' states (litdata's position, a ``torchdata.nodes`` ``Loader``'s, a
``StatefulDataLoader``'s) are never loaded, in plain Lightning too. :func:`restart_train_iterator` does what
``setup_data`` would have done after the restore (checked against Lightning 2.5 and 2.6).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_repro._lightning.prepared import unwrap

__all__ = ["restart_train_iterator"]


def restart_train_iterator(trainer: pl.Trainer, fresh_workers: bool = False) -> None:
    """Load the train loaders' saved states (where the loop restarts mid-epoch) and re-create the train iterator.

    ``fresh_workers``: end the persistent workers the early iterator started first (``DataLoader._iterator``): their
    dataset copies were taken before the resumed position was given to the dataset; new ones copy it as it is now.
    """
    loop = trainer.fit_loop
    loop._load_combined_loader_states()  # nothing where not restarting (an epoch-end checkpoint) or nothing saved
    combined = loop._combined_loader
    if fresh_workers and combined is not None:
        for loader in combined.flattened:
            _end_persistent_workers(unwrap(loader))  # a WebLoader's: the DataLoader inside it
    fetcher = loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def _end_persistent_workers(loader: Any) -> None:
    iterator = vars(loader).get("_iterator")
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
        loader._iterator = None
