"""The installed package holds every subpackage of the source tree: pyproject.toml lists packages by name, so a new
one left off the list installs (non-editable) without its files, and only an editable checkout would notice."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_installed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    found = set()
    for name, where in dirs.items():
        base = ROOT / where
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join((name, *rel.parts)) if rel.parts else name)
    assert found - listed == set(), f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"
