"""webdataset's stages that seed themselves: those no seed reaches, and those that count their own passes.

* **what cannot be repeated at all** (:func:`unrepeatable_stages`): ``.shuffle(n)`` (and
  ``WebDataset(shardshuffle=n)``) without ``seed`` or ``rng`` builds ``random.Random(pid + time)`` at every pass,
  and ``ResampledShards`` without ``deterministic=True`` (what ``WebDataset(urls, resampled=True)`` makes) seeds
  each pass from the process id, the clock and ``os.urandom``: neither a repeat nor a resume is exact;
* **what counts its passes itself** (:func:`stage_epochs`, :func:`set_stage_epochs`): ``detshuffle`` and
  ``ResampledShards(deterministic=True)`` add one to their ``epoch`` at every pass and seed the pass from it (and
  their seed; the resampling also from the worker and the rank), counted in the copy that iterates, which a
  resumed process starts afresh.

The library is never imported: its objects are recognised by the module of their class. Part of ``data/``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["set_stage_epochs", "shuffle_arguments", "stage_epochs", "unrepeatable_advice", "unrepeatable_stages"]

_RESAMPLED = "ResampledShards"


def _webdataset(obj: Any) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "webdataset"


def _stages(dataset: Any) -> list[Any]:
    """The stages of a webdataset pipeline, nested pipelines included, outermost first."""
    found: list[Any] = []
    todo, seen = [dataset], 0
    while todo and seen < 256:
        node = todo.pop()
        seen += 1
        if not _webdataset(node):
            continue
        found.append(node)
        stages = getattr(node, "pipeline", None)
        if isinstance(stages, list):
            todo.extend(reversed(stages))
    return found


def unrepeatable_stages(dataset: Any) -> list[str]:
    """The stages of a webdataset pipeline whose draws no seed of ours reaches (``.shuffle(8)``, ``ResampledShards``).

    See the module: each as the user wrote it, the shuffle's advice being ``.shuffle(8, seed=...)``.
    """
    if not _webdataset(dataset):
        return []
    found = []
    for stage in _stages(dataset)[1:]:
        if type(stage).__name__ == _RESAMPLED and not getattr(stage, "deterministic", True):
            found.append(_RESAMPLED)
            continue
        shuffle = shuffle_arguments(stage)
        if shuffle is not None and shuffle[1] is None and shuffle[2] is None:
            found.append(f".shuffle({shuffle[0]})")
    return found


def shuffle_arguments(stage: Any) -> tuple[Any, Any, Any] | None:
    """``(bufsize, rng, seed)`` of webdataset's ``.shuffle(...)`` stage, or ``None`` for any other stage."""
    function = getattr(stage, "f", None)
    if getattr(function, "__name__", "") != "_shuffle" or not getattr(function, "__module__", "").startswith(
        "webdataset"
    ):
        return None
    args, kw = tuple(getattr(stage, "args", ())), dict(getattr(stage, "kw", {}))
    # _shuffle(data, bufsize=1000, initial=100, rng=None, seed=None, handler=None): the curried args follow data
    return (
        kw.get("bufsize", args[0] if args else 1000),
        kw.get("rng", args[2] if len(args) > 2 else None),
        kw.get("seed", args[3] if len(args) > 3 else None),
    )


def unrepeatable_advice(stage: str) -> str:
    """How to seed a stage :func:`unrepeatable_stages` named."""
    if stage == _RESAMPLED:
        return (
            "start a `wds.DataPipeline` with `wds.ResampledShards(urls, deterministic=True)` (webdataset's"
            " `WebDataset(urls, resampled=True)` cannot take it)"
        )
    return f"give it a seed, e.g. `{stage[:-1]}, seed=...)` (or `rng=random.Random(...)`)"


def _counting_stages(dataset: Any) -> list[Any]:
    """The stages of a webdataset pipeline that count their passes: ``detshuffle``, deterministic resampling."""
    counting = []
    for node in _stages(dataset):
        name = type(node).__name__
        counts = name == "detshuffle" or (name == _RESAMPLED and getattr(node, "deterministic", False))
        if counts and isinstance(getattr(node, "epoch", None), int):
            counting.append(node)
    return counting


def stage_epochs(dataset: Any) -> list[int] | None:
    """The pass counts of ``dataset``'s counting stages (see the module), outermost first (``None``: none).

    Each adds one to its ``epoch`` at every pass and seeds the pass from it; no ``set_epoch`` reaches it. Its count
    lives in the copy that iterates: the main process's with ``num_workers=0``, else each worker's, which starts
    from the main process's copy (so every pass of non-persistent workers counts 0) and goes on counting in a
    persistent worker.
    """
    stages = _counting_stages(dataset)
    return [int(stage.epoch) for stage in stages] if stages else None


def set_stage_epochs(dataset: Any, epochs: list[int]) -> None:
    """Give ``dataset``'s counting stages the pass counts :func:`stage_epochs` read (a resumed pass's)."""
    stages = _counting_stages(dataset)
    if len(stages) == len(epochs):
        for stage, epoch in zip(stages, epochs, strict=True):
            stage.epoch = int(epoch)
