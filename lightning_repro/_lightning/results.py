"""What ``self.log`` and torchmetrics hold between two checkpoints: Lightning's result collections and metric dicts.

Checked against Lightning 2.5.6 and 2.6.6 (``trainer/connectors/logger_connector/result.py`` and
``logger_connector.py``, the same fields in both) and torchmetrics 1.x (``torchmetrics/metric.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

__all__ = [
    "REDUCTIONS",
    "LoggedAtBatchStart",
    "eval_metric_ids",
    "finish_logged_values",
    "logged_metric_ids",
    "logged_since",
    "logged_values",
    "restore_logged_values",
    "restore_trainer_metrics",
    "resume_inside_epoch",
    "set_metric_update_count",
    "step_caches",
    "trainer_metrics",
]


# ---------------------------------------------------------------------------------------- logged values and metrics
_METRIC_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")
REDUCTIONS = ("mean", "sum", "max", "min")
"""The reductions ``self.log(reduce_fx=...)`` accepts that we save (``_Metadata.is_<name>_reduction``)."""


def trainer_metrics(trainer: pl.Trainer, *, batch_end: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` as they are at the checkpoint.

    Read from ``trainer/connectors/logger_connector/logger_connector.py`` (``_callback_metrics`` & co., the dicts
    behind the public properties). The callbacks that monitor a value (``ModelCheckpoint(monitor=...)``,
    ``EarlyStopping``) read them until the next validation updates them; a resumed run must see the same values.
    ``batch_end``: the checkpoint is written in a training batch's ``on_train_batch_end``. Right after that hook
    ``_LoggerConnector.on_batch_end`` puts the batch's logged values into the three dicts; the resumed run starts
    with the next batch and does not, so they are saved as that call leaves them (an epoch-end or validation-end
    save after the checkpoint holds them, as the uninterrupted run's does).
    """
    connector = trainer._logger_connector
    after_batch = {"_progress_bar_metrics": "pbar", "_callback_metrics": "callback", "_logged_metrics": "log"}
    # the step values only (`_first_loop_iter` set): the epoch values would be computed, and synced, by this read
    on_step = batch_end and trainer._results is not None and connector._first_loop_iter is not None
    batch = connector.metrics if on_step else None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in _METRIC_DICTS:
        values = dict(getattr(connector, name, None) or {})
        if batch is not None:
            values.update(batch[after_batch[name]])  # type: ignore[literal-required]
        out[name] = {
            key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            for key, value in values.items()
            if isinstance(value, (torch.Tensor, int, float))
        }
    return out


def restore_trainer_metrics(trainer: pl.Trainer, saved: dict[str, Any]) -> None:
    """Put back what :func:`trainer_metrics` saved, on the strategy's root device."""
    connector = trainer._logger_connector
    for name, values in saved.items():
        if name in _METRIC_DICTS and isinstance(values, dict):
            device = trainer.strategy.root_device
            getattr(connector, name).update({key: value.to(device) for key, value in values.items()})


def logged_metric_ids(trainer: pl.Trainer) -> set[int]:
    """Ids of the Metric objects logged with ``on_epoch=True``: Lightning resets them after the epoch.

    Read from the training epoch's ``_ResultCollection`` (``loops/training_epoch_loop.py: _results``).
    """
    results = trainer.fit_loop.epoch_loop._results
    return {id(m.value) for m in results.values() if not m.is_tensor and m.meta.on_epoch}


def eval_metric_ids(trainer: pl.Trainer) -> set[int]:
    """Ids of the Metric objects logged in validation: Lightning resets them when each validation ends.

    A checkpoint written in ``on_validation_end`` (where a monitored ``ModelCheckpoint`` saves) sees them still
    holding the finished validation's states; the run that goes on resets them right after, so they are not saved.
    Read from ``loops/evaluation_loop.py: _results``.
    """
    results = trainer.fit_loop.epoch_loop.val_loop._results
    return {id(m.value) for m in results.values() if not m.is_tensor}


class LoggedAtBatchStart:
    """The epoch aggregates of ``self.log`` as they were when the current training batch started (copy on write).

    ``_ResultCollection.update_metrics`` (``trainer/connectors/logger_connector/result.py``) is wrapped on the
    training epoch's results: the first update of a key in a batch keeps the key's ``value``,
    ``cumulated_batch_size`` and update count from before it (``_ResultMetric.update`` binds new tensors, it never
    changes them in place; a reset does too). :meth:`batch_start` forgets them: nothing is copied per batch.
    """

    def __init__(self) -> None:
        self.before: dict[str, tuple[Any, Any, int]] = {}

    def batch_start(self) -> None:
        """A training batch starts: what its updates change is kept from here on."""
        self.before.clear()

    def install(self, trainer: pl.Trainer) -> Callable[[], None]:
        """Wrap the training results' ``update_metrics`` (on the instance); returns the undo."""
        results = trainer.fit_loop.epoch_loop._results
        original, before = results.update_metrics, self.before
        previous = vars(results).get("update_metrics")

        def update_metrics(key: str, value: Any, batch_size: int) -> None:
            if key not in before:
                metric = results[key]
                batch_size_so_far = getattr(metric, "cumulated_batch_size", None)  # a mean's only
                # one put back by a resume holds the saved aggregate (its own count starts again)
                count = 1 if getattr(metric, "_repro_seeded", False) else int(metric._update_count)
                before[key] = (getattr(metric, "value", None), batch_size_so_far, count)
            original(key, value, batch_size)

        results.update_metrics = update_metrics  # type: ignore[method-assign]

        def undo() -> None:
            _unwrap(results)  # a resume's wrappers, on top of this one (an exception before the epoch's end)
            if previous is None:
                vars(results).pop("update_metrics", None)
            else:
                results.update_metrics = previous  # type: ignore[method-assign]

        return undo


def logged_values(trainer: pl.Trainer, before: dict[str, tuple[Any, Any, int]] | None = None) -> dict[str, Any]:
    """The epoch aggregates of ``self.log`` so far, as plain values and tensors.

    Read from the ``_ResultMetric`` objects and their ``_Metadata`` (``trainer/connectors/logger_connector/
    result.py``; the same fields in 2.5 and 2.6). ``before``: :attr:`LoggedAtBatchStart.before`, the values as
    they were at the current batch's start (a key that held no update then is left out, as a new key). A key reset
    since its last update (Lightning keeps an ended epoch's keys, reset, until they are logged again) is left out too:
    it holds nothing, and a run resumed from a file written after that epoch (``trainer.save_checkpoint`` after
    ``fit``, say) does not have it, so its later files would differ from the uninterrupted run's.
    """
    results = trainer.fit_loop.epoch_loop._results
    out: dict[str, Any] = {}
    for key, metric in results.items():
        meta = metric.meta
        if not meta.on_epoch or (not metric.is_tensor and not meta.metric_attribute):
            continue
        reduce = next(r for r in REDUCTIONS if getattr(meta, f"is_{r}_reduction"))
        tensor = metric.is_tensor
        value: Any = getattr(metric, "value", None)
        batch_size: Any = getattr(metric, "cumulated_batch_size", None)
        if tensor and before is not None and key in before:
            value, batch_size, count = before[key]
            if count == 0:
                continue
        elif tensor and getattr(metric, "has_reset", False):  # Lightning's flag: reset, not updated since
            continue
        out[key] = {
            "is_tensor": tensor,
            "value": value.detach().cpu().clone() if tensor else None,
            "cumulated_batch_size": batch_size.detach().cpu().clone() if tensor and reduce == "mean" else None,
            "fx": meta.fx,
            "name": meta.name,
            "prog_bar": bool(meta.prog_bar),
            "logger": bool(meta.logger),
            "on_step": bool(meta.on_step),
            "reduce": reduce,
            "enable_graph": bool(meta.enable_graph),
            "add_dataloader_idx": bool(meta.add_dataloader_idx),
            "dataloader_idx": meta.dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "sync": bool(meta.sync.should),
            "rank_zero_only": bool(meta.sync.rank_zero_only),
        }
    return out


def restore_logged_values(trainer: pl.Trainer, logged: dict[str, Any]) -> None:
    """Put back the epoch aggregates of ``self.log`` (from :func:`logged_values`) into the epoch's results.

    Builds ``_ResultMetric`` objects with their ``_Metadata`` and ``_Sync`` (``trainer/connectors/logger_connector/
    result.py``). When the run logs a key again, Lightning compares its metadata with the stored one
    (``_ResultCollection.log``): the first log after the resume creates the entry itself, starting from the saved
    aggregate, through temporary wrappers of ``log`` and ``update_metrics`` (removed by
    :func:`finish_logged_values`).
    """
    if not logged:
        return
    results = trainer.fit_loop.epoch_loop._results
    _unwrap(results)  # a resume that did not reach the end of its epoch (fit called again)
    vars(results)["_repro_wrapped"] = {name: vars(results).get(name) for name in ("log", "update_metrics")}
    saved_values: dict[str, dict[str, Any]] = {}
    for key, item in logged.items():
        meta = _Metadata(
            fx=item["fx"],
            name=item["name"],
            prog_bar=item["prog_bar"],
            logger=item["logger"],
            on_step=item["on_step"],
            on_epoch=True,
            reduce_fx=item["reduce"],
            enable_graph=item["enable_graph"],
            add_dataloader_idx=item["add_dataloader_idx"],
            dataloader_idx=item["dataloader_idx"],
            metric_attribute=item["metric_attribute"],
        )
        meta.sync = _Sync(_should=item["sync"], fn=trainer.strategy.reduce, rank_zero_only=item["rank_zero_only"])
        is_tensor = bool(item.get("is_tensor", True))
        metric = _ResultMetric(meta, is_tensor)
        if is_tensor:
            _set_logged(metric, item)
            saved_values[key] = item
        else:
            metric.value = _module_attribute(trainer.lightning_module, item["metric_attribute"])
            metric._repro_seeded = True
        metric._update_count = 1  # it holds updates: computing it must not warn that it has none
        results[key] = metric
    original_log = results.log
    original_update = results.update_metrics

    def log(fx: str, name: str, *args: Any, **kwargs: Any) -> None:
        key = f"{fx}.{name}"
        if results.dataloader_idx is not None and kwargs.get("add_dataloader_idx", True):
            key += f".{results.dataloader_idx}"
        if key in saved_values and key in results and getattr(results[key], "_repro_seeded", False):
            del results[key]
        original_log(fx, name, *args, **kwargs)

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        item = saved_values.pop(key, None)
        if item is not None and not getattr(results[key], "_repro_seeded", False):
            _set_logged(results[key], item)
        original_update(key, value, batch_size)
        if not saved_values:
            _unwrap(results)

    results.log = log  # type: ignore[method-assign]
    results.update_metrics = update_metrics  # type: ignore[method-assign]


