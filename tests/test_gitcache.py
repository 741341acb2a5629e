"""A process's memory of ``git status`` (``manifest/gitcache.py``): git is not run again for a checkout that did
not change, and every change git would see makes it run again, with the answer a fresh git gives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_repro.manifest import codestate, gitcache
from lightning_repro.manifest.codestate import code_manifest

TICK = 0.05  # s: more than a file system's timestamp resolution (a jiffy), the racy window the tests use


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(autouse=True)
def _empty_memory() -> Iterator[None]:
    gitcache.forget()
    yield
    gitcache.forget()


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """The git commands started, and a racy window of :data:`TICK` (the default 2 s would make every test wait)."""
    started: list[tuple[str, ...]] = []
    real = codestate._start_git

    def counting(cwd: Path, *args: str) -> Any:
        started.append(args)
        return real(cwd, *args)

    monkeypatch.setattr(codestate, "_start_git", counting)
    monkeypatch.setattr(gitcache, "RACY_SECONDS", TICK)
    return started


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout: committed files, a dirty and an untracked one, ignored folders and a tracked file in one."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "test@example.com")
    _git(repo, "config", "user.name", "test")
    (repo / ".gitignore").write_text("build/\n.venv/\n*.log\n__pycache__/\n")
    (repo / "pkg" / "model.py").write_text("x = 1\n")
    (repo / "pkg" / "data.py").write_text("y = 1\n")
    (repo / "build").mkdir()
    (repo / "build" / "keep.py").write_text("kept = 1\n")  # tracked, in an ignored folder
    (repo / "build" / "junk.o").write_bytes(b"\0")
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / ".venv" / "lib" / "site.py").write_text("")
    (repo / "empty" / "deeper").mkdir(parents=True)
    (repo / "cache").mkdir()  # a tool's cache folder that ignores itself (as pytest's and hypothesis' do)
    (repo / "cache" / ".gitignore").write_text("*\n")
    (repo / "cache" / "entry.py").write_text("cached = 1\n")
    _git(repo, "add", ".gitignore", "pkg")
    _git(repo, "add", "-f", "build/keep.py")
    _git(repo, "commit", "-qm", "first")
    (repo / "pkg" / "model.py").write_text("x = 2\n")  # dirty
    (repo / "notes.txt").write_text("untracked\n")
    time.sleep(2 * TICK)
    return repo


def _fresh(repo: Path) -> dict[str, Any]:
    """What git says now, without the memory."""
    saved = dict(gitcache._MEMORY)
    gitcache.forget()
    try:
        return code_manifest(repo)
    finally:
        gitcache._MEMORY.update(saved)


def test_git_runs_at_the_first_two_fits_of_a_checkout_then_its_answer_is_reused(
    repo: Path, runs: list[tuple[str, ...]]
) -> None:
    sections = [code_manifest(repo / "pkg" / "model.py") for _ in range(5)]
    assert len(runs) == 2
    assert all(section == sections[0] for section in sections)
    assert sections[0]["dirty"] is True
    assert sections[0] == _fresh(repo)
    sections[0]["dirty"] = "changed by the caller"
    assert code_manifest(repo)["dirty"] is True  # the caller's copy, not the memory


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


CHANGES: dict[str, Callable[[Path], None]] = {
    "tracked file, same size": lambda r: (r / "pkg" / "data.py").write_text("y = 2\n"),
    "dirty file again": lambda r: (r / "pkg" / "model.py").write_text("x = 3\n"),
    "dirty file made clean": lambda r: (r / "pkg" / "model.py").write_text("x = 1\n"),
    "untracked file edited": lambda r: (r / "notes.txt").write_text("untracked, edited\n"),
    "untracked file added": lambda r: _write(r / "pkg" / "new.py", "z = 1\n"),
    "file in an empty folder": lambda r: _write(r / "empty" / "deeper" / "new.py", "z = 1\n"),
    "new folder": lambda r: _write(r / "more" / "a" / "new.py", "z = 1\n"),
    "tracked file removed": lambda r: (r / "pkg" / "data.py").unlink(),
    "tracked file renamed": lambda r: (r / "pkg" / "data.py").rename(r / "pkg" / "data2.py"),
    "tracked file made executable": lambda r: (r / "pkg" / "data.py").chmod(0o755),
    "tracked file in an ignored folder": lambda r: (r / "build" / "keep.py").write_text("kept = 2\n"),
    "staged": lambda r: _git(r, "add", "pkg/model.py"),
    "taken out of the index": lambda r: _git(r, "rm", "-q", "--cached", "pkg/data.py"),
    "committed": lambda r: _git(r, "commit", "-qam", "second"),
    "another branch": lambda r: (
        _git(r, "checkout", "-qb", "other"),
        _git(r, "commit", "-q", "--allow-empty", "-m", "b"),
    ),
    "ignore rule removed": lambda r: (r / ".gitignore").write_text("build/\n.venv/\n__pycache__/\n"),
    "ignore rule in info/exclude": lambda r: _write(r / ".git" / "info" / "exclude", "notes.txt\n"),
    "a folder's own ignore file, ignored itself": lambda r: (r / "cache" / ".gitignore").write_text("*.tmp\n"),
}
SAME_SECTION = {"staged"}  # the dirty digest follows the worktree, not the index: git runs, its answer is the same
NEW_PRUNING = {  # the snapshot before git pruned otherwise
    "ignore rule removed",
    "ignore rule in info/exclude",
    "a folder's own ignore file, ignored itself",
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_git_would_see_makes_it_run_again_with_a_fresh_answer(
    repo: Path, runs: list[tuple[str, ...]], change: str
) -> None:
    (repo / "run.log").write_text("ignored\n")  # seen by git as ignored, a file the walk skips
    time.sleep(2 * TICK)
    before = [code_manifest(repo) for _ in range(3)]
    assert len(runs) == 2
    CHANGES[change](repo)
    time.sleep(2 * TICK)
    after = code_manifest(repo)
    assert len(runs) == 3
    fresh = _fresh(repo)
    assert after == fresh
    assert (fresh == before[0]) is (change in SAME_SECTION)  # the change shows in the section (the test can fail)
    assert code_manifest(repo) == fresh
    # remembered again (the snapshot taken before the third git run); _fresh's git; once more if the ignored
    # paths changed (the snapshot before that git run was pruned by the earlier ones)
    assert len(runs) == 3 + 1 + (change in NEW_PRUNING)
    assert code_manifest(repo) == fresh
    assert len(runs) == 3 + 1 + (change in NEW_PRUNING)


def test_changes_git_does_not_see_do_not_run_it(repo: Path, runs: list[tuple[str, ...]]) -> None:
    for _ in range(3):
        code_manifest(repo)
    (repo / "build" / "junk.o").write_bytes(b"\1\2")  # in an ignored folder
    _write(repo / ".venv" / "lib" / "new.py", "")
    (repo / "pkg" / "model.py").read_text()  # read, not written
    time.sleep(2 * TICK)
    assert code_manifest(repo) == _fresh(repo)
    assert len(runs) == 2 + 1  # _fresh ran git; the fit did not


def _clock_after(monkeypatch: pytest.MonkeyPatch, path: Path, seconds: float) -> None:
    """The snapshot's clock: ``seconds`` after ``path``'s last change (not the wall clock: a slow machine's pauses
    would move the test's files out of the racy window)."""
    st = path.stat()
    now = max(st.st_mtime_ns, st.st_ctime_ns) + int(seconds * 1e9)
    monkeypatch.setattr(gitcache.time, "time_ns", lambda: now)


def test_a_file_written_within_the_racy_window_makes_git_run(
    repo: Path, runs: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(3):
        code_manifest(repo)
    assert len(runs) == 2
    (repo / "pkg" / "data.py").write_text("y = 2\n")
    _clock_after(monkeypatch, repo / "pkg" / "data.py", TICK / 2)  # within the window; every other file older
    for k in range(3):  # just written: a later write within the timestamp resolution could keep its stats
        assert code_manifest(repo)["dirty"] is True
        assert len(runs) == 3 + k
    _clock_after(monkeypatch, repo / "pkg" / "data.py", TICK * 1.5)  # out of it: remembered again
    for _ in range(3):
        code_manifest(repo)
    assert len(runs) == 2 + 3 + 1  # the first of them runs git (its snapshot is remembered), the others do not


def test_the_default_racy_window_is_two_seconds(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gitcache.RACY_SECONDS == 2.0
    (repo / "pkg" / "data.py").write_text("y = 2\n")
    _clock_after(monkeypatch, repo / "pkg" / "data.py", 1.9)
    assert gitcache.snapshot(repo, frozenset()) is None
    _clock_after(monkeypatch, repo / "pkg" / "data.py", 2.1)
    assert gitcache.snapshot(repo, frozenset()) is not None


@pytest.mark.parametrize("why", ["submodules", "large", "include", "linked worktree"])
def test_a_checkout_that_does_not_suit_a_snapshot_runs_git_every_time(
    repo: Path, runs: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    if why == "submodules":
        (repo / ".gitmodules").write_text("")
    elif why == "large":
        monkeypatch.setattr(gitcache, "MAX_ENTRIES", 5)
    elif why == "include":
        with (repo / ".git" / "config").open("a") as f:
            f.write("[include]\n\tpath = ../more.config\n")
    else:
        linked = repo.parent / "linked"
        _git(repo, "worktree", "add", "-q", str(linked))
        repo = linked
    time.sleep(2 * TICK)
    walks = []
    real = gitcache.snapshot
    monkeypatch.setattr(gitcache, "snapshot", lambda *a: (walks.append(a), real(*a))[1])
    sections = [code_manifest(repo) for _ in range(4)]
    assert len(runs) == 4
    assert all(section == sections[0] for section in sections)
    assert len(walks) == 1  # found unsuited once; not walked again


def test_a_git_without_ignored_matching_is_asked_again_without_it(
    repo: Path, runs: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = codestate._start_git

    def old_git(cwd: Path, *args: str) -> Any:  # git before 2.16: an unknown option exits with 129
        return real(cwd, "status", "--no-such-option") if "--ignored=matching" in args else real(cwd, *args)

    expected = code_manifest(repo)
    monkeypatch.setattr(codestate, "_start_git", old_git)
    gitcache.forget()
    sections = [code_manifest(repo) for _ in range(3)]
    assert sections == [expected] * 3  # the same answer, not the fallback (the package's files)
    assert expected["git_commit"] is not None


def test_git_environment_variables_are_part_of_the_key(
    repo: Path, runs: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = [code_manifest(repo) for _ in range(3)][-1]
    assert len(runs) == 2
    (repo.parent / "exclude").write_text("notes.txt\n")
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", f"'core.excludesfile'='{repo.parent / 'exclude'}'")
    excluded = [code_manifest(repo) for _ in range(3)]
    assert len(runs) == 2 + 3  # git configured by the environment: not snapshot, git runs every time
    assert excluded == [excluded[0]] * 3
    assert excluded[0] != before
    monkeypatch.delenv("GIT_CONFIG_PARAMETERS")
    assert code_manifest(repo) == before  # the first key's answer, remembered
    assert len(runs) == 5
    monkeypatch.setenv("GIT_INDEX_FILE", str(repo / ".git" / "index"))  # git pointed at files: not snapshot either
    for _ in range(3):
        assert code_manifest(repo) == before
    assert len(runs) == 5 + 3


def test_no_git_at_all_falls_back_to_the_package_files(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.devnull)  # no git to start
    assert code_manifest(repo / "pkg" / "model.py")["git_commit"] is None
    assert gitcache._MEMORY == {}


MODULE = """
import torch
from torch import nn
import lightning.pytorch as pl


class InRepo(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_fits_in_one_process_record_the_same_code_and_see_an_edit(
    repo: Path, runs: list[tuple[str, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    import torch
    from helpers import fast_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_repro import DeterminismCallback

    (repo / "pkg" / "inrepo.py").write_text(MODULE)
    spec = importlib.util.spec_from_file_location("inrepo", repo / "pkg" / "inrepo.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "inrepo", module)  # where inspect finds the module's file
    spec.loader.exec_module(module)  # (its bytecode cache, if written, in an ignored __pycache__/)
    time.sleep(2 * TICK)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))

    def fit() -> dict[str, Any]:
        callback = DeterminismCallback(3)
        trainer = fast_trainer([callback], max_steps=1, default_root_dir=tmp_path / "out")
        trainer.fit(module.InRepo(), DataLoader(data, batch_size=4))
        assert callback.manifest is not None
        code: dict[str, Any] = callback.manifest["code"]
        return code

    codes = [fit() for _ in range(3)]
    assert len(runs) == 2
    assert codes == [_fresh(repo)] * 3
    (repo / "pkg" / "data.py").write_text("y = 2\n")  # an edit between two fits of the process
    time.sleep(2 * TICK)
    edited = fit()
    assert len(runs) == 3 + 1  # and _fresh's
    assert edited == _fresh(repo) != codes[0]
