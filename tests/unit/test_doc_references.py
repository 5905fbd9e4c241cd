"""The docs cite tests and code as `path::function`: each must exist, so a renamed or
removed test cannot leave a guarantee pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_ledger

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`?((?:tests|controller|workers|cli|bench)/[\w/]+\.py)::(\w+)")


def citations() -> list[tuple[str, str, str]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path, name in CITATION.findall(doc.read_text(encoding="utf-8")):
            found.append((doc.name, path, name))
    return found


def test_the_docs_cite_tests():
    assert len(citations()) > 50


@pytest.mark.parametrize(("doc", "path", "name"), citations())
def test_each_cited_function_exists(doc, path, name):
    source = ROOT / path
    assert source.is_file(), f"{doc} cites {path}, which does not exist"
    text = source.read_text(encoding="utf-8")
    assert re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", text, re.M), (
        f"{doc} cites {path}::{name}, which {path} does not define"
    )
