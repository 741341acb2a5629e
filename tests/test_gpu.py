"""CUDA: per-device RNG states are saved and restored, and a CUDA resume is bitwise (run where CUDA exists)."""

from __future__ import annotations

from typing import Any

import pytest
import runner
import torch

from lightning_repro import capture_process_streams, restore_process_streams

pytestmark = pytest.mark.gpu


def test_cuda_states_round_trip() -> None:
    torch.cuda.init()
    torch.rand(3, device="cuda")
    state = capture_process_streams()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(5, device="cuda")
    torch.cuda.manual_seed_all(0)
    restore_process_streams(state)
    assert torch.equal(torch.rand(5, device="cuda"), expected)


def test_row_checksums_on_cuda_are_the_cpu_s() -> None:
    """The restore check digests a large CUDA tensor on the device (chunked products): the same as on the CPU."""
    from lightning_repro.checkpoint.hashing import row_checksums
    from lightning_repro.checkpoint.verify import digest_value

    values = torch.randn(3, 70_001, generator=torch.Generator().manual_seed(0))
    on_cpu, on_cuda = row_checksums(values), row_checksums(values.cuda())
    assert torch.equal(on_cpu[0], on_cuda[0])
    assert on_cpu[1] == on_cuda[1]
    assert digest_value(values, checksums=True) == digest_value(values.cuda(), checksums=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_resume_is_bitwise(runs: Any, num_workers: int) -> None:
    cfg = {"max_epochs": 2, "num_workers": num_workers, "accelerator": "gpu"}
    reference, ref_out = runs.reference(cfg)
    path = runs.root / f"cuda-{num_workers}.ckpt"
    interrupted, interrupted_out = runs.run({**cfg, "max_steps": 7, "save_at_end": str(path)}, "cuda-stop")
    assert interrupted["cuda_streams"] >= 1  # the checkpoint holds the CUDA generator states
    resumed, out = runs.run({**cfg, "resume": str(path)}, "cuda-resumed")
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    got = [s["indices"] for s in runner.stitched(interrupted_out, out)]
    assert got == [s["indices"] for s in runner.steps(ref_out)]


TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: FSDP and FSDP2 over NCCL put one rank on each",
)


@TWO_GPUS
@pytest.mark.sharded
@pytest.mark.parametrize("strategy", ["fsdp_repro", "model_parallel_repro"], ids=["fsdp", "fsdp2"])
def test_sharded_cuda_job_resumes_bitwise(runs: Any, strategy: str) -> None:
    """FSDP (``ReproFSDPStrategy``, which refuses the CPU) and FSDP2 on 2 GPUs: a killed job resumes bitwise."""
    cfg: dict[str, Any] = {"max_epochs": 2, "num_workers": 2, "mp_context": "forkserver", "accelerator": "gpu"}
    if strategy == "model_parallel_repro":
        cfg["sharded"] = {"dp": 2, "tp": 1}
    else:
        cfg["strategy"] = strategy
    reference, ref_out = runs.ddp_reference(cfg)
    _, killed = runs.ddp_reference({**cfg, "ckpt_every_n_steps": 3, "kill_after_batches": 5}, expect_kill=True)
    checkpoint = runner.checkpoints(killed)[-1]
    resumed, out = runs.ddp({**cfg, "resume": str(checkpoint)}, f"{strategy}-cuda-resumed")
    for rank in (0, 1):
        assert resumed["ranks"][rank]["params"] == reference["ranks"][rank]["params"], f"rank {rank}"
        assert resumed["ranks"][rank]["optimizer"] == reference["ranks"][rank]["optimizer"], f"rank {rank}"
        got = [(s["indices"], s["loss"], s["dropout"]) for s in runner.stitched(killed, out, rank)]
        assert got == [(s["indices"], s["loss"], s["dropout"]) for s in runner.steps(ref_out, rank)]
    assert "exact (restore verified: parameters, optimizer" in resumed["stderr"]
