"""The documentation cannot rot: the code blocks of README.md and docs/ run, their command lines parse.

* Every ```` ```python ```` block runs in a fresh namespace with a small prelude (``MyModel``, ``MyDataset``,
  ``train_loader``, ``val_loader``, as the snippets name them) and a quiet CPU ``Trainer``, in a temporary
  directory, under the suite's ``filterwarnings = error``. A block that cannot run as written is marked just
  before it with ``<!-- not run: REASON -->``: it is compiled and its top-level imports run.
* Every command of a ```` ```bash ```` block is checked, not run: a ``lightning-repro`` line is parsed by the CLI's
  own parser (the verb and each flag must exist), a script it names must exist (and mention each flag it passes).
* ```` ```yaml ```` blocks load, and each ``class_path`` in them imports.
* The benchmark tables between ``<!-- NAME:start -->`` / ``<!-- NAME:end -->`` markers can be rewritten
  (``benchmarks/docs_tables.py``), and README's relative links point at files that exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_repro.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARK = r"^<!--\s*not run\b:?((?:(?!-->).)*)-->"  # a comment on a line of its own; its reason
_NOT_RUN = re.compile(_MARK, re.DOTALL | re.MULTILINE)
_MARK_BEFORE = re.compile(_MARK + r"\s*\Z", re.DOTALL | re.MULTILINE)  # the last thing before a fence


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` just before the block

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        mark = _MARK_BEFORE.search(text, 0, match.start())
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), match.group(2), mark.group(1).strip() if mark else None))
    return found


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
PYTHON = [block for block in BLOCKS if block.lang == "python"]
RUNNABLE = [block for block in PYTHON if block.not_run is None]
MARKED = [block for block in PYTHON if block.not_run is not None]


# ---------------------------------------------------------------------------------------------- the prelude
class MyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """16 fixed points and their labels; each read adds noise drawn from torch (an augmentation)."""

    def __init__(self, size: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class MyModel(pl.LightningModule):
    """A tiny classifier with dropout that logs ``val_acc``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


_QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


class _QuietTrainer(pl.Trainer):
    """``pl.Trainer`` for the snippets: CPU; no logger, progress bar, summary or default checkpointing unless asked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**_QUIET, **kwargs})


def _prelude() -> dict[str, Any]:
    return {
        "__name__": "__main__",
        "MyModel": MyModel,
        "MyDataset": MyDataset,
        "train_loader": DataLoader(MyDataset(), batch_size=8, shuffle=True),
        "val_loader": DataLoader(MyDataset(8), batch_size=8),
    }


@pytest.fixture
def snippet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pl, "Trainer", _QuietTrainer)


# ---------------------------------------------------------------------------------------------- python blocks
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
@pytest.mark.usefixtures("snippet_env")
def test_python_block_runs(block: Block) -> None:
    exec(compile(block.code, block.id, "exec"), _prelude())


@pytest.mark.parametrize("block", MARKED, ids=[b.id for b in MARKED])
def test_marked_python_block_compiles_and_imports(block: Block) -> None:
    tree = ast.parse(block.code, block.id)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(imports, type_ignores=[]), block.id, "exec"), {})


def test_every_python_block_is_run_or_marked_with_a_reason() -> None:
    fences = sum(len(re.findall(r"^```python\b", page.read_text(encoding="utf-8"), re.MULTILINE)) for page in PAGES)
    assert len(PYTHON) == fences, "a ```python fence is not closed, or was not parsed"
    assert len(RUNNABLE) + len(MARKED) == len(PYTHON)
    assert len(RUNNABLE) >= 4, [b.id for b in RUNNABLE]  # the parser must not lose blocks silently
    for block in MARKED:
        assert block.not_run, f"{block.id}: say why the block is not run: <!-- not run: REASON -->"
    marks = [(page, m) for page in PAGES for m in _NOT_RUN.finditer(page.read_text(encoding="utf-8"))]
    assert len(marks) == len(MARKED), "a <!-- not run --> comment must come just before a ```python block"


def test_a_broken_block_fails() -> None:
    broken = Block(ROOT / "README.md", 0, "python", "from lightning_repro import DeterminismCalback\n", None)
    with pytest.raises(ImportError, match="DeterminismCalback"):
        exec(compile(broken.code, broken.id, "exec"), _prelude())


# ---------------------------------------------------------------------------------------------- bash blocks
_SHELL_ENDS = {">", ">>", "|", "&&", "||", ";", "2>", "2>&1"}
_UNCHECKED = {"pip", ".venv/bin/pip", ".venv/bin/mkdocs", "mkdocs"}  # installing, serving: nothing of ours to check


def _commands(code: str) -> Iterator[list[str]]:
    for line in code.splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word in _SHELL_ENDS:
                words = words[:i]
                break
        if words:
            yield words


def _script_sources(script: Path) -> str:
    """The script's text and that of the modules beside it that it imports (where a shared flag is defined)."""
    text = script.read_text(encoding="utf-8")
    names = re.findall(r"^(?:from|import) (\w+)", text, re.MULTILINE)
    beside = [script.with_name(f"{name}.py") for name in names]
    return "\n".join([text, *(path.read_text(encoding="utf-8") for path in beside if path.exists())])


