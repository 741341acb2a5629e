"""The streaming pipelines of ``tests/test_streaming_libs.py``, each built as its library's docs tell users to.

:func:`write_data` writes one small data set in every library's format (JSON lines and parquet shards for HF
``datasets``, tar shards for webdataset, a ``litdata.optimize``d directory); :func:`train_loader` builds the train
loader of a scenario run (``tests/scenario.py`` with ``"pipeline": {"lib": ..., "data": DIR}``) in the module's
``train_dataloader``, where the rank is known, and :func:`set_epoch` is what the module calls in
``on_train_epoch_start``, as HF's docs show. Every item is ``{"x", "y", "i"}`` (its index in the data set) and is
augmented from torch's global RNG in the library's ``map``/transform. The libraries are imported here only when a
pipeline of theirs is built, so the main suite collects without them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

N, DIM, SHARDS = 40, 8, 4  # 40 items in 4 shards: 2 workers (and 2 ranks) get whole shards
SEED = 11  # the pipelines' own seeds (shuffles); the run's seed is the scenario's

LIBS = (
    *("hf", "hf_parquet", "hf_sdl", "hf_mix", "hf_mix_sdl"),
    *("litdata", "litdata_combined", "litdata_parallel"),
    *("wds", "wds_unseeded", "wds_det", "wds_resampled", "wds_resampled_det"),
    "nodes",
)

_SET_EPOCH: list[Any] = []  # the dataset whose set_epoch the module calls at every epoch start


def _items() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, DIM, generator=g), torch.randn(N, 1, generator=g)


def _litdata_item(i: int) -> dict[str, Any]:
    x, y = _items()
    return {"x": x[i], "y": y[i], "i": i}


def write_data(root: Path) -> Path:
    """Write the data set in every format under ``root`` (JSON lines, parquet, tar shards, litdata); ``root``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = _items()
    per = N // SHARDS
    for kind in ("json", "parquet", "wds"):
        (root / kind).mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        ids = range(shard * per, (shard + 1) * per)
        rows = [{"x": x[i].tolist(), "y": y[i].tolist(), "i": i} for i in ids]
        (root / "json" / f"part-{shard}.jsonl").write_text("".join(f"{_json(row)}\n" for row in rows))
        pq.write_table(pa.Table.from_pylist(rows), root / "parquet" / f"part-{shard}.parquet")
        _write_tar(root / "wds" / f"shard-{shard:02d}.tar", rows)
    _write_litdata(root / "litdata")
    return root


def written_data(root: Path) -> str:
    """:func:`write_data` into ``root`` in a fresh process (litdata.optimize starts workers); ``root`` as a string."""
    import runner

    code, _, stderr = runner.execute([__file__, str(root)])
    assert code == 0, stderr[-4000:]
    return str(root)


def _json(row: dict[str, Any]) -> str:
    import json

    return json.dumps(row)


def _write_tar(path: Path, rows: list[dict[str, Any]]) -> None:
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for row in rows:
            x = np.asarray(row["x"], dtype=np.float32)
            y = np.asarray(row["y"], dtype=np.float32)
            sink.write({"__key__": f"item{row['i']:04d}", "x.npy": x, "y.npy": y, "cls": row["i"]})


def _write_litdata(out: Path) -> None:
    import litdata

    # chunks of 10 items: 4 chunks, so 2 workers (and 2 ranks) each get whole chunks
    litdata.optimize(
        fn=_litdata_item,
        inputs=list(range(N)),
        output_dir=str(out),
        chunk_size=N // SHARDS,
        num_workers=1,
        mode="overwrite",
    )


# --------------------------------------------------------------------------------------------- augmentation
def augment_hf(example: dict[str, Any]) -> dict[str, Any]:
    """HF ``.map``: noise from torch's global RNG (and numpy's)."""
    x = torch.tensor(example["x"]) + 0.1 * torch.randn(DIM) + float(np.random.rand()) * 0.01
    return {**example, "x": x.tolist()}


def augment_tensor(item: dict[str, Any]) -> dict[str, Any]:
    """litdata's ``transform``: noise from torch's global RNG (and python's)."""
    return {**item, "x": item["x"] + 0.1 * torch.randn(DIM) + random.random() * 0.01}


