"""The streaming libraries users train from, each as its docs show (tests/streaming_pipelines.py), killed and resumed.

Every run is a fresh process (tests/scenario.py): 40 items in 4 shards, batch 4 (10 batches an epoch), 2 epochs,
augmentation from torch's global RNG in the library's ``map``/transform, checkpoints every 6 steps, killed with
``os._exit`` after 14 batches and resumed from step 12: mid-epoch 1. Compared with the uninterrupted run: SHA-256 of
the weights and the optimizer state, every step's sample indices and loss bits, the epoch-level logged values and
every value of the checkpoint files both runs wrote. The stage of its own in scripts/test.sh (``-m streaming``).
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import runner
import streaming_pipelines
from streaming_pipelines import rows

pytestmark = [pytest.mark.streaming, pytest.mark.slow]

BASE: dict[str, Any] = {"batch_size": 4, "dim": streaming_pipelines.DIM, "val": "off", "max_epochs": 2}
KILL = {"ckpt_every_n_steps": 6, "kill_after_batches": 14}  # the last checkpoint: step 12, epoch 1's third batch


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


def _cfg(data: str, lib: str, workers: int) -> dict[str, Any]:
    return {**BASE, "pipeline": {"lib": lib, "data": data}, "num_workers": workers}


def _resume_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _assert_same_run(ref: dict[str, Any], ref_out: str, killed_out: str, resumed: dict[str, Any], out: str) -> None:
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert rows(runner.stitched(killed_out, out)) == rows(runner.steps(ref_out)), "the logged step rows differ"
    assert runner.epochs(out) == {e: v for e, v in runner.epochs(ref_out).items() if e in runner.epochs(out)}
    assert runner.epochs(out), "the resumed run finished no epoch"
    streaming_pipelines.assert_same_files(ref_out, killed_out, out)  # every file either run wrote


def _killed_and_resumed(runs: Any, cfg: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    _, killed = runs.run({**cfg, **KILL}, "killed", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:2] == (12, 12), "the test means to resume mid-epoch 1"
    resumed, out = runs.run({**cfg, "ckpt_every_n_steps": 6, "resume": str(last)}, "resumed")
    return killed, resumed, out


# ------------------------------------------------------------------------------------------- litdata
def test_litdata_checkpoints_without_a_crash(runs: Any, data: str) -> None:
    """Our entry once called ``StreamingDataset.state_dict()`` without its three arguments: a TypeError."""
    result, out = runs.run({**_cfg(data, "litdata", 0), "ckpt_every_n_steps": 6}, "litdata-ckpt")
    files = runner.checkpoints(out)
    assert [runner.checkpoint_position(f)[0] for f in files] == [6, 12, 18]
    import torch

    saved = torch.load(files[0], weights_only=True)
    # Lightning saved the loader's own state (through our private copy of the loader), as it does without us
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["num_samples_yielded"] == 6 * 4
    assert "DeterminismCallback" in saved["callbacks"]
    assert result["global_step"] == 20


# ------------------------------------------------------------------------------------------- killed and resumed
# (library, workers, what the resume line says of the path the position took)
RESUMES = [
    pytest.param("litdata", 0, "the StreamingDataLoader's own state", id="litdata-0"),
    pytest.param("litdata", 2, "the StreamingDataLoader's own state", id="litdata-2"),
    pytest.param("hf", 0, "a fast-forward of", id="hf-json-0"),
    pytest.param("hf_parquet", 2, "a fast-forward of", id="hf-parquet-2"),
    pytest.param("hf_sdl", 0, "a fast-forward of", id="hf-statefuldataloader-0"),
    pytest.param("hf_sdl", 2, "a fast-forward of", id="hf-statefuldataloader-2"),
    # webdataset with workers 0: the detshuffle pipeline's case below (the main process reads either pipeline alike)
    pytest.param("wds", 2, "a fast-forward of", id="webdataset-2"),
    pytest.param("wds_det", 0, "a fast-forward of", id="webdataset-detshuffle-0"),
    pytest.param("wds_det", 2, "a fast-forward of", id="webdataset-detshuffle-2"),
]


@pytest.mark.parametrize(("lib", "workers", "path"), RESUMES)
def test_killed_mid_epoch_resumes_bitwise(runs: Any, data: str, lib: str, workers: int, path: str) -> None:
    cfg = _cfg(data, lib, workers)
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    killed, resumed, out = _killed_and_resumed(runs, cfg)
    _assert_same_run(ref, ref_out, killed, resumed, out)
    line = _resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
    assert path in line, line


# ------------------------------------------------------------------------------------------- webdataset's shuffles
@pytest.mark.parametrize(("lib", "workers"), [("wds", 2), ("wds_det", 0)], ids=["shuffle-seed-2", "detshuffle-0"])
def test_a_seeded_webdataset_pipeline_repeats_bitwise(runs: Any, data: str, lib: str, workers: int) -> None:
    cfg = {**_cfg(data, lib, workers), "ckpt_every_n_steps": 6}
    first, first_out = runs.reference(cfg)  # the reference of the resume test
    again, again_out = runs.run(cfg, f"{lib}-again")
    assert (again["params"], again["optimizer"]) == (first["params"], first["optimizer"])
    assert rows(runner.steps(again_out)) == rows(runner.steps(first_out))
    assert "NotExactWarning" not in again["stderr"]
    if lib == "wds_det":  # detshuffle's own pass count reseeds it: epoch 1 reads another order (what a resume keeps)
        order = [[i for s in runner.steps(first_out) if s["epoch"] == e for i in s["indices"]] for e in (0, 1)]
        assert sorted(order[0]) == sorted(order[1])
        assert order[0] != order[1]


def test_detshuffle_counts_its_passes_in_the_copy_that_iterates(data: str) -> None:
    """What the takeover records and gives back: each ``detshuffle`` stage's own count, found in either form."""
    import webdataset as wds

    from lightning_repro.data.libraries import set_stage_epochs, stage_epochs

    pipeline = streaming_pipelines.train_loader(_cfg(data, "wds_det", 0), 0, 1).dataset
    assert stage_epochs(pipeline) == [-1, -1]  # the shard and the sample shuffle, not yet iterated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # webdataset leaves its tar files to the garbage collector
        first = [item["i"] for item in pipeline]
        assert stage_epochs(pipeline) == [0, 0]
        assert [item["i"] for item in pipeline] != first  # its second pass: seeded from (seed, 1)
        set_stage_epochs(pipeline, [-1, -1])  # a fresh process's counts: the first pass's order again
        assert [item["i"] for item in pipeline] == first
        gc.collect()
    urls = sorted(str(p) for p in Path(data, "wds").glob("*.tar"))
    fluid = wds.WebDataset(urls, shardshuffle=4, detshuffle=True, seed=1).compose(wds.detshuffle(8, seed=1))
    assert stage_epochs(fluid) == [-1, -1]
    assert stage_epochs(streaming_pipelines.train_loader(_cfg(data, "wds", 0), 0, 1).dataset) is None