def check_command(words: list[str]) -> None:
    """Raise ``AssertionError`` when a documented command names a verb, flag or script that does not exist."""
    program, args = words[0], words[1:]
    if program in {"python", ".venv/bin/python"} and args[:2] == ["-m", "lightning_repro"]:
        program, args = "lightning-repro", args[2:]
    if program == "lightning-repro":
        try:
            build_parser().parse_args(args)
        except SystemExit as error:
            raise AssertionError(f"`{shlex.join(words)}` does not parse (exit {error.code})") from None
    elif program in {"python", ".venv/bin/python", "bash"}:
        script = ROOT / args[0]
        assert script.is_file(), f"`{shlex.join(words)}`: {args[0]} does not exist"
        sources = _script_sources(script)
        for flag in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--")):
            assert f'"{flag}"' in sources, f"`{shlex.join(words)}`: {args[0]} has no {flag} option"
    else:
        assert program in _UNCHECKED, f"`{shlex.join(words)}`: teach tests/test_docs.py to check `{program}`"


BASH = [block for block in BLOCKS if block.lang == "bash"]


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_bash_block_commands_exist(block: Block) -> None:
    commands = list(_commands(block.code))
    assert commands
    for words in commands:
        check_command(words)


@pytest.mark.parametrize(
    "line",
    [
        "lightning-repro dif a.jsonl b.jsonl",  # no such verb
        "lightning-repro diff a.jsonl b.jsonl --plots x.png",  # no such flag
        "lightning-repro seeds --seeds 3",  # TARGET missing
        "python examples/no_such_example.py",
        "python benchmarks/bench_overhead.py --write-doc",
        "bash scripts/tests.sh",
        "torchrun train.py",
    ],
)
def test_a_wrong_command_is_caught(line: str) -> None:
    with pytest.raises(AssertionError):
        check_command(shlex.split(line))


# ---------------------------------------------------------------------------------------------- yaml blocks
def _class_paths(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "class_path":
                yield item
            yield from _class_paths(item)
    elif isinstance(value, list):
        for item in value:
            yield from _class_paths(item)


YAML = [block for block in BLOCKS if block.lang == "yaml"]


@pytest.mark.parametrize("block", YAML, ids=[b.id for b in YAML])
def test_yaml_block_loads_and_its_classes_import(block: Block) -> None:
    paths = list(_class_paths(yaml.safe_load(block.code)))
    for path in paths:
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), f"{block.id}: {path} does not exist"


# ---------------------------------------------------------------------------------------------- links
def test_readme_links_point_at_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
        anchor = target.partition("#")[2]
        if anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(encoding="utf-8"), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README.md links to {target}: no such heading in {path}"


# ---------------------------------------------------------------------------------------------- benchmark tables
def _docs_tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_table_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    tables = _docs_tables()
    page = tmp_path / "page.md"
    before = "# Title\n\nprose before\n\n<!-- demo:start -->\n| a |\n|---|\n| old |\n<!-- demo:end -->\n\nprose after\n"
    page.write_text(before, encoding="utf-8")
    assert tables.write_table("demo", "| a |\n|---|\n| new |\n| rows |\n", page) == page
    after = page.read_text(encoding="utf-8")
    assert after == before.replace("| old |\n", "| new |\n| rows |\n")
    tables.write_table("demo", "| a |\n|---|\n| new |\n| rows |", page)  # twice: the same text
    assert page.read_text(encoding="utf-8") == after


@pytest.mark.parametrize(
    "text",
    [
        "no markers\n",
        "<!-- demo:start -->\n| a |\n",
        "<!-- demo:end -->\n| a |\n<!-- demo:start -->\n",
        "<!-- demo:start -->\n<!-- demo:end -->\n<!-- demo:start -->\n<!-- demo:end -->\n",
    ],
)
def test_write_table_refuses_missing_or_misplaced_markers(tmp_path: Path, text: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="demo:"):
        _docs_tables().write_table("demo", "| a |", page)
    assert page.read_text(encoding="utf-8") == text


def test_every_generated_table_has_its_markers_and_its_script() -> None:
    tables = _docs_tables()
    assert tables.PAGES
    for name, page in tables.PAGES.items():
        tables.replace_table(page.read_text(encoding="utf-8"), name, "| x |")  # the markers are there, once each
        script = (ROOT / "benchmarks" / f"{name}.py").read_text(encoding="utf-8")
        assert f'add_flag(parser, "{name}")' in script
        assert f"write_table({name!r}, " in script