def augment_wds(sample: tuple[Any, Any, Any]) -> dict[str, Any]:
    """webdataset ``.map``: tensors, noise from torch's global RNG."""
    x, y, i = sample
    return {"x": torch.from_numpy(x) + 0.1 * torch.randn(DIM), "y": torch.from_numpy(y), "i": int(i)}


# --------------------------------------------------------------------------------------------- the pipelines
def _hf(data: Path, fmt: str, rank: int, world: int, by_rank: list[list[int]] | None = None) -> Any:
    """``by_rank``: each rank's shard files by index (the files a rank reads, chosen by the user's code), else
    ``split_dataset_by_node``."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    pattern = "*.jsonl" if fmt == "json" else "*.parquet"
    files = sorted(str(p) for p in (data / fmt).glob(pattern))
    if by_rank is not None:
        files = [files[i] for i in by_rank[rank]]
    ds = load_dataset(fmt, data_files=files, split="train", streaming=True)
    if world > 1 and by_rank is None:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    return ds.shuffle(seed=SEED, buffer_size=8).map(augment_hf).with_format("torch")


def _flipped(example: dict[str, Any]) -> dict[str, Any]:
    """The second source of the mix: the JSON items negated (another data set of the same shape)."""
    return {**example, "x": [-v for v in example["x"]], "i": 1000 + example["i"]}


def _hf_mix(data: Path, rank: int, world: int) -> Any:
    """Two data sets mixed at random as HF's docs show (``interleave_datasets`` with probabilities and a seed), then
    split by rank, shuffled and augmented as :func:`_hf`. Both from the JSON copy (the second negated): a mix with a
    parquet source sleeps 5 s in each worker at each pass's end (``datasets`` 5.x, ``SLEEP_TIME_ON_THREADS_SHUTDOWN``,
    for apache/arrow#45214), a minute of the test's time; the parquet reader is the ``hf_parquet`` case's."""
    from datasets import interleave_datasets, load_dataset
    from datasets.distributed import split_dataset_by_node

    files = sorted(str(p) for p in (data / "json").glob("*.jsonl"))
    parts = [load_dataset("json", data_files=files, split="train", streaming=True) for _ in range(2)]
    parts[1] = parts[1].map(_flipped)
    ds = interleave_datasets(parts, probabilities=[0.6, 0.4], seed=SEED, stopping_strategy="first_exhausted")
    if world > 1:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    return ds.shuffle(seed=SEED, buffer_size=8).map(augment_hf).with_format("torch")


def _litdata(data: Path) -> Any:
    import litdata

    return litdata.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED, transform=augment_tensor)


def _litdata_combined(data: Path) -> Any:
    """Two litdata datasets mixed as its docs show (``CombinedStreamingDataset``: each item from either, at random)."""
    import litdata

    parts = [
        litdata.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED + k, transform=augment_tensor)
        for k in range(2)
    ]
    return litdata.CombinedStreamingDataset(parts, seed=SEED)


def _mix_pair(samples: tuple[Any, ...], rngs: dict[str, Any]) -> dict[str, Any]:
    """``ParallelStreamingDataset``'s transform: one item of each dataset mixed, with litdata's generators."""
    a, b = samples
    weight = rngs["numpy"].random()
    return {**a, "x": a["x"] + weight * b["x"] + 0.01 * torch.randn(DIM, generator=rngs["torch"])}


def _litdata_parallel(data: Path) -> Any:
    """Two litdata datasets read side by side as its docs show (``ParallelStreamingDataset``: one item of each)."""
    import litdata

    parts = [
        litdata.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED + k, transform=augment_tensor)
        for k in range(2)
    ]
    return litdata.ParallelStreamingDataset(parts, transform=_mix_pair, seed=SEED)


def _wds(data: Path, seeded: bool) -> Any:
    import webdataset as wds

    urls = sorted(str(p) for p in (data / "wds").glob("*.tar"))
    pipeline = wds.WebDataset(urls, shardshuffle=SHARDS, seed=SEED, nodesplitter=wds.split_by_node)
    pipeline = pipeline.shuffle(8, seed=SEED) if seeded else pipeline.shuffle(8)
    return pipeline.decode().to_tuple("x.npy", "y.npy", "cls").map(augment_wds)


