"""The bounded random-kill soak (bench/soak.py runs the long one): at least 30 SIGKILLs of
workers, supervisors and the controller; no duplicate execution, no lost outcome, no
unknown settled without an operator, every job finally succeeded, ledger intact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_thirty_random_kills_keep_every_promise(tmp_path):
    report = load_soak().soak(kills=30, items=40, seed=7, root=tmp_path, say=lambda _: None)
    assert report["kills"] >= 30
    assert report["duplicate_executions"] == 0
    assert report["lost_outcomes"] == 0
    assert report["unknown_settled_without_reconcile"] == 0
    assert report["succeeded_without_side_effect"] == 0
    assert report["jobs"] == {"succeeded": 40}
    assert report["integrity_check"] == "ok"
    assert report["ok"] is True
