"""``lightning_repro.testing``: both helpers pass on a good model and fail on one that draws from ``os.urandom``."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro.testing import assert_reproducible, assert_resume_bitwise


class Small(pl.LightningModule):
    def __init__(self, urandom: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.urandom = urandom

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.urandom:  # noise no seed reaches
            x = x + torch.frombuffer(bytearray(os.urandom(4 * x.numel())), dtype=torch.int32).reshape(x.shape) * 1e-12
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def good() -> Small:
    return Small()


def noisy() -> Small:
    return Small(urandom=True)


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    return DataLoader(dataset, batch_size=4, shuffle=True)


_TRACE_DIFF = r".*trace diff: the traces part at step 1 .*cause numerics"  # the step trace explains it


def test_assert_reproducible_passes_on_a_good_model() -> None:
    assert_reproducible(good, data, max_steps=3)


class Counts(pl.Callback):
    """A user's callback with state: a copy per run, as given (the second run would start from the first's)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1
        assert self.batches <= 3, "this instance saw the other run's batches"


def test_the_user_s_callbacks_run_beside_the_helper_s_and_process_state_is_put_back() -> None:
    # trainer_kwargs={"callbacks": ...} was "Trainer() got multiple values for keyword argument 'callbacks'"; the
    # callback's process-wide flags stayed on for the rest of the session (another test's op then raised)
    mine = Counts()
    flags = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    cublas, before = os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.get_rng_state()
    assert_reproducible(good, data, max_steps=3, trainer_kwargs={"callbacks": [mine]})
    assert mine.batches == 0  # the runs had copies
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == flags
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == cublas
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ValueError, match="pass `max_steps` as the helper's own argument"):
        assert_reproducible(good, data, trainer_kwargs={"max_steps": 5})
    with pytest.raises(TypeError, match=r"`trainer_kwargs\['callbacks'\]` must be a Callback or a list of them"):
        assert_reproducible(good, data, trainer_kwargs={"callbacks": ["not one"]})


def test_assert_reproducible_fails_on_urandom() -> None:
    with pytest.raises(AssertionError, match=r"(?s)not bitwise equal: the loss of step 1 differs" + _TRACE_DIFF):
        assert_reproducible(noisy, data, max_steps=3)


def test_arguments_that_cannot_reach_a_fresh_process() -> None:
    with pytest.raises(TypeError, match="`make_module` must be an importable module-level function"):
        assert_resume_bitwise(lambda: Small(), data)
    with pytest.raises(ValueError, match=r"`stop_at` must hold steps in \[1, 3\]"):
        assert_resume_bitwise(good, data, stop_at=(4,), max_steps=4)


@pytest.mark.slow
def test_assert_resume_bitwise_passes_on_a_good_model() -> None:
    assert_resume_bitwise(good, data, stop_at=(2,), max_steps=4)  # killed hard after step 2
    assert_resume_bitwise(good, data, stop_at=(3,), hard_kill=False, max_steps=4)  # a graceful stop


def data_with_workers() -> DataLoader[Any]:
    loader = data()
    return DataLoader(loader.dataset, batch_size=4, shuffle=True, num_workers=2)


@pytest.mark.slow
def test_assert_resume_bitwise_runs_loaders_with_workers_and_puts_the_preload_list_back() -> None:
    """Each run's process was a daemon, which may not start children: any ``num_workers > 0`` crashed it
    ("daemonic processes are not allowed to have children"). The process's forkserver preload list stayed the
    helper's (torch, Lightning): put back."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    before = list(server._preload_modules)
    assert_resume_bitwise(good, data_with_workers, stop_at=(2,), max_steps=4)
    assert list(server._preload_modules) == before


_OUTLIVED = """
import os, sys, time
from lightning_repro.stats.process import fork_server

def run():  # a run whose forked worker outlives it (orphaned): it holds the pipes the run held (not the output)
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    with open("orphan.pid", "w") as file:
        file.write(str(pid))

if __name__ == "__main__":
    with fork_server(["__main__"]) as context:
        process = context.Process(target=run)
        process.start()
        process.join()
    print("ended")
"""


def test_the_fork_server_block_ends_while_a_process_it_started_lives_on(tmp_path: Path) -> None:
    """The block stopped the server and the resource tracker it started, which waits for each to exit: a run's
    orphaned worker holds them off as long as it lives (the CI's main suite hung in the tracker's). Both are left
    running now, as multiprocessing leaves them."""
    import subprocess
    import sys

    script = tmp_path / "outlived.py"
    script.write_text(_OUTLIVED)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    try:  # output to files: the server and the tracker left running hold a pipe's write end while they live
        with out.open("w") as stdout, err.open("w") as stderr:
            subprocess.run([sys.executable, str(script)], stdout=stdout, stderr=stderr, timeout=45, cwd=tmp_path)
    finally:
        if (tmp_path / "orphan.pid").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((tmp_path / "orphan.pid").read_text()), signal.SIGKILL)
    assert out.read_text().strip() == "ended", err.read_text()[-2000:]


_LEFT_BEHIND = """
import ctypes, os, sys, time
from multiprocessing import forkserver, resource_tracker

ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans become our children
sys.path.insert(0, sys.argv[1])
from lightning_repro.testing import assert_resume_bitwise
import test_testing

def children():
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
            if int(parent) == os.getpid() and state == "Z":  # ended: reaped (orphans come to us, the subreaper)
                os.waitpid(int(entry), os.WNOHANG)
            elif int(parent) == os.getpid():
                found.add(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found

if __name__ == "__main__":
    assert_resume_bitwise(test_testing.good, test_testing.data_with_workers, stop_at=(2,), max_steps=4)
    kept = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}  # left as designed
    for _ in range(50):  # a worker notices its parent's death within a few seconds when it can
        left = children() - kept
        if not left:
            break
        time.sleep(0.2)
    for pid in sorted(left):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            print(pid, cmdline.read().replace(b"\\0", b" ")[:150], file=sys.stderr)
    print("kept", kept, file=sys.stderr)
    print("left:", sorted(left))
    for pid in left:
        os.kill(pid, 9)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes of /proc and uses Linux's child subreaper")
def test_a_run_killed_hard_leaves_no_worker_running(tmp_path: Path) -> None:
    """A run forked from the helper's fork server starts its loader's workers through a fork server of its own;
    killed hard after its checkpoint, that server and its workers were left running for good (420 MB each; they held
    what the run held open, and a `| tee` of the caller never ended). Each run leads a process group now, which the
    helper kills once the run has ended."""
    import subprocess
    import sys

    script = tmp_path / "left_behind.py"
    script.write_text(_LEFT_BEHIND)
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, str(script), tests], capture_output=True, text=True, timeout=400, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "left: []", done.stderr[-3000:]


@pytest.mark.slow
def test_assert_resume_bitwise_fails_on_urandom() -> None:
    resume_failed = r"(?s)killed after step 2 and resumed: the loss of step 1 differs" + _TRACE_DIFF
    with pytest.raises(AssertionError, match=resume_failed):
        assert_resume_bitwise(noisy, data, stop_at=(2,), max_steps=4)