def _wds_det(data: Path) -> Any:
    """webdataset's deterministic shuffles as its pipeline API (``wds.DataPipeline``) writes them for several nodes.

    The shard list shuffled by ``wds.detshuffle`` (the same order on every rank: each seeds ``random.Random`` from
    (seed, its own epoch count), no process id nor clock), split by node, then by worker, and the samples shuffled by
    another ``wds.detshuffle``.
    """
    import webdataset as wds

    urls = sorted(str(p) for p in (data / "wds").glob("*.tar"))
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.detshuffle(SHARDS, seed=SEED),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.detshuffle(8, initial=4, seed=SEED),
        wds.decode(),
        wds.to_tuple("x.npy", "y.npy", "cls"),
        wds.map(augment_wds),
    )


def _wds_resampled(data: Path, deterministic: bool) -> Any:
    """Shards drawn with replacement, epochs of 20 items a worker (webdataset's docs for large-scale training):
    ``WebDataset(urls, resampled=True)``, or its deterministic form, a ``DataPipeline`` started by
    ``wds.ResampledShards(urls, deterministic=True)`` (seeded from the worker, the rank and its own pass count)."""
    import webdataset as wds

    urls = sorted(str(p) for p in (data / "wds").glob("*.tar"))
    if not deterministic:
        pipeline = wds.WebDataset(urls, resampled=True, shardshuffle=False).shuffle(8, seed=SEED).decode()
        return pipeline.to_tuple("x.npy", "y.npy", "cls").map(augment_wds).with_epoch(20)
    return wds.DataPipeline(
        wds.ResampledShards(urls, seed=SEED, deterministic=True),
        wds.tarfile_to_samples(),
        wds.shuffle(8, seed=SEED),
        wds.decode(),
        wds.to_tuple("x.npy", "y.npy", "cls"),
        wds.map(augment_wds),
    ).with_epoch(20)


def train_loader(cfg: dict[str, Any], rank: int, world: int) -> Any:
    """The train loader of ``cfg["pipeline"]`` (``{"lib": one of LIBS, "data": write_data's root}``)."""
    spec = cfg["pipeline"]
    lib, data = spec["lib"], Path(spec["data"])
    kw: dict[str, Any] = {"batch_size": cfg["batch_size"], "num_workers": cfg["num_workers"]}
    if cfg.get("mp_context") and cfg["num_workers"] > 0:
        kw["multiprocessing_context"] = cfg["mp_context"]  # under DDP: workers started by a fork server
    if cfg.get("persistent_workers") and cfg["num_workers"] > 0:
        kw["persistent_workers"] = True
    _SET_EPOCH.clear()
    if spec.get("pair") and lib != "nodes":  # a second loader of the pipeline beside it, of half as many batches
        # (twice the batch size), in a CombinedLoader of that mode (the scenario's `two_loaders`)
        from lightning.pytorch.utilities import CombinedLoader

        one = {**cfg, "pipeline": {**spec, "pair": None}}
        first = train_loader(one, rank, world)
        datasets = list(_SET_EPOCH)
        if spec.get("by_rank"):  # the second reads the files the other way round (one rank's long loader is the
            # other's short one) with the same batch size: each rank's epoch has as many batches
            flipped = {**one, "pipeline": {**one["pipeline"], "by_rank": spec["by_rank"][::-1]}}
            second = train_loader(flipped, rank, world)
        else:  # `pair_with`: another library's pipeline (a litdata loader beside a stream without length)
            other = {**one["pipeline"], "lib": spec.get("pair_with") or lib}
            second = train_loader({**one, "pipeline": other, "batch_size": 2 * cfg["batch_size"]}, rank, world)
        _SET_EPOCH[:0] = datasets
        return CombinedLoader([first, second], mode=spec["pair"])
    if lib == "nodes":
        return _nodes(cfg, spec, rank, world)
    if lib.startswith("litdata"):
        import litdata

        build = {"litdata_combined": _litdata_combined, "litdata_parallel": _litdata_parallel}.get(lib, _litdata)
        dataset = build(data)
        return litdata.StreamingDataLoader(dataset, **kw)
    if lib.startswith("wds"):
        if lib.startswith("wds_resampled"):
            pipeline = _wds_resampled(data, deterministic=lib == "wds_resampled_det")
        else:
            pipeline = _wds_det(data) if lib == "wds_det" else _wds(data, seeded=lib == "wds")
        if spec.get("batched"):  # batched in the pipeline, a loader without batch_size (webdataset's docs' way)
            import webdataset as wds

            pipeline = pipeline.compose(wds.batched(kw["batch_size"], collation_fn=torch.utils.data.default_collate))
            kw["batch_size"] = None
        if spec.get("webloader"):  # webdataset's own loader: a DataPipeline over a DataLoader
            import webdataset as wds

            loader = wds.WebLoader(pipeline, **kw)
            if spec.get("with_epoch"):  # epochs of this many batches, cut from the loader repeated
                loader = loader.with_epoch(nbatches=spec["with_epoch"])
            return _stages(loader, spec.get("rebatch"), kw["batch_size"] or cfg["batch_size"])
        return torch.utils.data.DataLoader(pipeline, **kw)
    if lib.startswith("hf_mix"):
        ds = _hf_mix(data, rank, world)
    else:
        ds = _hf(data, "parquet" if lib == "hf_parquet" else "json", rank, world, spec.get("by_rank"))
    _SET_EPOCH.append(ds)
    if lib in ("hf_sdl", "hf_mix_sdl"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, **kw)
    return torch.utils.data.DataLoader(ds, **kw)