def _module_attribute(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set_logged(metric: Any, item: dict[str, Any]) -> None:
    device = metric.value.device
    metric.value = item["value"].to(device)
    if item["cumulated_batch_size"] is not None:
        metric.cumulated_batch_size = item["cumulated_batch_size"].to(device)
    metric._repro_seeded = True


def finish_logged_values(trainer: pl.Trainer) -> None:
    """Remove the temporary wrappers of :func:`restore_logged_values` at the end of the resumed epoch."""
    _unwrap(trainer.fit_loop.epoch_loop._results)


def _unwrap(results: Any) -> None:
    """Put back the ``log`` and ``update_metrics`` the results had before :func:`restore_logged_values` wrapped them."""
    previous = vars(results).pop("_repro_wrapped", None)
    for name, value in (previous or {}).items():
        if value is None:
            vars(results).pop(name, None)
        else:
            setattr(results, name, value)


def resume_inside_epoch(trainer: pl.Trainer) -> None:
    """Tell the logger connector that the resumed epoch's first batch is behind it (a mid-epoch resume).

    ``_LoggerConnector._first_loop_iter`` is ``True`` during an epoch's first batch and ``False`` after it
    (``on_batch_start``). While it is not ``False``, the first ``self.log`` of a hook after another hook's
    (``should_reset_tensors``) resets that hook's logged tensors, their epoch aggregates included: in the
    uninterrupted run that happens at the epoch's first batch only. A fresh connector would take the first resumed
    batch for the epoch's first one and reset what the resume put back (the aggregates of the epoch's earlier
    batches, the part of the checkpoint's batch logged in the rest of its ``on_train_batch_end``).
    """
    connector = trainer._logger_connector
    if connector._first_loop_iter is None:
        connector._first_loop_iter = True  # the next batch's on_batch_start makes it False, as in the uninterrupted run


def step_caches(trainer: pl.Trainer) -> dict[str, Any]:
    """Each training result's step value as it is now (by identity: ``_ResultMetric.update`` binds a new tensor)."""
    results = trainer.fit_loop.epoch_loop._results
    return {key: getattr(metric, "_forward_cache", None) for key, metric in results.items()}


def logged_since(trainer: pl.Trainer, before: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The step values of ``self.log`` logged since :func:`step_caches` gave ``before``.

    In the layout of ``_ResultCollection.metrics(on_step=True)``: ``{"log": ..., "callback": ..., "pbar": ...}``,
    by the names Lightning gives them (forked names).
    """
    results = trainer.fit_loop.epoch_loop._results
    now = step_caches(trainer)
    names: set[str] = set()
    for key, metric in results.items():
        if metric.meta.on_step and (key not in before or before[key] is not now[key]):
            names.update((metric.meta.name, metric.meta.forked_name(True)))  # training: no loader suffix
    values = results.metrics(on_step=True)
    return {kind: {k: v for k, v in values[kind].items() if k in names} for kind in ("log", "callback", "pbar")}  # type: ignore[literal-required]


def set_metric_update_count(metric: Any, count: int) -> None:
    """Give a torchmetrics ``Metric`` back its update count and drop its cached value.

    torchmetrics (``torchmetrics/metric.py``, 1.x) exposes ``update_count`` read-only; the count and the cached
    ``compute()`` result live in ``_update_count`` and ``_computed``. Lightning's logging of a Metric object reads both.
    """
    metric._update_count = int(count)
    metric._computed = None
