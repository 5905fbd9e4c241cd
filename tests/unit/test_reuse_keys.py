"""What a stage's reuse key covers (controller/reuse.py, version 2): the code its argv
names, its own sources, the top-level sources only with ``sources_scope = "all"``; and
preflight's refusal of a script that is not where the job would look for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laneway.controller import reuse
from laneway.controller.config import parse_config
from laneway.controller.pipeline import preflight

pytestmark = pytest.mark.no_ledger


def config_in(tmp_path: Path, stages: list[dict], **extra):
    raw = {
        "name": "k",
        "nodes": [{"name": "n1", "memory_floor_mib": 0, "max_jobs": 1}],
        "lanes": [{"name": "a", "node": "n1"}],
        "stages": stages,
        "items": [{"key": "i1", "lane": "a"}],
        **extra,
    }
    return parse_config(raw, tmp_path)


def test_the_code_an_argv_names_counts_and_data_programs_on_path_and_templates_do_not(tmp_path):
    config = config_in(
        tmp_path,
        [
            {
                "name": "s",
                "argv": [
                    "python3",  # found through PATH: not the pipeline's
                    "judge.py",
                    "lib/helper.sh",
                    "/usr/lib/tool.py",  # the machine's
                    "{item}.py",  # a template: rendered per item
                    "--flag=x.py",  # an option
                    str(tmp_path / "out.jsonl"),  # data, not code
                    "/opt/shared/score.R",
                ],
                "cwd": ".",
            },
            {"name": "t", "argv": ["./run.sh", "x.py"]},  # no cwd: relative names unknown
        ],
    )
    s, t = config.stages
    assert [(i, path) for i, _, path in reuse.named_paths(s)] == [
        (1, str(tmp_path / "judge.py")),
        (2, str(tmp_path / "lib" / "helper.sh")),
        (7, "/opt/shared/score.R"),
    ]
    assert [(i, path) for i, _, path in reuse.named_paths(t)] == [(0, str(tmp_path / "run.sh"))]


def test_top_level_sources_count_for_the_stages_that_list_them_or_all(tmp_path):
    for name in ("a.py", "b.py", "lib.py", "card.md"):
        (tmp_path / name).write_text(name)
    stages = [
        {"name": "a", "argv": ["python3", "a.py"], "cwd": "."},
        {"name": "b", "argv": ["python3", "b.py"], "cwd": ".", "sources": ["lib.py"]},
    ]
    listed = config_in(tmp_path, stages, sources=["card.md"])
    reasons, hashes = preflight(listed)
    assert reasons == []
    assert set(hashes) == {str(tmp_path / n) for n in ("a.py", "b.py", "lib.py", "card.md")}
    a, b = listed.stages
    assert reuse.stage_sources(a, listed, hashes) == [str(tmp_path / "a.py")]
    assert reuse.stage_sources(b, listed, hashes) == [
        str(tmp_path / "b.py"),
        str(tmp_path / "lib.py"),
    ]
    everything = config_in(tmp_path, stages, sources=["card.md"], sources_scope="all")
    assert reuse.stage_sources(everything.stages[0], everything, hashes) == [
        str(tmp_path / "a.py"),
        str(tmp_path / "card.md"),
    ]
    # A changed file changes the keys of the stages that depend on it, and only those.
    item = listed.items[0]
    before = reuse.item_reuse_keys(listed, item, hashes)
    after = reuse.item_reuse_keys(listed, item, {**hashes, str(tmp_path / "lib.py"): "0" * 64})
    assert after["a"] == before["a"] and after["b"] != before["b"]


def test_preflight_refuses_a_script_the_job_would_not_find(tmp_path):
    (tmp_path / "prepare.py").write_text("")
    typo = config_in(tmp_path, [{"name": "p", "argv": ["python3", "prepar.py"], "cwd": "."}])
    assert preflight(typo)[0] == [
        f"stages.p.argv[1]: prepar.py is not a file in {tmp_path}; fix the name, or set the "
        "stage's cwd to the directory that holds it"
    ]
    # No cwd: the job runs in its empty workspace, where prepare.py is not.
    no_cwd = config_in(tmp_path, [{"name": "p", "argv": ["python3", "prepare.py", "{item}"]}])
    [reason] = preflight(no_cwd)[0]
    assert reason.startswith("stages.p.argv[1]: prepare.py is relative, and the stage has no cwd")
    fine = config_in(tmp_path, [{"name": "p", "argv": [sys.executable, "prepare.py"], "cwd": "."}])
    assert preflight(fine)[0] == []


@given(st.lists(st.text(max_size=30), min_size=1, max_size=6), st.one_of(st.none(), st.text()))
def test_any_argv_and_cwd_give_paths_or_nothing_never_an_error(argv, cwd):
    from laneway.controller.config_models import StageConfig

    stage = StageConfig.model_construct(name="s", argv=argv, cwd=cwd)
    for index, element, path in reuse.named_paths(stage):
        assert element == argv[index] and path.startswith("/")