def test_an_unseeded_webdataset_shuffle_warns_once_at_takeover(data: str) -> None:
    from helpers import prepare

    from lightning_repro import NotExactWarning

    cfg = {**_cfg(data, "wds_unseeded", 0)}
    loader = streaming_pipelines.train_loader(cfg, 0, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(loader)
    ours = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    assert len(ours) == 1, ours
    assert "`.shuffle(8)` (webdataset) seeds itself from the process id and the clock" in ours[0]
    assert "cannot be repeated" in ours[0]
    assert "`.shuffle(8, seed=...)`" in ours[0]
    with warnings.catch_warnings(record=True) as seeded:  # the seeded pipeline: nothing to say
        warnings.simplefilter("always")
        prepare(streaming_pipelines.train_loader(_cfg(data, "wds", 0), 0, 1))
    assert [str(w.message) for w in seeded if issubclass(w.category, NotExactWarning)] == []


def test_an_unseeded_webdataset_resume_says_not_exact(runs: Any, data: str) -> None:
    cfg = _cfg(data, "wds_unseeded", 0)
    _, killed = runs.run({**cfg, **KILL}, "wds-unseeded-killed", expect_kill=True)
    resumed, _ = runs.run({**cfg, "resume": str(runner.checkpoints(killed)[-1])}, "wds-unseeded-resumed")
    line = _resume_line(resumed["stderr"])
    assert ": NOT exact: " in line, line
    assert "`.shuffle(8)` (webdataset) seeds itself from the process id and the clock" in line, line