def jitter_main(sample: dict[str, Any]) -> dict[str, Any]:
    """A ``WebLoader`` stage after its loader (run in the main process): noise from torch's global RNG."""
    return {**sample, "x": sample["x"] + 0.01 * torch.randn(DIM)}


def _stages(loader: Any, rebatch: Any, batch_size: int) -> Any:
    """A ``WebLoader``'s stages after its loader, as webdataset's docs write them: ``rebatch`` ``True``, unbatched and
    batched again; ``"shuffle"``, a seeded shuffle and a ``.map`` drawing from torch between them; ``"unseeded"``,
    ``.shuffle(16)`` without seed (seeded from the clock); ``"rng"``, ``.shuffle(16, rng=random.Random(0))``."""
    import random

    if not rebatch:
        return loader
    loader = loader.unbatched()
    if rebatch == "shuffle":
        loader = loader.shuffle(16, seed=SEED).map(jitter_main)
    elif rebatch == "unseeded":
        loader = loader.shuffle(16)
    elif rebatch == "rng":
        loader = loader.shuffle(16, rng=random.Random(0))
    return loader.batched(batch_size)


class MapItems(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The data set as a map-style dataset (``torchdata.nodes``' pipelines over a sampler): item ``i``, augmented."""

    def __init__(self, rank: int, world: int) -> None:
        self.x, self.y = _items()
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return augment_tensor({"x": self.x[i], "y": self.y[i], "i": i})


class DrawnOrder:
    """An iterable of a sampler's indices in an order drawn from torch's global stream when iterated."""

    def __init__(self, sampler: Any) -> None:
        self.indices = list(range(len(sampler)))

    def __iter__(self) -> Any:
        return iter([self.indices[j] for j in torch.randperm(len(self.indices)).tolist()])


def _pass_through_class() -> type:
    """A user's own ``torchdata.nodes`` node over one source (``spec["custom"]``), which draws nothing and says so."""
    import torchdata.nodes as tn

    class PassThrough(tn.BaseNode):  # type: ignore[misc]
        lightning_repro_draws_nothing = True

        def __init__(self, source: Any) -> None:
            super().__init__()
            self.source = source

        def reset(self, initial_state: dict[str, Any] | None = None) -> None:
            super().reset(initial_state)
            self.source.reset(None if initial_state is None else initial_state["source"])

        def next(self) -> Any:
            return next(self.source)

        def get_state(self) -> dict[str, Any]:
            return {"source": self.source.state_dict()}

    return PassThrough


def _nodes(cfg: dict[str, Any], spec: dict[str, Any], rank: int, world: int) -> Any:
    """torchdata's ``torchdata.nodes``, as its docs' migration from ``DataLoader`` writes it: a sampler, the dataset's
    ``__getitem__`` in a ``ParallelMapper`` (``method="process"`` unless ``spec["method"]``), batched, collated,
    prefetched (unless ``spec["prefetch"]`` is false), in a ``Loader``; ``spec["mix"]``: two sources mixed by a
    ``MultiNodeWeightedSampler``; ``spec["custom"]``: a node of the user's own over the batches; ``spec["iterable"]``:
    the order from an ``IterableWrapper`` whose iterable draws it (:class:`DrawnOrder`) instead of a sampler;
    ``spec["two"]``: a ``CombinedLoader`` mode, the loader and a shorter one beside it in one."""
    import torchdata.nodes as tn

    dataset = MapItems(rank, world)
    if world > 1:
        sampler: Any = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=SEED)
    else:
        sampler = torch.utils.data.RandomSampler(dataset)
    workers, method = cfg["num_workers"], spec.get("method", "process")
    context = cfg.get("mp_context") if method == "process" and workers else None
    prebatch = spec.get("prebatch")  # torchdata batches the sampler's indices for the workers

    def mapped(sampler: Any) -> Any:
        node = tn.SamplerWrapper(sampler) if not spec.get("iterable") else tn.IterableWrapper(DrawnOrder(sampler))
        return tn.ParallelMapper(
            node, dataset.__getitem__, workers, method=method, multiprocessing_context=context, prebatch=prebatch
        )

    def loader(node: Any) -> Any:
        node = tn.Batcher(node, batch_size=cfg["batch_size"], drop_last=False)
        if spec.get("custom"):  # a node of the user's own between torchdata's
            node = _pass_through_class()(node)
        node = tn.Mapper(node, torch.utils.data.default_collate)
        if spec.get("prefetch", True):
            node = tn.Prefetcher(node, prefetch_factor=2)
        return tn.Loader(node)

    if spec.get("mix"):  # a mixture of two sources (items 0-29, 30-39), each mapped by its workers; the small one
        # runs out and restarts within a pass (torchdata's default stop: when every source has run out once)
        parts = {"a": range(rank, 30, world), "b": range(30 + rank, N, world)}
        sources = {name: mapped(torch.utils.data.SubsetRandomSampler(list(part))) for name, part in parts.items()}
        node: Any = tn.MultiNodeWeightedSampler(sources, {"a": 0.6, "b": 0.4})
    else:
        node = mapped(sampler)
    if spec.get("two"):  # a second Loader, over items 24-39 (4 batches), beside the first in a CombinedLoader of
        # that mode: cycled (max_size_cycle) or run out (max_size) in the first's epoch (the scenario's `two_loaders`)
        from lightning.pytorch.utilities import CombinedLoader

        small = mapped(torch.utils.data.SubsetRandomSampler(list(range(24 + rank, N, world))))
        return CombinedLoader([loader(node), loader(small)], mode=spec["two"])
    return loader(node)


def set_epoch(epoch: int) -> None:
    """What the module calls in ``on_train_epoch_start``: ``dataset.set_epoch(epoch)`` (HF's docs)."""
    for ds in _SET_EPOCH:
        ds.set_epoch(epoch)


def as_tuple(batch: Any) -> Any:
    """A pipeline's batch (a dict) as the scenario's model reads one: ``(x, y, i)``."""
    if isinstance(batch, dict):
        return batch["x"].float(), batch["y"].float().reshape(-1, 1), batch["i"]
    return batch


# --------------------------------------------------------------------------------------------- what the tests compare
def rows(steps: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The fields of the scenario's step records that a resumed run must reproduce, per step."""
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in steps]


def assert_same_files(ref_out: str, *run_outs: str) -> None:
    """Every checkpoint file each run of ``run_outs`` wrote holds what the file of its name in ``ref_out`` holds.

    A run may write none (resumed after the last checkpoint step); the runs together must write some.
    """
    import runner

    compared = 0
    for run_out in run_outs:
        files = sorted(Path(run_out, "ckpt").glob("*.ckpt"))
        compared += len(files)
        for path in files:
            expected = runner.checkpoint_values(Path(ref_out, "ckpt", path.name), ref_out)
            got = runner.checkpoint_values(path, run_out)
            assert got == expected, f"{path.name} differs: {sorted(k for k in got if got[k] != expected.get(k))[:5]}"
    assert compared, f"none of {run_outs} wrote a checkpoint"


if __name__ == "__main__":  # python tests/streaming_pipelines.py DIR: write the data set there
    import sys

    write_data(Path(sys.argv[1]))
