"""The distribution ships every package of the source tree: a package missing from
``[tool.setuptools] packages`` imports fine from a checkout or an editable install and
fails only once laneway is installed from its wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_ledger

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("controller", "workers", "cli", "migrations")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed
