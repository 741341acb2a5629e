"""Lightning's features combined with DeterminismCallback, as a user combines them (``tests/scenario_features.py``).

Each feature is checked three ways: Lightning does what it does without us (the steps, the logged rows, the files
a run leaves, against plain Lightning where the two compute the same), no false or missing message (no resume line
when nothing was resumed, none of our warnings for an exact case), and where a checkpoint is involved, a run killed
hard mid-epoch and resumed in a fresh process equals the uninterrupted run bitwise: weights, optimizer, every step's
samples and loss, every row the logger got after the checkpoint, the callbacks' states, every checkpoint file the
resumed run writes (tensors by SHA-256).

96 samples, batch 8: 12 batches per epoch; validation every 4 batches unless a case says otherwise.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import runner
import torch

from lightning_repro.checkpoint.entry import DIGEST_KEY, entry_digest
from lightning_repro.manifest import MANIFEST_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ordinary_project

pytestmark = [pytest.mark.slow, pytest.mark.features]  # in the marked run of scripts/test.sh

BASE: dict[str, Any] = {"max_epochs": 3, "scheduler": False, "val": 4}
OUR_WARNINGS = re.compile(r"\b(ReproWarning|NotExactWarning|NondeterminismWarning)\b")
RESUMED = "lightning-repro: resumed"
THROUGHPUT = ("train/", "validate/")  # ThroughputMonitor's keys: <stage>/<name>


def _features(cfg: dict[str, Any], tag: str) -> dict[str, Any]:
    return {**cfg, "features": {**cfg.get("features", {}), "tag": tag}}


def _rows(out: str | Path, tag: str, after: int = 0) -> list[dict[str, Any]]:
    """The rows the run's logger got (after checkpoint marker ``after``; 0: all), ``ThroughputMonitor``'s values
    (``train/...``, ``validate/...``) left out: see :func:`_throughput_rows`."""
    rows = ordinary_project.logged_after(Path(out, f"record-{tag}.jsonl"), after)
    return [{**r, "metrics": {k: v for k, v in r["metrics"].items() if not k.startswith(THROUGHPUT)}} for r in rows]


def _throughput_rows(out: str | Path, tag: str, after: int = 0) -> list[tuple[int, dict[str, float]]]:
    """``ThroughputMonitor``'s rows: (step, {key: value}) of its keys (``<stage>/<name>``)."""
    rows = ordinary_project.logged_after(Path(out, f"record-{tag}.jsonl"), after)
    ours = [{k: float.fromhex(v) for k, v in r["metrics"].items() if k.startswith(THROUGHPUT)} for r in rows]
    picked = [(r["step"], values) for r, values in zip(rows, ours, strict=True)]
    return [(step, values) for step, values in picked if values]


def _assert_throughput_as_lightning(ref_out: str, out: str) -> None:
    """``ThroughputMonitor`` has no state: its counters start again in the resumed process, as in plain Lightning
    (``callbacks/throughput_monitor.py``: ``_start`` resets them at ``on_train_start``), and its rates and times
    are the wall clock's. What must hold: its rows come at the same steps as in the uninterrupted run, each
    validation's counters are the same (they start again at every validation), and the resumed process's training
    counters are the uninterrupted run's less what the checkpoint had counted."""
    expected, got = _throughput_rows(ref_out, "run", _resumed_from(out)), _throughput_rows(out, "resumed")
    assert expected, "ThroughputMonitor logged nothing: the case shows nothing"
    assert [step for step, _ in got] == [step for step, _ in expected]
    pairs = [(mine, theirs) for (_, mine), (_, theirs) in zip(got, expected, strict=True)]
    for mine, theirs in pairs:
        assert {k: mine.get(k) for k in ("validate/batches", "validate/samples")} == {
            k: theirs.get(k) for k in ("validate/batches", "validate/samples")
        }
    train = [(m["train/batches"], t["train/batches"], m["train/samples"], t["train/samples"]) for m, t in pairs
             if "train/batches" in m]
    assert train, "no training throughput row after the resume"
    assert train[0][0] == 1.0, train  # counted again from the resume
    assert len({(t - m, ts - ms) for m, t, ms, ts in train}) == 1, train  # the checkpoint's count less


def _resumed_from(out: str | Path) -> int:
    record = ordinary_project.record(Path(out, "record-resumed.jsonl"))
    return next(int(item["n"]) for item in record if item["kind"] == "resumed_from")


