"""The graph of a ``torchdata.nodes`` ``Loader``, inspected: its nodes' kinds and what keeps it from being pinned.

Used by :mod:`lightning_repro.data.nodes`, which takes the graph over. torchdata's own nodes are known by their exact
class. A node of another class (the user's own ``BaseNode``) that pulls from one node, its ``source``, and holds no
other is taken over around: the nodes under it are keyed, and the node is copied as it is; what it draws is not pinned
unless its class says it draws nothing (``lightning_repro_draws_nothing = True``), which also says it pulls its source
in the thread that calls it. Any other node (several sources, or one held under another name) leaves the whole loader
as it is. Part of ``data/``: imports the bottom layer only.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data._utils.collate import default_collate, default_convert

from lightning_repro.data.nodekeys import draws_nothing

__all__ = [
    "CUSTOM",
    "DRAWS_NOTHING_FLAG",
    "DRAW_NOTHING",
    "UNKNOWN",
    "map_fn",
    "node_kind",
    "pulls_in_thread",
    "source_of",
    "sources_of",
    "why_not_exact",
]

DRAW_NOTHING = (default_collate, default_convert)  # map_fns that draw nothing (exact in any thread)
UNKNOWN = " is not one lightning-repro knows"
CUSTOM = "Custom"  # node_kind of a node of another class over one source
DRAWS_NOTHING_FLAG = "lightning_repro_draws_nothing"


def _holds_node(value: Any, base: type) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, base) for item in value)
    return isinstance(value, base)


def _over_one_source(node: Any) -> bool:
    """Whether ``node`` holds one node, its ``source``, and no other (in its attributes, or in a dict, list, tuple)."""
    from torchdata.nodes import BaseNode  # type: ignore[import-untyped]

    if not isinstance(node, BaseNode) or not isinstance(getattr(node, "source", None), BaseNode):
        return False
    return not any(_holds_node(value, BaseNode) for name, value in vars(node).items() if name != "source")


def _node_types() -> dict[str, type]:
    import torchdata.nodes as tn  # type: ignore[import-untyped]

    names: tuple[str, ...] = ("SamplerWrapper", "IterableWrapper", "ParallelMapper", "Batcher", "Unbatcher")
    names += ("Prefetcher", "PinMemory", "MultiNodeWeightedSampler")
    return {name: getattr(tn, name) for name in names}


def node_kind(node: Any) -> str | None:
    """The torchdata class ``node`` is an instance of, exactly (a subclass may draw or pull on its own).

    :data:`CUSTOM` for a node of another class over one source; None for another node.
    """
    kind = next((name for name, cls in _node_types().items() if type(node) is cls), None)
    return kind if kind is not None else CUSTOM if _over_one_source(node) else None


def pulls_in_thread(node: Any) -> bool:
    """Whether ``node`` pulls its source in a thread of its own (its source's inline work runs there)."""
    kind = node_kind(node)
    return kind in ("Prefetcher", "PinMemory") or (kind == "ParallelMapper" and node.num_workers > 0)


def map_fn(node: Any) -> Any:
    """The user's ``map_fn`` of a ``ParallelMapper`` (under ``prebatch``, torchdata wraps it in ``MapOverBatch``)."""
    return node.map_fn.map_fn if node.prebatch is not None else node.map_fn


def source_of(node: Any) -> Any:
    """The node ``node`` pulls from (a ``ParallelMapper`` under ``prebatch`` holds torchdata's ``Batcher`` over it)."""
    source: Any = getattr(node, "source", None)
    return source.source if node_kind(node) == "ParallelMapper" and node.prebatch is not None else source


def sources_of(node: Any) -> list[Any]:
    """The nodes ``node`` pulls from: a ``MultiNodeWeightedSampler``'s sources, else its one source (or none)."""
    if node_kind(node) == "MultiNodeWeightedSampler":
        return list(node.source_nodes.values())
    source = source_of(node)
    return [] if source is None else [source]


def why_not_exact(loader: Any) -> list[str]:
    """What keeps a ``Loader``'s pipeline from being pinned (empty: every node is taken over exactly)."""
    reasons: list[str] = []

    def walk(node: Any, threaded: bool, restarted_in_thread: bool = False) -> None:
        kind = node_kind(node)
        if kind is None:
            reasons.append(f"its node {type(node).__name__}{UNKNOWN}")
            return
        if kind == CUSTOM and not getattr(type(node), DRAWS_NOTHING_FLAG, False):
            reasons.append(
                f"its node {type(node).__name__} is not one of torchdata's, so what it draws, if anything, is not"
                f" pinned (the nodes under it are; a node that draws nothing and pulls its source in the thread"
                f" calling it can say so: `{DRAWS_NOTHING_FLAG} = True` on its class)"
            )
        if kind == "ParallelMapper":
            draws = map_fn(node) not in DRAW_NOTHING
            name = getattr(map_fn(node), "__name__", type(map_fn(node)).__name__)
            if draws and node.num_workers > 0 and node.method == "thread":
                reasons.append(
                    f"its ParallelMapper runs `{name}` in threads (method='thread'), which share the process's random"
                    " streams with training, so what it draws cannot be pinned (method='process' is exact)"
                )
            elif draws and node.num_workers == 0 and threaded:
                reasons.append(
                    f"its Mapper `{name}` runs in the thread of a Prefetcher, PinMemory or ParallelMapper above it,"
                    " which shares the process's random streams with training, so what it draws cannot be pinned"
                    " (a ParallelMapper with method='process' is exact)"
                )
            if node.num_workers > 0 and not node.in_order:
                reasons.append("its ParallelMapper has in_order=False: items come in the order its workers finish")
        if kind == "SamplerWrapper" and not hasattr(node.sampler, "__len__") and not hasattr(node.sampler, "generator"):
            reasons.append(f"its sampler {type(node.sampler).__name__} has neither a length nor a `generator`")
        elif kind == "SamplerWrapper" and restarted_in_thread and not draws_nothing(node.sampler):
            reasons.append(
                f"its sampler {type(node.sampler).__name__} has no `generator` and is restarted by a"
                " MultiNodeWeightedSampler in the thread of a Prefetcher, PinMemory or ParallelMapper above it, where"
                " the process's random streams are training's, so the order it draws there cannot be pinned"
            )
        restarted_in_thread |= kind == "MultiNodeWeightedSampler" and threaded  # it restarts sources mid-pass
        for source in sources_of(node):
            walk(source, threaded or pulls_in_thread(node), restarted_in_thread)

    walk(loader.root, False)
    return list(dict.fromkeys(reasons))
