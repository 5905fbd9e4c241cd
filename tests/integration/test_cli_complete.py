"""Shell completion (typer's own) completes run ids, job and attempt ids and node names
from the ledger; without a ledger it completes nothing, quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import config_file

LANEWAY = Path(sys.executable).parent / "laneway"


def complete(words: str, runtime: Path) -> str:
    """What zsh's completion would be offered after ``words``."""
    env = {
        **os.environ,
        "_LANEWAY_COMPLETE": "complete_zsh",
        "_TYPER_COMPLETE_ARGS": words,
        "LANEWAY_RUNTIME_DIR": str(runtime),
    }
    done = subprocess.run(
        [str(LANEWAY)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stdout


@pytest.mark.skipif(not LANEWAY.exists(), reason=f"no {LANEWAY} (pip install -e . first)")
def test_ids_and_nodes_come_from_the_ledger(tmp_path: Path):
    runtime = tmp_path / "rt"
    assert complete("laneway status ", runtime).count('"') == 0  # no ledger: nothing
    result = invoke("run", str(config_file(tmp_path, items=2)), "--runtime-dir", str(runtime))
    assert result.exit_code == 0, result.output
    assert '"1":"svc (finished)"' in complete("laneway status ", runtime)
    offered = complete("laneway logs ", runtime)
    assert '"2":"x1.only settled"' in offered and '"1":"x0.only settled"' in offered
    assert '"n1":"max_jobs 2"' in complete("laneway worker --node ", runtime)
