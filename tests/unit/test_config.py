"""controller/config.py: loading, rendering and every way a config is refused."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from laneway.controller.config import (
    PipelineConfig,
    json_schema,
    load_config,
    placeholders,
    render,
    retryable,
)
from laneway.controller.errors import ConfigError
from laneway.controller.states import Outcome

GOOD_TOML = """
name = "demo"
sources = ["src/solve.py", "../shared.py"]
items_file = "data/items.jsonl"

[[nodes]]
name = "gpu-box"
memory_floor_mib = 1024
max_jobs = 2
gpu = { total_mib = 81920, fraction = 0.8, baseline_mib = 512 }

[[lanes]]
name = "a"
node = "gpu-box"
caps = { prepare = 1 }

[[lanes]]
name = "b"
node = "gpu-box"

[[stages]]
name = "prepare"
argv = ["python3", "prepare.py", "{item}", "--lane={lane}", "--size={size}"]
cwd = "work/{item}"
memory_mib = 64

[[stages]]
name = "solve"
argv = ["python3", "solve.py", "{item}", "--model", "{model}"]
cwd = "."
needs = ["prepare"]
env = { API_KEY = "${API_KEY}", MODE = "fast-{lane}" }
cap = 2
exit_codes = { 0 = "succeeded", 75 = "infra_failure" }
retry = { max_attempts = 3, on = ["infra_failure"] }

