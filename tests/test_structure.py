"""The package's structure: private Lightning API only in ``_lightning/``, and no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "lightning_repro"
ADAPTER = PACKAGE / "_lightning"

# Distributions whose private names only the adapter may use.
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")

# Private attributes of objects that are not Lightning's, read or written outside the adapter on purpose.
FOREIGN = {
    "_inst": "random._inst: the Random behind the random module's functions",
    "_rand": "numpy.random.mtrand._rand: the RandomState behind numpy's global functions",
    "_bit_generator": "numpy RandomState's bit generator (the raw-memory fast path)",
    "_exit": "os._exit: a dataloader worker ends as torch's own SIGTERM handler ends it",
    "_ex_iterable": "an HF datasets IterableDataset's chain of examples iterables (is there a shuffle buffer?)",
    "_state_dict": "a litdata StreamingDataset's loaded state (the epoch its main-process copy should show)",
    "_num_samples_yielded": "a litdata CombinedStreamingDataset's items read per worker and dataset (its loaded state)",
    "_datasets": "a litdata mix's or parallel reading's datasets (positioned at a worker's items, given epochs)",
    "_setup_elastic_resume": "a litdata StreamingDataset's re-deal to another number of workers (is there one?)",
    "_snapshot": "a torchdata StatefulDataLoader iterator's last snapshot (its counters, shifted on resume)",
    "_main_snapshots": "a torchdata StatefulDataLoader iterator's snapshots waiting for their batch (shifted too)",
    "_snapshot_interval": "a torchdata StatefulDataLoader iterator's snapshot_every_n_steps (shifted only at 1)",
    "_forward_pre_hooks": "a module's forward pre-hooks: torch.nn.utils.prune's re-parametrisation is one (its masks)",
    "_tensor_name": "the name of the tensor a torch.nn.utils.prune method prunes (BasePruningMethod's attribute)",
    "_it": "a torchdata.nodes node's or Loader's iterator (our copy starts without the user's; the user's stopped)",
    "_stop": "a torchdata.nodes ParallelMapper iterator's thread stop event (set first: threads end before workers)",
    "_mp_stop": "a torchdata.nodes ParallelMapper iterator's worker stop event (set once its threads have ended)",
    "_read_thread": "a torchdata.nodes ParallelMapper iterator's reading thread (joined before its workers stop)",
    "_sort_thread": "a torchdata.nodes ParallelMapper iterator's sort thread (joined before its workers stop)",
    "_workers": "a torchdata.nodes ParallelMapper iterator's worker processes (joined, killed when they do not end)",
    "_started": "a torchdata.nodes MultiNodeWeightedSampler's flag of a begun pass (our copy: unset in a new counter)",
    "_epoch": "a torchdata.nodes MultiNodeWeightedSampler's pass count (our copy: counted within the counter)",
    "_num_yielded": "a torchdata.nodes IterableWrapper's item count (our keyed copy's reset sets it as torchdata's)",
    "_shutdown": "a torchdata.nodes iterator's stop of its threads and worker processes (the user's, left running)",
    "_cached_state_dict": "torchdata.nodes LoaderIterator's look-ahead state, stale once a pass is found read through",
    "_next_iter_state_dict": "a torchdata.nodes Loader's loaded state for its next iter() (our copy starts without)",
    "_iter_for_state_dict": "a torchdata.nodes Loader's flag of an iterator made by state_dict() (our copy: unset)",
    "_get_object_coll_device": "torch.distributed's device for object collectives (all_gather_object's): the entry's"
    " gather in one round",
    "_forkserver": "multiprocessing.forkserver's process-wide ForkServer (whose preload list a helper puts back)",
    "_preload_modules": "a multiprocessing ForkServer's preload list (read, to be put back after the helper's runs)",
}


def _modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text(), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Private names lightning-repro defines itself: functions, classes, and attributes it assigns on ``self``."""
    names: set[str] = set()
    for name, tree in trees.items():
        if name.startswith("_lightning"):
            continue  # what the adapter assigns on Lightning's objects is not ours
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _violations(trees: dict[str, ast.Module]) -> list[str]:
    own = _own_names(trees)
    found: list[str] = []
    for name, tree in trees.items():
        if name.startswith("_lightning"):
            continue
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        overrides = {  # `super()._hook()` inside our override of `_hook`
            id(call.func)
            for fn in functions
            for call in ast.walk(fn)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == fn.name
            and isinstance(call.func.value, ast.Call)
            and isinstance(call.func.value.func, ast.Name)
            and call.func.value.func.id == "super"
        }
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIGHTNING:
                parts = (node.module or "").split(".")
                bad = [a.name for a in node.names if _private(a.name)] + [p for p in parts if _private(p)]
                if bad:
                    found.append(f"{where}: from {node.module} import {', '.join(bad)}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in LIGHTNING and any(_private(p) for p in parts):
                        found.append(f"{where}: import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr not in own and node.attr not in FOREIGN and id(node) not in overrides:
                    found.append(f"{where}: ._{node.attr.lstrip('_')} ({ast.unparse(node)})")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
                and node.args[1].value not in own
                and node.args[1].value not in FOREIGN
            ):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_no_private_lightning_access_outside_the_adapter() -> None:
    assert _violations(_modules()) == []


def test_the_private_access_check_can_fail() -> None:
    """The check finds the kinds of access it forbids (so the test above is not vacuous)."""
    source = """
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.connectors.logger_connector import result
import lightning.pytorch.loops._private_module

def f(trainer):
    trainer.fit_loop._restarting = False
    return getattr(trainer.fit_loop._combined_loader, "_mode", None), trainer._logger_connector
"""
    found = _violations({"probe.py": ast.parse(source), **_modules()})
    probe = [line for line in found if line.startswith("probe.py")]
    assert len(probe) == 6, probe
    assert any("_IndexBatchSamplerWrapper" in line for line in probe)
    assert any("getattr" in line and "'_mode'" in line for line in probe)


def _imports(tree: ast.Module, module: str, known: set[str], is_package: bool) -> set[str]:
    """The lightning_repro modules ``module`` imports, anywhere in it (lazy and TYPE_CHECKING imports too)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = (module if is_package else module.rsplit(".", 1)[0]).rsplit(".", node.level - 1)[0]
                base = anchor + ("." + base if base else "")
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    out.add(target)
                elif base in known:
                    out.add(base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
    out.discard(module)
    return out


def _graph() -> dict[str, set[str]]:
    trees = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        trees[".".join(parts[:-1] if is_package else parts)] = (ast.parse(path.read_text()), is_package)
    known = set(trees)
    return {name: _imports(tree, name, known, is_package) for name, (tree, is_package) in trees.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    assert "lightning_repro.checkpoint.state" in graph["lightning_repro._resume"]  # the graph sees the imports at all
    assert "lightning_repro.callback" in graph["lightning_repro.strategies.ddp"]
    graph.pop("lightning_repro")  # the package re-exports everything: importing it from a module would be a circle
    assert all("lightning_repro" not in deps for deps in graph.values())
    assert _cycle(graph) is None, _cycle(graph)


def test_the_circle_check_can_fail() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_build_ships_every_subpackage_and_the_kernel_s_files() -> None:
    """A wheel holds what ``pyproject.toml`` finds: every directory of the package, the stub, ``py.typed``."""
    import tomllib
    from setuptools import find_packages

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(PACKAGE.parent), include=config["packages"]["find"]["include"]))
    on_disk = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found == on_disk, (found, on_disk)
    assert "py.typed" in config["package-data"]["lightning_repro"]
    assert "*.pyi" in config["package-data"]["lightning_repro.data"]
    assert "*.pyi" in config["package-data"]["lightning_repro.checkpoint"]
    kernel = "lightning_repro.data._seedkernel"
    extension = f'Extension("{kernel}", sources=["lightning_repro/data/_seedkernel.c"], optional=True)'
    setup = (PACKAGE.parent / "setup.py").read_text()
    assert extension in setup
    kernel = "lightning_repro.checkpoint._rowsums"
    assert f'"{kernel}", sources=["lightning_repro/checkpoint/_rowsums.c"], optional=True' in setup
    assert (PACKAGE / "checkpoint" / "_rowsums.pyi").is_file()


# The import direction, written once here and once in docs/architecture.md (a test below keeps the two equal):
# a unit may import units of a lower layer, units of its own layer only where SIDEWAYS allows it, never upward.
LAYERS: dict[str, int] = {
    # bottom: seeds and flags, the stream table, errors, the process-stream capture, Lightning's private API
    "_lightning": 0,
    "_types": 0,
    "_warn": 0,
    "exceptions": 0,
    "rng": 0,
    "seeding": 0,
    "shards": 0,  # a sharded tensor (DTensor) seen as its local shard, for every digest
    "streams": 0,
    # concerns
    "checkpoint": 1,
    "data": 1,
    "manifest": 1,
    "trace": 1,
    # lifecycle: the callback hook by hook, on top of its data side and its checkpoint side
    "_resume": 2,
    "_takeover": 2,
    "callback": 2,
    "strategies": 3,
    # top: the verbs, the users' test helpers, multi-seed statistics, modules kept at an earlier public path
    "__main__": 4,
    "cli": 4,
    "entry": 4,
    "stats": 4,
    "strategy": 4,
    "testing": 4,
}
# imports between units of one layer that are allowed (importer unit, imported module); the bottom layer's units
# may import each other (the circle check still applies)
# may import each other; an import made only for type annotations (under ``if TYPE_CHECKING:``) may go sideways,
# never upward; the top layer's units may import each other
SIDEWAYS = {
    ("checkpoint", "lightning_repro.manifest.fingerprint"),  # a rank's part records the environment fingerprint
    ("checkpoint", "lightning_repro.data.takeover"),  # a rank's part records the position of the train samplers
    ("checkpoint", "lightning_repro.data.mapepoch"),  # ... and a map-style dataset's state given by set_epoch
    ("manifest", "lightning_repro.checkpoint.reading"),  # `env --compare CKPT` reads a checkpoint as `inspect` does
    ("trace", "lightning_repro.data.keyed"),  # a step record describes the keyed batch it trained on
    ("trace", "lightning_repro.data.fastrng"),  # the process-stream digests read the raw-memory layout checked there
    ("trace", "lightning_repro.checkpoint.hashing"),  # the batch's CRC-32 kernel is built with the row checksums'
    ("callback", "lightning_repro._takeover"),  # the callback's bases: its data side...
    ("_takeover", "lightning_repro._resume"),  # ... on top of its checkpoint side
}
TOP = max(LAYERS.values())
MAX_LINES = 400


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _type_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports of each module made only under ``if TYPE_CHECKING:``."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        guarded = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        ]
        known = set(graph) | {"lightning_repro"}
        inside = set().union(
            *(_imports(ast.Module(body=g.body, type_ignores=[]), name, known, parts[-1] == "__init__") for g in guarded)
        )
        rest = [n for n in tree.body if not any(n is g for g in guarded)]
        outside = _imports(ast.Module(body=rest, type_ignores=[]), name, known, parts[-1] == "__init__")
        out[name] = inside - outside
    return out


def _layer_violations(graph: dict[str, set[str]], type_only: dict[str, set[str]] | None = None) -> list[str]:
    found = []
    type_only = type_only or {}
    for module, deps in sorted(graph.items()):
        unit = _unit(module)
        if unit not in LAYERS:
            found.append(f"{module}: not in the layer table")
            continue
        for dep in sorted(deps):
            other = _unit(dep)
            if other == unit or other not in LAYERS:
                continue
            mine, theirs = LAYERS[unit], LAYERS[other]
            if theirs < mine or mine == theirs in (0, TOP) or (unit, dep) in SIDEWAYS:
                continue
            if theirs == mine and dep in type_only.get(module, ()):
                continue
            found.append(f"{module} imports {dep} ({'upward' if theirs > mine else 'sideways'})")
    return found


def test_imports_follow_the_layers() -> None:
    graph = _graph()
    graph.pop("lightning_repro")  # the package's __init__ re-exports the public names
    assert {_unit(module) for module in graph} == set(LAYERS), "a unit on disk is missing from LAYERS, or the reverse"
    assert _layer_violations(graph, _type_only(graph)) == []


def test_the_layer_check_can_fail() -> None:
    probe = {
        "lightning_repro.data.takeover": {"lightning_repro.callback"},  # upward
        "lightning_repro.trace.tracer": {"lightning_repro.manifest.drift"},  # sideways, not allowed
        "lightning_repro.trace.digest": {"lightning_repro.data.fastrng"},  # sideways, allowed
        "lightning_repro.seeding": {"lightning_repro.exceptions"},  # bottom to bottom
        "lightning_repro.newfolder.x": set(),  # not in the table
        "lightning_repro.manifest.run": {"lightning_repro.checkpoint.state", "lightning_repro.strategies.ddp"},
        "lightning_repro.cli.seeds": {"lightning_repro.stats.seeds"},  # top to top
    }
    type_only = {"lightning_repro.manifest.run": {"lightning_repro.checkpoint.state", "lightning_repro.strategies.ddp"}}
    assert _layer_violations(probe, type_only) == [
        "lightning_repro.data.takeover imports lightning_repro.callback (upward)",
        "lightning_repro.manifest.run imports lightning_repro.strategies.ddp (upward)",  # type-only, still upward
        "lightning_repro.newfolder.x: not in the layer table",
        "lightning_repro.trace.tracer imports lightning_repro.manifest.drift (sideways)",
    ]


def test_the_layer_table_is_the_one_in_the_architecture_page() -> None:
    """docs/architecture.md has the same table: a row per unit with its layer number."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip().strip("`").rstrip("/") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            for unit in cells[1].replace("`", "").split(","):
                rows[unit.strip().rstrip("/").removesuffix(".py")] = int(cells[0])
    assert rows == LAYERS


def _long_modules(lengths: dict[str, int]) -> list[str]:
    return sorted(f"{name} ({n} lines)" for name, n in lengths.items() if n > MAX_LINES)


def test_no_module_is_over_400_lines() -> None:
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert _long_modules(lengths) == []
    assert _long_modules({"a.py": MAX_LINES, "b.py": MAX_LINES + 1}) == ["b.py (401 lines)"]  # the check can fail


def test_every_folder_says_what_it_owns_and_may_import() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc or "may import" in doc, f"{init.relative_to(PACKAGE)}: say what it may import"
        assert "wns" in doc or init.parent.name == "_lightning", f"{init.relative_to(PACKAGE)}: say what it owns"