def _no_false_message(stderr: str, *, resumed: bool) -> None:
    assert not OUR_WARNINGS.search(stderr), stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.startswith(RESUMED)]
    if not resumed:
        assert not lines, lines
        return
    assert len(lines) == 1, stderr[-4000:]
    assert ": exact (restore verified: parameters, optimizer, lr_schedulers, process streams" in lines[0], lines[0]


def _same_structure(plain: dict[str, Any], plain_out: str, ours: dict[str, Any], out: str) -> None:
    """What plain Lightning does, structurally, whatever values it computes: the steps, the logged rows (their steps
    and keys), the checkpoint files and the files the run leaves (ours writes its manifest besides)."""
    assert plain["global_step"] == ours["global_step"]
    assert len(runner.steps(plain_out)) == len(runner.steps(out))
    keys = [[(r["step"], sorted(r["metrics"])) for r in _rows(o, "run")] for o in (plain_out, out)]
    assert keys[0] == keys[1], "the logged rows' steps or keys differ"
    assert plain["files_in_out"] == [f for f in ours["files_in_out"] if f != MANIFEST_FILE]
    predicted = [_predicted(o) for o in (plain_out, out)]  # trainer.predict after fit: the batches and samples
    assert predicted[1] == predicted[0], "the predicted batches differ from plain Lightning's"


