"""Shell completion (typer's own) completes run ids, job and attempt ids and node names
from the ledger; without a ledger it completes nothing, quietly. Job ids are the newest
run's unfinished jobs, offered to zsh with their item, stage and state and to bash (its
real completion function, as `laneway --show-completion bash` prints it) as bare ids."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from laneway.controller.states import Outcome
from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import config_file
from tests.support import claim_on_n1, make_config, py_stage, settle_one

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


def bash_complete(words: list[str], runtime: Path) -> list[str]:
    """What bash offers after ``words`` (the last one the word being completed): the
    completion script typer installs, sourced into a real bash and called as bash would."""
    if shutil.which("bash") is None:
        pytest.skip("no bash on PATH for the bash completion check")
    # Named, not detected: typer would look for a shell among this test's ancestors,
    # which depends on how the suite was started (and what ran before it).
    shown = subprocess.run(
        [str(LANEWAY), "--show-completion", "bash"],
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, (shown.returncode, shown.stderr)
    script = shown.stdout
    assert "complete -o default -F _laneway_completion laneway" in script, script
    line = " ".join(shlex.quote(word) for word in words)
    probe = (
        f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n"
        'complete -p laneway >/dev/null && _laneway_completion laneway && printf "%s\\n" '
        '"${COMPREPLY[@]}"\n'
    )
    env = {
        **os.environ,
        "PATH": f"{LANEWAY.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "LANEWAY_RUNTIME_DIR": str(runtime),
    }
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return [value for value in done.stdout.splitlines() if value]


@pytest.mark.skipif(not LANEWAY.exists(), reason=f"no {LANEWAY} (pip install -e . first)")
def test_job_ids_complete_from_the_ledger(runtime, factory, make_run, register_worker, clock):
    # An older run with a job in flight, then the newest: two items of two stages, whose
    # x0.prep has succeeded; the rest of it is to do.
    make_run(make_config([py_stage("only", "pass")], items=1))
    config = make_config(
        [py_stage("prep", "pass"), py_stage("solve", "pass", needs=["prep"])],
        items=[{"key": "x0", "lane": "a"}, {"key": "x1", "lane": "a"}],
    )
    newest = make_run(config)
    worker = register_worker()
    claimed = claim_on_n1(factory, worker, clock, slots=3)
    ids = {(c.run_id, c.item, c.stage): c for c in claimed}
    assert sorted(ids) == [(1, "item0", "only"), (newest, "x0", "prep"), (newest, "x1", "prep")]
    settle_one(factory, ids[newest, "x0", "prep"], worker, clock, Outcome.SUCCEEDED)
    older = ids[1, "item0", "only"].job_id
    done, running = ids[newest, "x0", "prep"].job_id, ids[newest, "x1", "prep"].job_id
    offered = re.findall(r'"(\d+)":"([^"]*)"', complete("laneway explain ", runtime))
    # Every unfinished job of the newest run, newest first, with what it is; not the one
    # that succeeded, nothing of the older run.
    assert [words for _, words in offered] == [
        "x1.solve waiting",
        "x1.prep running",
        "x0.solve ready",
    ]
    assert offered[1][0] == str(running)
    assert [int(job) for job, _ in offered] == sorted((int(j) for j, _ in offered), reverse=True)
    assert {str(done), str(older)}.isdisjoint(job for job, _ in offered)
    # bash: the bare ids, newest first, narrowed by what is typed.
    unfinished = bash_complete(["laneway", "explain", ""], runtime)
    assert unfinished == [job for job, _ in offered]
    assert bash_complete(["laneway", "explain", str(running)], runtime) == [str(running)]
    assert bash_complete(["laneway", "retry", ""], runtime) == unfinished
