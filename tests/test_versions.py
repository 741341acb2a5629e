"""The supported versions are the tested ones: pyproject's lower bounds are the pins of requirements/lock-min.txt.

requirements/lock-new.txt tests a newer torch than requirements/lock.txt (the newest this machine offers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BOUNDED = ("lightning", "numpy", "torch", "torchmetrics")


def _pins(lock: Path) -> dict[str, Version]:
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name.strip())] = Version(version.strip())
    return pins


def _dependencies() -> dict[str, Requirement]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonicalize_name((req := Requirement(line)).name): req for line in project["dependencies"]}


def _lower_bound(req: Requirement) -> Version:
    bounds = [Version(spec.version) for spec in req.specifier if spec.operator == ">="]
    assert len(bounds) == 1, f"{req} should have exactly one '>=' bound"
    return bounds[0]


@pytest.mark.parametrize("name", BOUNDED)
def test_lower_bound_is_the_tested_minimum(name: str) -> None:
    pinned = _pins(ROOT / "requirements" / "lock-min.txt")[name]
    bound = _lower_bound(_dependencies()[name])
    # the lock pins a local build (torch 2.13.0+cpu); the bound is the release it is built from
    assert Version(pinned.public) == bound or Version(pinned.base_version) == bound, (
        f"pyproject.toml allows {name}>={bound}, but requirements/lock-min.txt tests {pinned}: make them equal"
    )


@pytest.mark.parametrize("lock", ["lock.txt", "lock-min.txt", "lock-new.txt"])
def test_every_lock_is_allowed_by_pyproject(lock: str) -> None:
    pins = _pins(ROOT / "requirements" / lock)
    for name, req in _dependencies().items():
        assert name in pins, f"requirements/{lock} does not pin {name}"
        assert req.specifier.contains(Version(pins[name].public), prereleases=True), (
            f"requirements/{lock} pins {name}=={pins[name]}, outside pyproject.toml's {req}"
        )


def test_the_newest_torch_lock_is_newer_than_the_main_lock() -> None:
    main, new = (_pins(ROOT / "requirements" / lock)["torch"] for lock in ("lock.txt", "lock-new.txt"))
    assert Version(new.base_version) > Version(main.base_version), (
        f"requirements/lock-new.txt pins torch=={new}, not newer than requirements/lock.txt's {main}:"
        " pin the newest torch pip offers there, or drop .venv-new"
    )
