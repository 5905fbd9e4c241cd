from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _each_backend(ledger_backend: str) -> str:
    """Every test here runs once per ledger backend (tests/conftest.py)."""
    return ledger_backend