[[items]]
key = "i01"
lane = "a"
size = 3
model = "small"
"""

ITEMS_JSONL = (
    '{"key": "i02", "lane": "b", "size": 7, "model": "large"}\n'
    "\n"
    '{"key": "i-03.v2", "lane": "a", "size": 1, "model": "small"}\n'
)


def base() -> dict[str, Any]:
    """A minimal valid config as a raw mapping; each test mutates its own copy."""
    return copy.deepcopy(
        {
            "name": "p",
            "nodes": [{"name": "n1", "memory_floor_mib": 100, "max_jobs": 2}],
            "lanes": [{"name": "a", "node": "n1", "caps": {"prep": 1}}],
            "stages": [
                {"name": "prep", "argv": ["run", "{item}", "{lane}", "{size}"]},
                {"name": "solve", "argv": ["solve", "{item}"], "needs": ["prep"]},
            ],
            "items": [{"key": "i1", "lane": "a", "size": 3}],
        }
    )


def write_json(directory: Path, raw: Any, name: str = "pipeline.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.problems


# -- good configs --------------------------------------------------------------


@pytest.fixture
def toml_config(tmp_path: Path) -> tuple[PipelineConfig, Path]:
    config_dir = tmp_path / "conf"
    (config_dir / "data").mkdir(parents=True)
    (config_dir / "data" / "items.jsonl").write_text(ITEMS_JSONL, encoding="utf-8")
    path = config_dir / "pipeline.toml"
    path.write_text(GOOD_TOML, encoding="utf-8")
    return load_config(path), config_dir.resolve()


def test_toml_config_loads_nodes_lanes_stages(toml_config: tuple[PipelineConfig, Path]) -> None:
    config, _ = toml_config
    assert config.name == "demo"
    node = config.node("gpu-box")
    assert (node.memory_floor_mib, node.max_jobs) == (1024, 2)
    assert node.gpu is not None
    assert (node.gpu.total_mib, node.gpu.fraction, node.gpu.baseline_mib) == (81920, 0.8, 512)
    assert [lane.name for lane in config.lanes] == ["a", "b"]
    assert config.lane("a").caps == {"prepare": 1}
    assert config.lane("b").caps == {}
    solve = config.stage("solve")
    assert solve.needs == ["prepare"]
    assert solve.cap == 2
    assert solve.exit_codes == {0: Outcome.SUCCEEDED, 75: Outcome.INFRA_FAILURE}
    assert solve.retry.max_attempts == 3
    assert retryable(solve, Outcome.INFRA_FAILURE)
    assert not retryable(solve, Outcome.FAILED)


def test_stage_defaults_never_retry_and_map_zero_to_success(
    toml_config: tuple[PipelineConfig, Path],
) -> None:
    prepare = toml_config[0].stage("prepare")
    assert prepare.exit_codes == {0: Outcome.SUCCEEDED}
    assert prepare.retry.max_attempts == 1
    assert prepare.retry.on == []
    assert prepare.timeout_seconds == 3600
    assert not retryable(prepare, Outcome.FAILED)


def test_inline_items_come_first_then_items_file(toml_config: tuple[PipelineConfig, Path]) -> None:
    config, config_dir = toml_config
    assert [(i.key, i.lane) for i in config.items] == [("i01", "a"), ("i02", "b"), ("i-03.v2", "a")]
    assert config.items[1].fields == {"size": 7, "model": "large"}
    assert config.items_file == str(config_dir / "data" / "items.jsonl")


def test_relative_cwd_and_sources_resolve_against_config_dir(
    toml_config: tuple[PipelineConfig, Path],
) -> None:
    config, config_dir = toml_config
    assert config.stage("solve").cwd == str(config_dir)
    assert config.stage("prepare").cwd == str(config_dir / "work" / "{item}")
    assert config.sources == [
        str(config_dir / "src" / "solve.py"),
        str(config_dir.parent / "shared.py"),
    ]


def test_relative_paths_do_not_depend_on_process_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = base()
    raw["stages"][0]["cwd"] = "sub"
    raw["sources"] = ["a.py"]
    path = write_json(tmp_path, raw)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / path.name)
    assert config.stage("prep").cwd == str(tmp_path.resolve() / "sub")
    assert config.sources == [str(tmp_path.resolve() / "a.py")]


def test_absolute_cwd_is_kept(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["cwd"] = "/opt/jobs"
    config = load_config(write_json(tmp_path, raw))
    assert config.stage("prep").cwd == "/opt/jobs"


def test_no_cwd_stays_none(tmp_path: Path) -> None:
    config = load_config(write_json(tmp_path, base()))
    assert config.stage("prep").cwd is None


def test_json_config_loads_and_equals_the_same_config_twice(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["exit_codes"] = {"0": "succeeded", "3": "infra_failure"}
    first = load_config(write_json(tmp_path, raw))
    second = load_config(write_json(tmp_path, raw, name="copy.json"))
    assert first.stage("prep").exit_codes == {0: Outcome.SUCCEEDED, 3: Outcome.INFRA_FAILURE}
    assert first.sha256() == second.sha256()
    assert len(first.sha256()) == 64


def test_uppercase_extension_is_accepted(tmp_path: Path) -> None:
    config = load_config(write_json(tmp_path, base(), name="PIPE.JSON"))
    assert config.name == "p"


def test_items_file_only(tmp_path: Path) -> None:
    raw = base()
    del raw["items"]
    raw["items_file"] = "items.jsonl"
    (tmp_path / "items.jsonl").write_text(
        '{"key": "x1", "lane": "a", "size": 1}\n{"key": "x2", "lane": "a", "size": 2}\n',
        encoding="utf-8",
    )
    config = load_config(write_json(tmp_path, raw))
    assert [i.key for i in config.items] == ["x1", "x2"]
    assert [i.fields["size"] for i in config.items] == [1, 2]


# -- rendering -----------------------------------------------------------------


def test_render_expands_item_lane_and_fields(toml_config: tuple[PipelineConfig, Path]) -> None:
    config, _ = toml_config
    item = config.items[1]
    prepare = config.stage("prepare")
    assert [render(part, item) for part in prepare.argv] == [
        "python3",
        "prepare.py",
        "i02",
        "--lane=b",
        "--size=7",
    ]
    assert render(config.stage("solve").env["MODE"], item) == "fast-b"
    assert prepare.cwd is not None
    assert render(prepare.cwd, item).endswith("/work/i02")


def test_render_leaves_env_references_alone(toml_config: tuple[PipelineConfig, Path]) -> None:
    config, _ = toml_config
    item = config.items[0]
    assert render("${API_KEY}", item) == "${API_KEY}"
    assert render("--key=${API_KEY}:{item}@${lane}", item) == "--key=${API_KEY}:i01@${lane}"
    assert render("{{literal}} {model}", item) == "{literal} small"


def test_placeholders_skip_env_references_and_escaped_braces() -> None:
    assert placeholders("--k=${API_KEY} {item} {{x}} {size}") == ["item", "size"]
    assert placeholders("${TOKEN}") == []


# -- bad configs: each problem names its field path ---------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _set_key(key: str) -> Mutation:
    return lambda raw: raw["items"][0].update(key=key)


def _stage0(**fields: Any) -> Mutation:
    return lambda raw: raw["stages"][0].update(**fields)


BAD_CASES: list[tuple[str, Mutation, str, str]] = [
    ("key-dotdot-slash", _set_key("../x"), "items.0.key:", "'../x' is not allowed"),
    ("key-hidden", _set_key(".hidden"), "items.0.key:", "'.hidden' is not allowed"),
    ("key-slash", _set_key("a/b"), "items.0.key:", "'a/b' is not allowed"),
    ("key-empty", _set_key(""), "items.0.key:", "'' is not allowed"),
    ("key-dotdot", _set_key(".."), "items.0.key:", "is not allowed"),
    (
        "dup-item",
        lambda raw: raw["items"].append({"key": "i1", "lane": "a", "size": 1}),
        "items:",
        "'i1' appears more than once",
    ),
    (
        "dup-stage",
        lambda raw: raw["stages"].append({"name": "prep", "argv": ["x"]}),
        "stages:",
        "'prep' appears more than once",
    ),
    (
        "dup-lane",
        lambda raw: raw["lanes"].append({"name": "a", "node": "n1"}),
        "lanes:",
        "'a' appears more than once",
    ),
    (
        "dup-node",
        lambda raw: raw["nodes"].append({"name": "n1", "memory_floor_mib": 1, "max_jobs": 1}),
        "nodes:",
        "'n1' appears more than once",
    ),
    (
        "lane-unknown-node",
        lambda raw: raw["lanes"][0].update(node="zz"),
        "lanes.0.node:",
        "unknown node 'zz'",
    ),
    (
        "caps-unknown-stage",
        lambda raw: raw["lanes"][0]["caps"].update(zz=1),
        "lanes.0.caps.zz:",
        "unknown stage",
    ),
    (
        "item-unknown-lane",
        lambda raw: raw["items"][0].update(lane="zz"),
        "items.0.lane:",
        "unknown lane 'zz'",
    ),
    ("needs-later", _stage0(needs=["solve"]), "stages.0.needs:", "'solve'"),
    (
        "needs-unknown",
        lambda raw: raw["stages"][1].update(needs=["zz"]),
        "stages.1.needs:",
        "'zz'",
    ),
    ("needs-self", _stage0(needs=["prep"]), "stages.0.needs:", "'prep'"),
    ("missing-name", lambda raw: raw.pop("name"), "name:", "Field required"),
    ("missing-nodes", lambda raw: raw.pop("nodes"), "nodes:", "Field required"),
    ("missing-argv", lambda raw: raw["stages"][0].pop("argv"), "stages.0.argv:", "required"),
    ("empty-argv", _stage0(argv=[]), "stages.0.argv:", "at least 1"),
    (
        "missing-floor",
        lambda raw: raw["nodes"][0].pop("memory_floor_mib"),
        "nodes.0.memory_floor_mib:",
        "Field required",
    ),
    ("missing-item-lane", lambda raw: raw["items"][0].pop("lane"), "items.0.lane:", "required"),
    ("unknown-field", _stage0(colour="red"), "stages.0.colour:", "not permitted"),
    ("secret-env-literal", _stage0(env={"API_KEY": "abc123"}), "stages.0:", "env.API_KEY:"),
    ("secret-token-literal", _stage0(env={"GH_TOKEN": "x"}), "stages.0:", "env.GH_TOKEN:"),
    (
        "secret-env-ref-plus-text",
        _stage0(env={"DB_PASSWORD": "pre-${DB_PASSWORD}"}),
        "stages.0:",
        "env.DB_PASSWORD:",
    ),
    (
        "argv-bearer",
        _stage0(argv=["curl", "-H", "Authorization: Bearer abcdefgh12345"]),
        "stages.0:",
        "argv.2: holds a literal credential",
    ),
    (
        "argv-sk",
        _stage0(argv=["tool", "--key=sk-abcdefghijklmnop1234"]),
        "stages.0:",
        "argv.1: holds a literal credential",
    ),
    (
        "argv-ghp",
        _stage0(argv=["git", "ghp_abcdefghijklmnopqrstu"]),
        "stages.0:",
        "argv.1: holds a literal credential",
    ),
    (
        "exit-timed-out",
        _stage0(exit_codes={"0": "succeeded", "3": "timed_out"}),
        "stages.0:",
        "exit_codes.3: 'timed_out' is decided by laneway",
    ),
    (
        "exit-cancelled",
        _stage0(exit_codes={"0": "succeeded", "4": "cancelled"}),
        "stages.0:",
        "exit_codes.4: 'cancelled' is decided by laneway",
    ),
    (
        "exit-not-run",
        _stage0(exit_codes={"0": "succeeded", "5": "not_run"}),
        "stages.0:",
        "exit_codes.5: 'not_run'",
    ),
    (
        "exit-success-without-zero",
        _stage0(exit_codes={"2": "succeeded"}),
        "stages.0.exit_codes.2:",
        "0 must map to succeeded too",
    ),
    (
        "retry-harness",
        _stage0(retry={"max_attempts": 2, "on": ["harness_failure"]}),
        "stages.0.retry.on.0:",
        "'failed', 'infra_failure' or 'timed_out'",
    ),
    (
        "retry-fatal",
        _stage0(retry={"max_attempts": 2, "on": ["failed", "fatal"]}),
        "stages.0.retry.on.1:",
        "'failed', 'infra_failure' or 'timed_out'",
    ),
    (
        "retry-succeeded",
        _stage0(retry={"on": ["succeeded"]}),
        "stages.0.retry.on.0:",
        "'failed', 'infra_failure' or 'timed_out'",
    ),
    (
        "placeholder-missing",
        lambda raw: raw["stages"][1].update(argv=["x", "{model}"]),
        "stages.solve:",
        "placeholder {model} is not a field of 1 item(s) (i1)",
    ),
    (
        "placeholder-in-env",
        lambda raw: raw["stages"][1].update(env={"MODE": "{mode}"}),
        "stages.solve:",
        "placeholder {mode}",
    ),
    (
        "placeholder-in-cwd",
        lambda raw: raw["stages"][1].update(cwd="work/{where}"),
        "stages.solve:",
        "placeholder {where}",
    ),
    (
        "placeholder-positional",
        lambda raw: raw["stages"][1].update(argv=["x", "{}"]),
        "stages.solve:",
        "must be a plain field name",
    ),
    (
        "placeholder-attribute",
        lambda raw: raw["stages"][1].update(argv=["x", "{item.key}"]),
        "stages.solve:",
        "must be a plain field name",
    ),
    (
        "template-malformed",
        lambda raw: raw["stages"][1].update(argv=["x", "{item"]),
        "stages.solve:",
        "bad template",
    ),
    (
        "bad-stage-name",
        lambda raw: raw["stages"][1].update(name="Solve"),
        "stages.1.name:",
        "'Solve' is not allowed",
    ),
    (
        "max-jobs-zero",
        lambda raw: raw["nodes"][0].update(max_jobs=0),
        "nodes.0.max_jobs:",
        "greater than or equal to 1",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [pytest.param(m, p, f, id=case_id) for case_id, m, p, f in BAD_CASES],
)
def test_bad_config_names_the_field(
    tmp_path: Path, mutate: Mutation, path: str, fragment: str
) -> None:
    raw = base()
    mutate(raw)
    problems = problems_of(write_json(tmp_path, raw))
    matching = [p for p in problems if p.startswith(path) and fragment in p]
    assert matching, problems


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [pytest.param(m, p, f, id=case_id) for case_id, m, p, f in BAD_CASES],
)
def test_bad_config_problems_are_single_lines_without_traceback(
    tmp_path: Path, mutate: Mutation, path: str, fragment: str
) -> None:
    raw = base()
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, raw))
    error = info.value
    assert error.problems
    for problem in error.problems:
        assert isinstance(problem, str)
        assert problem.strip()
        assert "\n" not in problem and "\r" not in problem
        assert "Traceback" not in problem
        assert 'File "' not in problem
        assert "errors.pydantic.dev" not in problem
        assert "ValidationError" not in problem
    assert "\n" not in str(error)
    assert error.__cause__ is None
    assert error.__suppress_context__


def test_secret_reference_is_accepted(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["env"] = {"API_KEY": "${API_KEY}", "OTHER_TOKEN": "${SOME_TOKEN}"}
    config = load_config(write_json(tmp_path, raw))
    assert config.stage("prep").env == {"API_KEY": "${API_KEY}", "OTHER_TOKEN": "${SOME_TOKEN}"}


def test_short_bearer_word_is_not_a_credential(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["argv"] = ["echo", "bearer", "sk-short", "{item}"]
    config = load_config(write_json(tmp_path, raw))
    assert config.stage("prep").argv[1:3] == ["bearer", "sk-short"]


def test_reserved_placeholders_need_no_item_field(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][1]["argv"] = ["x", "{item}", "{lane}"]
    assert load_config(write_json(tmp_path, raw)).stage("solve").argv == ["x", "{item}", "{lane}"]


def test_placeholder_problem_lists_at_most_five_items(tmp_path: Path) -> None:
    raw = base()
    raw["items"] += [{"key": f"k{i}", "lane": "a", "size": 1} for i in range(7)]
    raw["stages"][1]["argv"] = ["x", "{model}"]
    problems = problems_of(write_json(tmp_path, raw))
    [line] = [p for p in problems if "{model}" in p]
    assert "8 item(s) (i1, k0, k1, k2, k3 …)" in line
    assert "k4" not in line


def test_placeholder_present_on_some_items_names_only_the_missing(tmp_path: Path) -> None:
    raw = base()
    raw["items"].append({"key": "i2", "lane": "a", "size": 1, "model": "m"})
    raw["items"].append({"key": "i3", "lane": "a", "size": 1})
    raw["stages"][1]["argv"] = ["x", "{model}"]
    problems = problems_of(write_json(tmp_path, raw))
    assert any("2 item(s) (i1, i3)" in p for p in problems), problems


def test_several_problems_are_all_listed(tmp_path: Path) -> None:
    raw = base()
    raw["lanes"][0]["node"] = "zz"
    raw["stages"][0]["needs"] = ["solve"]
    raw["items"].append({"key": "i1", "lane": "a", "size": 1})
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("lanes.0.node:") for p in problems)
    assert any(p.startswith("stages.0.needs:") for p in problems)
    assert any(p.startswith("items:") for p in problems)
    assert len(problems) == 3


def test_literal_credential_in_env_names_env_path(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["env"] = {"HEADER": "Authorization: Bearer abcdefgh12345"}
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("stages.0: env.HEADER:") for p in problems), problems


def test_every_problem_of_one_stage_is_listed(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["exit_codes"] = {"0": "succeeded", "3": "timed_out"}
    raw["stages"][0]["env"] = {"API_KEY": "literal"}
    problems = problems_of(write_json(tmp_path, raw))
    assert any("exit_codes.3" in p for p in problems), problems
    assert any("env.API_KEY" in p for p in problems), problems


# -- bad files -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pipeline.yaml", "pipeline", "pipeline.toml.bak", "p.jsonl"])
def test_wrong_extension(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(json.dumps(base()), encoding="utf-8")
    problems = problems_of(path)
    assert problems == [f"CONFIG: {path} must end in .toml or .json"]


def test_missing_file(tmp_path: Path) -> None:
    [problem] = problems_of(tmp_path / "absent.toml")
    assert problem.startswith("CONFIG: cannot read")
    assert "absent.toml" in problem


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        ("bad.toml", 'name = "p"\nnodes = [\n', "TOML"),
        ("bad2.toml", "name = \n", "TOML"),
        ("bad.json", '{"name": "p",', "JSON"),
        ("bad2.json", "", "JSON"),
    ],
)
def test_unparseable_file(tmp_path: Path, name: str, text: str, kind: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    [problem] = problems_of(path)
    assert problem.startswith(f"CONFIG: {path} is not valid {kind}: ")
    assert "\n" not in problem


def test_non_utf8_toml(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b'name = "\xff\xfe"\n')
    [problem] = problems_of(path)
    assert problem.startswith(f"CONFIG: {path} is not valid TOML")


@pytest.mark.parametrize("top", [[1, 2], "text", 3])
def test_json_top_level_not_an_object(tmp_path: Path, top: Any) -> None:
    path = write_json(tmp_path, top)
    assert problems_of(path) == [f"CONFIG: {path} must hold a table/object at the top level"]


def test_items_file_non_object_line_names_line_number(tmp_path: Path) -> None:
    raw = base()
    raw["items_file"] = "items.jsonl"
    (tmp_path / "items.jsonl").write_text(
        '{"key": "x1", "lane": "a", "size": 1}\n[1, 2]\n"x"\n', encoding="utf-8"
    )
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("items_file line 2:") and "JSON object" in p for p in problems)
    assert any(p.startswith("items_file line 3:") for p in problems)
    assert not any(p.startswith("items_file line 1:") for p in problems)


def test_items_file_bad_json_line_names_line_number(tmp_path: Path) -> None:
    raw = base()
    raw["items_file"] = "items.jsonl"
    (tmp_path / "items.jsonl").write_text(
        '{"key": "x1", "lane": "a", "size": 1}\n\n{"key": \n', encoding="utf-8"
    )
    problems = problems_of(write_json(tmp_path, raw))
    file_problems = [p for p in problems if p.startswith("items_file")]
    assert len(file_problems) == 1, problems
    assert file_problems[0].startswith("items_file line 3: not JSON")


def test_items_file_problems_survive_other_validation_errors(tmp_path: Path) -> None:
    raw = base()
    raw["items_file"] = "items.jsonl"
    raw["lanes"][0]["node"] = "zz"
    (tmp_path / "items.jsonl").write_text("7\n", encoding="utf-8")
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("items_file line 1:") for p in problems)
    assert any(p.startswith("lanes.0.node:") for p in problems)


def test_items_file_missing(tmp_path: Path) -> None:
    raw = base()
    raw["items_file"] = "nope.jsonl"
    problems = problems_of(write_json(tmp_path, raw))
    assert len(problems) == 1
    assert problems[0].startswith("items_file: cannot read")
    assert str(tmp_path.resolve() / "nope.jsonl") in problems[0]


def test_items_file_item_with_bad_key(tmp_path: Path) -> None:
    raw = base()
    raw["items_file"] = "items.jsonl"
    (tmp_path / "items.jsonl").write_text('{"key": "../up", "lane": "a", "size": 1}\n')
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("items.1.key:") and "'../up'" in p for p in problems), problems


# -- schema --------------------------------------------------------------------


def test_json_schema_describes_stages() -> None:
    schema = json_schema()
    assert isinstance(schema, dict)
    assert "stages" in schema["properties"]
    assert {"name", "nodes", "lanes", "stages"} <= set(schema["required"])
    json.dumps(schema)


def test_env_name_pattern_is_checked(tmp_path: Path) -> None:
    raw = base()
    raw["stages"][0]["env"] = {"1BAD": "x"}
    problems = problems_of(write_json(tmp_path, raw))
    assert any(p.startswith("stages.0.env.1BAD") for p in problems), problems


def test_process_environment_is_not_consulted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("API_KEY", "real-secret-value")
    raw = base()
    raw["stages"][0]["env"] = {"API_KEY": "${API_KEY}"}
    config = load_config(write_json(tmp_path, raw))
    assert config.stage("prep").env == {"API_KEY": "${API_KEY}"}
    assert "real-secret-value" not in config.canonical_json()