def _predicted(out: str | Path) -> list[tuple[Any, ...]]:
    """What the prediction writer got (``predict`` feature): each batch's index, ``batch_indices`` and samples."""
    path = Path(out, "predictions-run.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(r["batch_idx"], r["batch_indices"], r["indices"]) for r in rows]


def _step_rows(steps: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(s["epoch"], s["batch_idx"], s["global_step"], s["indices"], s["loss"], s["dropout"]) for s in steps]


def _assert_continues(
    reference: dict[str, Any], ref_out: str, resumed: dict[str, Any], out: str, steps: list[dict[str, Any]],
    *, files: list[str] | None, ignore: tuple[str, ...] = (), ignore_paths: tuple[str, ...] = (),
) -> None:
    for key in ("params", "optimizer", "global_step", "epoch", "lr", "batches_that_stepped"):
        assert resumed[key] == reference[key], f"{key} differs"
    assert _step_rows(steps) == _step_rows(runner.steps(ref_out)), "the steps (samples, losses, masks) differ"
    assert _rows(out, "resumed") == _rows(ref_out, "run", _resumed_from(out)), "the logged rows after it differ"
    states = [{k: v for k, v in run["callback_states"].items() if k not in ignore} for run in (reference, resumed)]
    assert states[1] == states[0], "a callback's state differs"
    skip = tuple(f"/callbacks/{key}" for key in ignore) + ignore_paths
    problems = runner.compare_checkpoint_files(ref_out, out, names=files, ignore=skip)
    assert not problems, "\n".join(problems)
    _no_false_message(resumed["stderr"], resumed=True)


VAL_EVERY_2 = {"check_val_every_n_epoch": 2}
# (id, config, kill after N batches, checkpoint every N steps)
CASES = [
    # StochasticWeightAveraging(swa_epoch_start=2): averaging from epoch 1 (its SWALR built at that epoch's start)
    ("swa-before-start", {"features": {"callbacks": ["swa"]}}, 8, 5),
    ("swa-first-averaging-epoch", {"features": {"callbacks": ["swa"]}}, 22, 5),
    ("swa-second-averaging-epoch", {"features": {"callbacks": ["swa"]}}, 32, 5),
    # EarlyStopping's wait count (2 at step 10: the run stops at step 20 only if it comes back), Timer's elapsed
    # time, LearningRateMonitor's rows, gradient clipping and anomaly detection, a per-step scheduler
    (
        "early-stopping-timer-lr-monitor-clip-anomaly",
        {
            "scheduler": True,
            "features": {
                "callbacks": ["early_stopping", "timer", "lr_monitor"],
                "trainer": {"gradient_clip_val": 0.05, "detect_anomaly": True},
            },
        },
        14,
        5,
    ),
    # BackboneFinetuning unfreezes the backbone at epoch 1's start; the resume's setup freezes it again
    ("backbone-finetuning", {"features": {"callbacks": ["backbone"]}}, 22, 5),
    # two train loaders as a dict in a CombinedLoader(mode="min_size"), with workers
    ("combined-dict-min-size", {"max_epochs": 2, "num_workers": 2, "features": {"loaders": "dict", "mode": "min_size"}},
     8, 5),
    # two torchdata StatefulDataLoaders over map-style data (12 and 8 batches, 2 workers each) in a list: the short one
    # runs out (max_size: None from then on; resumed from step 10, torchdata would start a new pass, its saved
    # iterator having run out) or is cycled (max_size_cycle: resumed from step 8, where its pass ended)
    ("combined-stateful-max-size", {"stateful_loader": True, "num_workers": 2,
                                    "features": {"loaders": "list", "mode": "max_size"}}, 11, 5),
    ("combined-stateful-cycled", {"stateful_loader": True, "num_workers": 2,
                                  "features": {"loaders": "list", "mode": "max_size_cycle"}}, 10, 4),
    # torch.compile(net) in configure_model, as users speed a model up: inductor's CPU kernels, its dropout drawn
    # from the process streams, compiled again in the resumed process
    ("torch-compile", {"features": {"compile": True}}, 8, 5),
    # bf16 autocast on the CPU (precision="bf16-mixed"), the per-step scheduler stepping after a checkpoint
    ("bf16-mixed", {"precision": "bf16-mixed", "scheduler": True, "features": {}}, 10, 4),
    # overfit_batches=2: 2 batches per epoch, the checkpoint on an epoch's last batch
    ("overfit-batches", {"max_epochs": 6, "val": "epoch", "features": {"trainer": {"overfit_batches": 2}}}, 7, 3),
    # GradientAccumulationScheduler({0: 1, 1: 2}): it sets the trainer's accumulation in on_train_epoch_start. Killed
    # in epoch 1 (accumulation 2) in the middle of a window (after batch 4 of 0..5), resumed from step 14 (batch 3)
    ("accumulation-scheduler-mid-window", {"features": {"callbacks": ["accumulation_scheduler"]}}, 17, 7),
    # ... and killed in epoch 0 (accumulation 1): the resumed run changes to 2 at epoch 1 as the uninterrupted one
    ("accumulation-scheduler-before-change", {"features": {"callbacks": ["accumulation_scheduler"]}}, 10, 7),
    # ThroughputMonitor's rows (as Lightning counts them: _assert_throughput_as_lightning), every step logged, and
    # ModelSummary's forward pass on the model's example_input_array (a process-stream draw in on_fit_start)
    (
        "throughput-model-summary",
        {"features": {"callbacks": ["throughput", "model_summary"], "trainer": {"log_every_n_steps": 1}}},
        8,
        5,
    ),
    ("rich-model-summary", {"features": {"callbacks": ["rich_model_summary"]}}, 8, 5),
    # SubsetRandomSampler over the even indices (6 batches per epoch): without a generator, and with the user's own
    # (and workers)
    ("subset-random-sampler", {"sampler": "subset", "features": {}}, 8, 5),
    ("subset-random-sampler-user-generator", {"sampler": "subset_generator", "num_workers": 2, "features": {}}, 8, 5),
    # a user's batch sampler (length bucketing as users write it, not a BatchSampler): drawing from the process
    # streams (workers 0 and 2), and from its own generator reseeded in set_epoch; n 100, batch 8: a short last batch
    ("bucket-batch-sampler", {"sampler": "bucket", "n": 100, "features": {}}, 8, 5),
    ("bucket-batch-sampler-workers", {"sampler": "bucket", "n": 100, "num_workers": 2, "features": {}}, 20, 5),
    ("bucket-batch-sampler-own-generator", {"sampler": "bucket_generator", "n": 100, "features": {}}, 8, 5),
    # val_check_interval=0.5 with check_val_every_n_epoch=2: validation at batches 5 and 11 of epoch 1 only. Resumed
    # from step 15 (epoch 1, batch 2: the validation at batch 5 still to come), and from step 20 (after it)
    ("val-half-every-2-epochs-before-val", {"val": 0.5, "features": {"trainer": VAL_EVERY_2}}, 20, 5),
    ("val-half-every-2-epochs-after-val", {"val": 0.5, "features": {"trainer": VAL_EVERY_2}}, 23, 5),
    # BasePredictionWriter(write_interval="batch") and trainer.predict after fit, in the resumed process too: the
    # same batch_indices, samples and predictions (predict_step draws from the process streams)
    ("predict-writer-after-fit", {"features": {"predict": True}}, 8, 5),
]


@pytest.mark.parametrize(("cfg", "kill_after", "every"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_feature_resumes_bitwise(runs: Any, cfg: dict[str, Any], kill_after: int, every: int) -> None:
    cfg = {**BASE, **cfg, "ckpt_every_n_steps": every}
    reference, ref_out = runs.reference(_features(cfg, "run"))
    _no_false_message(reference["stderr"], resumed=False)
    if "early_stopping" not in cfg["features"].get("callbacks", []):  # when it stops depends on the values
        _same_structure(*runs.run({**_features(cfg, "run"), "repro": False}, "plain"), reference, ref_out)
    killed = runs.killed(_features({**cfg, "kill_after_batches": kill_after}, "killed"))
    checkpoint = runner.checkpoints(killed)[-1]
    if cfg["features"].get("compile"):  # the compiled module's weights: the case shows what it says
        assert any("._orig_mod." in key for key in torch.load(checkpoint, weights_only=True)["state_dict"])
    resumed, out = runs.run(_features({**cfg, "resume": str(checkpoint)}, "resumed"), "resumed")
    files = sorted(p.name for p in Path(out, "ckpt").glob("*.ckpt"))
    assert files, "the resumed run wrote no checkpoint"
    ignore = ("Timer",) if "timer" in cfg["features"].get("callbacks", []) else ()
    steps = runner.stitched(killed, out)
    paths: tuple[str, ...] = ()
    if "throughput" in cfg["features"].get("callbacks", []):  # the trainer's logged metrics our entry keeps hold
        # ThroughputMonitor's wall-clock values and counters started again (see _assert_throughput_as_lightning)
        paths = tuple(f"/callbacks/DeterminismCallback/callback_metrics/_logged_metrics/{p}" for p in THROUGHPUT)
        paths += (f"/callbacks/DeterminismCallback/{DIGEST_KEY}",)  # the entry's seal covers them: each file's own
        for path in Path(out, "ckpt").glob("*.ckpt"):
            entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
            assert entry[DIGEST_KEY] == entry_digest(entry), f"{path.name}: the entry does not match its seal"
    _assert_continues(reference, ref_out, resumed, out, steps, files=files, ignore=ignore, ignore_paths=paths)
    if "throughput" in cfg["features"].get("callbacks", []):
        _assert_throughput_as_lightning(ref_out, out)
    if {"model_summary", "rich_model_summary"} & set(cfg["features"].get("callbacks", [])):
        assert reference["forwards"] == resumed["forwards"] == 1, "the summary ran no forward pass on its example"
    if cfg["features"].get("predict"):  # trainer.predict after fit: the resumed process predicts alike
        predicted = [Path(o, f"predictions-{tag}.jsonl").read_text() for o, tag in ((ref_out, "run"), (out, "resumed"))]
        assert predicted[0], "nothing predicted"
        assert predicted[1] == predicted[0]
        assert _predicted(ref_out)[0][1] == list(range(8)), "the writer got no batch_indices"
    if ignore:  # Timer: the wall clock differs, but the resumed run counts on from the checkpoint's time
        saved = torch.load(checkpoint, weights_only=True)["callbacks"]["Timer"]["time_elapsed"]["train"]
        assert float.fromhex(resumed["callback_states"]["Timer"]["/time_elapsed/train"]) > saved


def test_ckpt_path_last_resumes_in_place_bitwise(runs: Any) -> None:
    """``fit(ckpt_path="last")`` with ``ModelCheckpoint(save_last=True)`` and ``limit_train_batches=0.5``, resumed in
    the killed run's own folder (as users do): every file the folder then holds equals the uninterrupted run's."""
    cfg = {**BASE, "max_epochs": 2, "limit_train_batches": 0.5, "save_last": True, "ckpt_every_n_steps": 4}
    reference, ref_out = runs.reference(_features(cfg, "run"))
    _same_structure(*runs.run({**_features(cfg, "run"), "repro": False}, "plain-last"), reference, ref_out)
    killed = runs.fresh_dir("killed-last")
    runner.run({**_features({**cfg, "kill_after_batches": 7}, "killed"), "out": killed}, expect_kill=True)
    assert Path(killed, "ckpt", "last.ckpt").exists()
    resumed = runner.run({**_features({**cfg, "resume": "last"}, "resumed"), "out": killed})
    assert f"resumed from {Path(killed, 'ckpt', 'last.ckpt')} at step 4," in resumed["stderr"]
    steps = runner.steps(killed)  # both runs append to the folder's steps file: the killed run's 7, then the resumed's
    first = (steps[7]["epoch"], steps[7]["batch_idx"])
    steps = [s for s in steps[:7] if (s["epoch"], s["batch_idx"]) < first] + steps[7:]
    assert len(runner.steps(ref_out)) == 12  # 6 batches per epoch: limit_train_batches halves the epoch
    _assert_continues(reference, ref_out, resumed, killed, steps, files=None)


def test_fast_dev_run_as_plain_lightning(runs: Any) -> None:
    """``fast_dev_run=True``: one training batch and one validation batch, no logger rows, no checkpoint file, as in
    plain Lightning (which computes the same there: the same model and data, seeded alike), and nothing said."""
    cfg = {**BASE, "ckpt_every_n_steps": 1, "features": {"trainer": {"fast_dev_run": True}}}
    ours, out = runs.run(cfg, "fast-dev-run")
    plain, plain_out = runs.run({**cfg, "repro": False}, "fast-dev-run-plain")
    _no_false_message(ours["stderr"], resumed=False)
    _same_structure(plain, plain_out, ours, out)
    assert ours["global_step"] == len(runner.steps(out)) == 1
    assert _rows(out, "run") == []


TUNE: dict[str, Any] = {"max_epochs": 2, "val": "epoch", "scheduler": False, "features": {"callbacks": ["lr_monitor"]}}


@pytest.mark.parametrize("tuner", ["lr_find", "scale_batch_size", "lr_finder", "batch_size_finder"])
def test_tuner_before_fit_is_no_resume(runs: Any, tuner: str) -> None:
    """``Tuner(trainer).lr_find`` / ``.scale_batch_size`` before ``fit`` with the same Trainer, and the
    ``LearningRateFinder`` / ``BatchSizeFinder`` callbacks in it: the tuner saves a file in ``on_fit_start``, tries
    its values and loads the file back. The fit that follows equals a fit of ours given the tuner's lr or batch
    size without it (weights, optimizer, every step, every logged row, the files left in the run's folder: the
    tuner's file is gone), with no resume line and no warning (before: a NotExactWarning that the restored data
    position differs, and with the callbacks a 'resumed from .lr_find_....ckpt ... NOT exact' line)."""
    cfg = {**TUNE, "features": {**TUNE["features"], "tuner": tuner}}
    tuned, tuned_out = runs.run(_features(cfg, "run"), f"tuned-{tuner}")
    found = tuned["found"]
    if tuner in ("lr_find", "lr_finder"):
        assert found["lr"] != (1e-2).hex(), "the lr finder changed nothing: the case shows nothing"
    else:
        assert found["batch_size"] != 8, "the batch size finder changed nothing: the case shows nothing"
    given = {**TUNE, "batch_size": found["batch_size"], "features": {**TUNE["features"], "lr": found["lr"]}}
    untuned, out = runs.reference(_features(given, "run"))
    for key in ("params", "optimizer", "global_step", "lr"):
        assert tuned[key] == untuned[key], f"{key} differs from the fit without the tuner"
    expected, steps = runner.steps(out), runner.steps(tuned_out)  # the tuner's trial steps first, then the fit's
    assert len(steps) > len(expected), "the tuner ran no trial step"
    assert _step_rows(steps[len(steps) - len(expected) :]) == _step_rows(expected)
    assert _rows(tuned_out, "run") == _rows(out, "run")
    assert tuned["files_in_out"] == untuned["files_in_out"]
    assert not any(name.startswith((".lr_find", ".scale_batch_size")) for name in tuned["files_in_out"])
    _no_false_message(tuned["stderr"], resumed=False)
    if tuner in ("lr_find", "batch_size_finder"):  # plain Lightning tunes and fits alike (its RNG draws differ)
        _same_structure(*runs.run({**_features(cfg, "run"), "repro": False}, f"tuned-{tuner}-plain"), tuned, tuned_out)


@pytest.mark.ddp
def test_combined_loader_under_ddp_resumes_bitwise(runs: Any) -> None:
    """Two train loaders in a ``CombinedLoader(mode="max_size_cycle")`` (a list) under ``ReproDDPStrategy`` on 2 gloo
    ranks: Lightning gives each loader a ``DistributedSampler``; killed mid-epoch and resumed, every rank's steps
    and the weights equal the uninterrupted job's."""
    from ddp_cases import per_rank

    cfg = {"max_epochs": 2, "scheduler": False, "val": "epoch", "ckpt_every_n_steps": 4}
    cfg["features"] = {"loaders": "list"}
    reference, ref_out = runs.ddp_reference(_features(cfg, "run"), "nodes")
    _, killed = runs.ddp_reference(_features({**cfg, "kill_after_batches": 6}, "killed"), "nodes", expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    resumed, out = runs.ddp(_features({**cfg, "resume": str(checkpoint)}, "resumed"), "ddp-resumed", launcher="nodes")
    for key in ("params", "optimizer", "global_step"):
        assert resumed[key] == reference[key], f"{key} differs"
    for rank in (0, 1):
        assert per_rank(killed, rank, out) == per_rank(ref_out, rank), f"rank {rank} diverged"
    assert _rows(out, "resumed") == _rows(ref_out, "run", _resumed_from(out))
    _no_false_message(resumed["stderr"], resumed=True)
