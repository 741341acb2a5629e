"""The order of a pass as pure functions: computed from its order seed, and sliced.

:func:`_pass_order` computes the order of one pass of a ``SequentialSampler``, ``RandomSampler`` or
``DistributedSampler`` from its order seed (:func:`~lightning_repro.streams.order_seed`), :func:`_order` reads it off a
live sampler, :func:`_sliced_batches` cuts batches ``start, start + 1, ...`` out of it (a resume costs nothing), and
:func:`_global_order` gives the order all ranks of a checkpoint consumed, to re-deal a pass to another world size
(:class:`_Remap`: this rank's share). :class:`~lightning_repro.data.samplers.ReproBatchSampler` yields them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_repro.data.keyed import KeyedBatch, SampleKey
from lightning_repro.seeding import derive_seed, fold_seed32

__all__ = ["_Remap", "_global_order", "_order", "_pass_order", "_sliced_batches", "user_sampler_seed"]


def _order(sampler: Any, order_seed: int, epoch: int) -> Sequence[int] | torch.Tensor | None:
    """The whole index order of one pass, for samplers whose order we can compute; else None."""
    if type(sampler) is SequentialSampler:
        return range(len(sampler.data_source))  # type: ignore[arg-type]
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)  # type: ignore[arg-type]
        return _pass_order({"kind": "random", "n": n, "num_samples": sampler.num_samples}, order_seed, epoch)
    if type(sampler) is DistributedSampler:
        description = {
            "kind": "distributed",
            "n": len(sampler.dataset),  # type: ignore[arg-type]
            "world_size": sampler.num_replicas,
            "shuffle": sampler.shuffle,
            "sampler_drop_last": sampler.drop_last,
        }
        user_seed = user_sampler_seed(sampler)
        if user_seed is not None:
            description["sampler_seed"] = user_seed
        everything = _pass_order(description, order_seed, epoch)
        return everything[sampler.rank :: sampler.num_replicas]
    return None


def user_sampler_seed(sampler: DistributedSampler[Any]) -> int | None:
    """The seed a user gave their own ``DistributedSampler``, which the order mixes in; ``None`` for the others.

    The order of a pass comes from the callback's seed; a ``DistributedSampler``'s own ``seed`` is mixed in when it
    is neither torch's default (0) nor the one Lightning gives the sampler it adds (``PL_GLOBAL_SEED``), so that a
    user who changes it gets another order, as without the callback.
    """
    seed = int(sampler.seed)
    return None if seed in (0, int(os.environ.get("PL_GLOBAL_SEED", 0) or 0)) else seed


def _pass_order(description: dict[str, Any], order_seed: int, epoch: int) -> Sequence[int] | torch.Tensor:
    """The order of one pass of a sampler as :meth:`ReproBatchSampler.describe` describes it: a pure function.

    A ``"distributed"`` pass is the order of all ranks interleaved (rank ``r`` takes ``order[r::world]``), with
    ``DistributedSampler``'s padding or truncation to a multiple of the world size. A ``"random"`` pass draws
    ``num_samples`` indices (``n`` when absent: entries written before it was recorded) as concatenated
    permutations of ``range(n)``. Both the pass itself (:func:`_order`) and the re-deal to another world size
    (:func:`_global_order`) use it, so they cannot disagree.

    Raises:
        ValueError: ``description["kind"]`` is not ``"sequential"``, ``"random"`` or ``"distributed"``.
    """
    kind, n = description["kind"], int(description["n"])
    if kind == "sequential":
        return range(n)
    if kind == "random":
        m = int(description.get("num_samples", n))
        generator = torch.Generator()
        generator.manual_seed(order_seed)
        parts = [torch.randperm(n, generator=generator) for _ in range(m // n)] if n else []
        if n and m % n:
            parts.append(torch.randperm(n, generator=generator)[: m % n])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if kind != "distributed":
        raise ValueError(f"cannot recompute the order of a {kind!r} sampler")
    world = int(description["world_size"])
    if description["shuffle"]:
        base = fold_seed32(order_seed)  # the same on every rank: order_seed has no rank in it
        if description.get("sampler_seed") is not None:  # the user's own sampler's seed (`user_sampler_seed`)
            base = fold_seed32(derive_seed(base, "sampler", str(description["sampler_seed"])))
        generator = torch.Generator()
        generator.manual_seed(base + epoch)  # as DistributedSampler.__iter__ does
        indices: list[int] = torch.randperm(n, generator=generator).tolist()
    else:
        indices = list(range(n))
    if description["sampler_drop_last"] and n % world:
        return indices[: math.ceil((n - world) / world) * world]
    total = math.ceil(n / world) * world
    while indices and len(indices) < total:
        indices += indices[: total - len(indices)]
    return indices


def _sliced_batches(
    order: Sequence[int] | torch.Tensor, batch_size: int | None, drop_last: bool, start: int, seed: int | None
) -> Iterator[Any]:
    """Batches ``start``, ``start + 1``, ... of ``order``: slicing, so the skip costs nothing.

    A tensor order becomes a list once per pass (as ``RandomSampler`` does), not a tensor slice per batch.
    """
    n = len(order)
    if isinstance(order, torch.Tensor):
        order = order.tolist()
    if batch_size is None:  # no auto-collation: single indices
        for position in range(start, n):
            index = int(order[position])
            yield index if seed is None else SampleKey(seed, index)
        return
    num_batches = n // batch_size if drop_last else math.ceil(n / batch_size)
    for j in range(start, num_batches):
        chunk = order[j * batch_size : (j + 1) * batch_size]
        indices: list[Any] = chunk if type(chunk) is list else list(chunk)
        yield indices if seed is None else KeyedBatch(seed, indices)


@dataclass
class _Remap:
    """A pass resumed under another world size: this rank's share of the samples no rank consumed."""

    counter: int
    pass_: int
    indices: list[int]
    length: int  # batches of the whole pass as the epoch loop counts them (consumed + this rank's share)
    pending: bool = True
    active: bool = False


def _global_order(saved: dict[str, Any], order_seed: int, epoch: int) -> list[int]:
    """The order in which the ranks that wrote a checkpoint consumed a pass, interleaved across ranks."""
    order = _pass_order(saved, order_seed, epoch)
    return order.tolist() if isinstance(order, torch.Tensor) else list(order)  # type: ignore[no-any-return]
