"""Hostile config values: every one becomes a one-line error naming the field (at load)
or a preflight reason, never a traceback, a hang or a value a run cannot store.

The property-based test at the end generates configs with hostile numeric and text
values and runs `laneway dry-run` on them in process."""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from laneway.cli.main import app
from laneway.controller import limits, pipeline
from laneway.controller.config import config_from_frozen, load_config, parse_config
from laneway.controller.errors import ConfigError

pytestmark = pytest.mark.no_ledger

BASE: dict[str, Any] = {
    "name": "hostile",
    "nodes": [
        {
            "name": "n1",
            "memory_floor_mib": 0,
            "max_jobs": 2,
            "gpu": {"total_mib": 1000, "fraction": 0.9, "baseline_mib": 0},
        }
    ],
    "lanes": [{"name": "a", "node": "n1", "caps": {"s": 1}}],
    "stages": [
        {
            "name": "s",
            "argv": ["true", "{who}"],
            "env": {"WHO": "{who}"},
            "cwd": ".",
            "timeout_seconds": 60,
            "grace_seconds": 1.0,
            "memory_mib": 0,
            "gpu_mib": 0,
            "log_cap_mib": 1.0,
            "memory_margin": 1.25,
            "ports": 0,
            "cap": 1,
            "capture": {"max_mib": 1.0, "max_seconds": 1.0},
            "retry": {
                "max_attempts": 1,
                "backoff_seconds": 0,
                "backoff_multiplier": 2.0,
                "backoff_max_seconds": 10,
            },
            "exit_codes": {"0": "succeeded", "3": "failed"},
            "budget": {"cost_usd": 1.0},
            "expected_usage": {"cost_usd": 0.5},
            "limits": ["p"],
            "gpus": 0,
            "output_max_mib": 16,
        }
    ],
    "limits": {"p": {"calls": 5, "per_seconds": 60.0, "cost_usd": 2.0}},
    "notify": {"command": ["true"], "retries": 1, "timeout_seconds": 5.0},
    "items": [{"key": "i1", "lane": "a", "who": "x", "n": 1}],
    "sources": [],
    "batch_cap": 1,
    "infra_breaker": 3,
    "budget": {"cost_usd": 5.0},
    "closeout": [{"name": "report", "argv": ["true", "{run}"], "timeout_seconds": 60}],
}

INT_FIELDS = [
    "nodes.0.memory_floor_mib",
    "nodes.0.max_jobs",
    "nodes.0.gpu.total_mib",
    "nodes.0.gpu.baseline_mib",
    "nodes.0.gpu.devices",
    "lanes.0.caps.s",
    "stages.0.timeout_seconds",
    "stages.0.memory_mib",
    "stages.0.gpu_mib",
    "stages.0.ports",
    "stages.0.cap",
    "stages.0.retry.max_attempts",
    "stages.0.gpus",
    "stages.0.output_max_mib",
    "batch_cap",
    "infra_breaker",
    "closeout.0.timeout_seconds",
    "limits.p.calls",
    "notify.retries",
]
FLOAT_FIELDS = [
    "nodes.0.gpu.fraction",
    "stages.0.grace_seconds",
    "stages.0.log_cap_mib",
    "stages.0.memory_margin",
    "stages.0.capture.max_mib",
    "stages.0.capture.max_seconds",
    "stages.0.retry.backoff_seconds",
    "stages.0.retry.backoff_multiplier",
    "stages.0.retry.backoff_max_seconds",
    "stages.0.budget.cost_usd",
    "stages.0.expected_usage.cost_usd",
    "budget.cost_usd",
    "limits.p.per_seconds",
    "limits.p.cost_usd",
    "notify.timeout_seconds",
]
TEXT_FIELDS = [
    "stages.0.argv.1",
    "stages.0.env.WHO",
    "stages.0.cwd",
    "closeout.0.argv.1",
    "closeout.0.cwd",
    "artifact_store",
    "items_file",
    "sources.0",
]
ITEM_FIELDS = ["items.0.who", "items.0.n"]
"""Item fields are named by the item in errors (``items.0: field 'who' of item 'i1'``)."""


def with_value(path: str, value: Any) -> dict[str, Any]:
    """BASE with the value at dotted ``path`` replaced (a list index may append)."""
    raw = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node: Any = raw
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        index = int(last)
        node[index : index + 1] = [value]
    else:
        node[last] = value
    return raw


def refusal(raw: dict[str, Any], tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, tmp_path)
    return caught.value.problems


def named(lines: list[str], where: str) -> bool:
    """Some line is about ``where`` (``where: message``; for CONFIG, ``CONFIG: PATH ...``)."""
    return any(line == where or line.startswith(where + ":") for line in lines)


def test_the_base_config_is_valid(tmp_path: Path) -> None:
    raw = copy.deepcopy(BASE)
    config = parse_config(raw, tmp_path)
    assert config.stage("s").log_cap_mib == 1.0


@pytest.mark.parametrize("path", INT_FIELDS)
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 10**400])
def test_every_integer_field_is_bounded_to_what_the_ledger_stores(
    tmp_path: Path, path: str, value: int
) -> None:
    assert named(refusal(with_value(path, value), tmp_path), path)


def test_the_largest_ledger_integer_is_accepted_where_a_field_has_no_smaller_bound(
    tmp_path: Path,
) -> None:
    raw = with_value("nodes.0.memory_floor_mib", limits.LEDGER_INT_MAX)
    raw["nodes"][0]["gpu"]["total_mib"] = limits.LEDGER_INT_MAX
    raw["stages"][0]["memory_mib"] = limits.LEDGER_INT_MAX
    config = parse_config(raw, tmp_path)
    assert config.nodes[0].memory_floor_mib == limits.LEDGER_INT_MAX


def test_an_exit_code_the_ledger_cannot_store_is_refused(tmp_path: Path) -> None:
    raw = copy.deepcopy(BASE)
    raw["stages"][0]["exit_codes"][str(2**31)] = "failed"
    lines = refusal(raw, tmp_path)
    assert any(line.startswith(f"stages.0.exit_codes.{2**31}:") for line in lines), lines


def test_max_jobs_stops_at_the_most_slots_a_worker_takes(tmp_path: Path) -> None:
    lines = refusal(with_value("nodes.0.max_jobs", limits.MAX_SLOTS + 1), tmp_path)
    assert named(lines, "nodes.0.max_jobs")


@pytest.mark.parametrize("path", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_refuses_nan_and_inf(tmp_path: Path, path: str, value: float) -> None:
    assert named(refusal(with_value(path, value), tmp_path), path)


@pytest.mark.parametrize("path", ["stages.0.log_cap_mib", "stages.0.capture.max_mib"])
def test_a_size_in_mib_must_have_its_bytes_fit_the_ledger(tmp_path: Path, path: str) -> None:
    lines = refusal(with_value(path, 1e300), tmp_path)
    assert named(lines, path) and "2**43 MiB" in "\n".join(lines)
    accepted = parse_config(with_value(path, limits.MAX_MIB - 1), tmp_path)
    stage = accepted.stage("s")
    size = stage.log_cap_mib if path.endswith("log_cap_mib") else stage.capture.max_mib  # type: ignore[union-attr]
    assert int(size * 1024 * 1024) <= limits.JSON_INT_MAX


@pytest.mark.parametrize(
    "line", ["log_cap_mib = inf", "log_cap_mib = nan", "capture = { max_mib = inf }"]
)
def test_toml_inf_passes_no_more_as_a_size(tmp_path: Path, line: str) -> None:
    """`log_cap_mib = inf` passed dry-run, then raised OverflowError in `run`."""
    config = tmp_path / "p.toml"
    config.write_text(
        'name = "p"\n[[nodes]]\nname = "n"\nmemory_floor_mib = 0\nmax_jobs = 1\n'
        '[[lanes]]\nname = "l"\nnode = "n"\n'
        f'[[stages]]\nname = "s"\nargv = ["true"]\n{line}\n'
        '[[items]]\nkey = "a"\nlane = "l"\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    field = "stages.0.capture.max_mib" if "capture" in line else "stages.0.log_cap_mib"
    assert named(caught.value.problems, field)


@pytest.mark.parametrize("path", TEXT_FIELDS)
@pytest.mark.parametrize("value", ["a\x00b", "x\ud800y"])
def test_text_fields_refuse_nul_and_lone_surrogates(tmp_path: Path, path: str, value: str) -> None:
    lines = refusal(with_value(path, value), tmp_path)
    assert named(lines, path), lines


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a\x00b", "holds a NUL character"),
        ("\udcff", "lone surrogate ('\\udcff')"),
        (2**63, "does not fit the ledger, which stores integers from -2**63 to 2**63-1"),
        (math.nan, "nan is not a finite number"),
        ([["ok", "\x00"]], "[0][1] holds a NUL character"),
        ({"deep": "\ud800"}, "['deep'] holds a lone surrogate"),
    ],
)
def test_an_item_field_that_cannot_be_passed_on_is_refused_naming_item_and_field(
    tmp_path: Path, value: Any, words: str
) -> None:
    """A NUL in an item field made the supervisor die at spawn (the attempt went
    unknown); a lone surrogate could not be written to the ledger."""
    lines = refusal(with_value("items.0.who", value), tmp_path)
    (line,) = [line for line in lines if line.startswith("items.0:")]
    assert "field 'who' of item 'i1'" in line and words in line, line


def test_a_toml_date_in_an_item_field_is_refused(tmp_path: Path) -> None:
    """Before, dry-run accepted it and start-pipeline failed storing the item (a
    datetime is not JSON)."""
    config = tmp_path / "p.toml"
    config.write_text(
        'name = "p"\n[[nodes]]\nname = "n"\nmemory_floor_mib = 0\nmax_jobs = 1\n'
        '[[lanes]]\nname = "l"\nnode = "n"\n[[stages]]\nname = "s"\nargv = ["echo", "{when}"]\n'
        '[[items]]\nkey = "a"\nlane = "l"\nwhen = 1979-05-27T07:32:00Z\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    (line,) = caught.value.problems
    assert line.startswith("items.0: field 'when' of item 'a' is a TOML datetime"), line


def test_an_item_field_name_with_a_nul_is_refused(tmp_path: Path) -> None:
    raw = copy.deepcopy(BASE)
    raw["items"][0]["bad\x00name"] = 1
    (line,) = [line for line in refusal(raw, tmp_path) if line.startswith("items.0:")]
    assert "field 'bad\\x00name' of item 'i1' holds a NUL" in line


def test_a_cwd_template_that_renders_absolute_is_not_joined_under_the_config_dir(
    tmp_path: Path,
) -> None:
    """Before, ``cwd = "{dir}"`` with ``dir = "/srv"`` became ``<config dir>//srv``."""
    raw = with_value("stages.0.cwd", "{dir}")
    raw["items"][0]["dir"] = "/srv"
    (line,) = refusal(raw, tmp_path)
    assert line.startswith("stages.0.cwd: '{dir}' is relative to the config file, but renders")
    assert "for item(s) i1 ('/srv')" in line
    raw["items"][0]["dir"] = "work"
    assert parse_config(raw, tmp_path).stage("s").cwd == str(tmp_path / "{dir}")


@pytest.mark.timeout(30)
def test_an_items_file_that_is_a_device_or_fifo_is_refused_not_read(tmp_path: Path) -> None:
    """/dev/zero grew the process to 7.9 GB; a FIFO without a writer hung the load."""
    fifo = tmp_path / "items.fifo"
    os.mkfifo(fifo)
    for target, kind in (("/dev/zero", "a character device"), (str(fifo), "a FIFO")):
        lines = refusal(with_value("items_file", target), tmp_path)
        assert f"items_file: cannot read {target}: not a regular file ({kind})" in lines


def test_an_items_file_is_read_up_to_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = tmp_path / "items.jsonl"
    items.write_text('{"key": "k", "lane": "a", "who": "x", "n": 1}\n' * 100)
    monkeypatch.setattr(limits, "ITEMS_FILE_MAX_BYTES", 1000)
    lines = refusal(with_value("items_file", str(items)), tmp_path)
    assert any("larger than 1000 bytes" in line for line in lines), lines


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\xff\xfe{}\n", "is not UTF-8 text (byte 0)"),
        (b'{"key": "k", "lane": "a", "n": ' + b"1" * 5000 + b"}\n", "line 1: not usable JSON"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1: not usable JSON"),
    ],
)
def test_an_items_file_that_python_cannot_parse_is_one_line(
    tmp_path: Path, content: bytes, words: str
) -> None:
    """Each of these raised a traceback (UnicodeDecodeError, the 4300-digit limit,
    RecursionError)."""
    items = tmp_path / "items.jsonl"
    items.write_bytes(content)
    lines = refusal(with_value("items_file", str(items)), tmp_path)
    assert any(words in line for line in lines), lines


@pytest.mark.timeout(30)
def test_a_config_that_is_a_device_is_refused_not_read(tmp_path: Path) -> None:
    config = tmp_path / "p.json"
    config.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert caught.value.problems == [
        f"CONFIG: cannot read {config}: not a regular file (a character device)"
    ]


@pytest.mark.parametrize("text", ['{"name": ' + "1" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_a_config_python_cannot_parse_is_one_line(tmp_path: Path, text: str) -> None:
    config = tmp_path / "p.json"
    config.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    (line,) = caught.value.problems
    assert line.startswith(f"CONFIG: {config} is not usable JSON")


def test_a_config_path_with_a_newline_is_named_on_one_line(tmp_path: Path) -> None:
    config = tmp_path / "odd\nname.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    (line,) = caught.value.problems
    assert "\n" not in line and "odd\\nname.toml" in line


# Preflight: what the filesystem holds.


@pytest.mark.timeout(30)
def test_a_source_that_is_a_device_or_fifo_is_refused_not_hashed(tmp_path: Path) -> None:
    """A /dev/zero source was hashed forever; a FIFO blocked the open."""
    fifo = tmp_path / "src.fifo"
    os.mkfifo(fifo)
    raw = copy.deepcopy(BASE)
    raw["sources"] = ["/dev/zero", str(fifo)]
    reasons, hashes = pipeline.preflight(parse_config(raw, tmp_path))
    assert "sources: cannot read /dev/zero: not a regular file (a character device)" in reasons
    assert f"sources: cannot read {fifo}: not a regular file (a FIFO)" in reasons
    assert hashes == {}


def test_an_argv_too_long_to_start_is_said_at_preflight(tmp_path: Path) -> None:
    raw = with_value("items.0.who", "x" * (130 * 1024))
    reasons, _ = pipeline.preflight(parse_config(raw, tmp_path))
    (line,) = [reason for reason in reasons if reason.startswith("stages.s.argv:")]
    assert "130 KiB for item(s) i1" in line and "under 120 KiB" in line
    fits = with_value("items.0.who", "x" * (100 * 1024))
    assert not [r for r in pipeline.preflight(parse_config(fits, tmp_path))[0] if "argv" in r]


@pytest.mark.parametrize(
    ("store", "words"),
    [
        ("file://{rt}/ledger.sqlite3", "is inside laneway's ledger file ledger.sqlite3"),
        ("file://{rt}/ledger.sqlite3-wal/objects", "is inside laneway's ledger file"),
        ("file://{rt}/some.file", "is a file, not a directory"),
        ("file://{rt}/some.file/objects", "is under {rt}/some.file, which is a file"),
    ],
)
def test_an_artifact_store_on_the_ledger_or_a_file_is_refused(
    tmp_path: Path, store: str, words: str
) -> None:
    """Before, an artifact_store naming the ledger file passed dry-run."""
    (tmp_path / "ledger.sqlite3").write_bytes(b"SQLite format 3\x00")
    (tmp_path / "some.file").write_text("x")
    url = store.format(rt=tmp_path)
    reasons, _ = pipeline.preflight(parse_config(with_value("artifact_store", url), tmp_path))
    (line,) = [reason for reason in reasons if reason.startswith("artifact_store:")]
    assert words.format(rt=tmp_path) in line, line


def test_an_artifact_store_that_is_or_will_be_a_directory_passes(tmp_path: Path) -> None:
    for url in (f"file://{tmp_path}", f"file://{tmp_path}/new/objects"):
        reasons, _ = pipeline.preflight(parse_config(with_value("artifact_store", url), tmp_path))
        assert not [reason for reason in reasons if reason.startswith("artifact_store")]


# The property: whatever the value, dry-run validates it or names the field.

HUGE_INTS = st.one_of(
    st.integers(min_value=2**31, max_value=2**300),
    st.integers(min_value=-(2**300), max_value=-(2**31) - 1),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 2**64, 10**400]),
)
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    HUGE_INTS,
    st.sampled_from(
        [math.nan, math.inf, -math.inf, -1, 0, 1e308, 2**31 - 1, 2**63 - 1, 2**43, -0.0]
    ),
)
HOSTILE_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.sampled_from(
        ["\x00", "a\x00b", "\ud800", "x\udcff", "", "/", "..", "/dev/zero", "{", "}", "{item}"]
    ),
    st.sampled_from(["$(id)", "\n", "x" * 5000, "file:///dev/zero", "s3://", "\u202e"]),
)
WRONG_TYPES = st.one_of(
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
HUGE_LITERAL = "1" * 5000
"""An integer past Python's 4300-digit limit: written into the JSON text directly."""


@st.composite
def hostile_configs(draw: st.DrawFn) -> tuple[str, str, str]:
    """(config JSON text, the field changed, where its error is named). A number field
    given text or a boolean must be refused (``hostile_configs_strict``)."""
    kind = draw(st.sampled_from(["int", "float", "text", "item"]))
    if kind == "int":
        path = draw(st.sampled_from(INT_FIELDS))
        value = draw(st.one_of(NUMBERS, WRONG_TYPES, HOSTILE_TEXT))
    elif kind == "float":
        path = draw(st.sampled_from(FLOAT_FIELDS))
        value = draw(st.one_of(NUMBERS, WRONG_TYPES, HOSTILE_TEXT))
    elif kind == "text":
        path = draw(st.sampled_from(TEXT_FIELDS))
        value = draw(st.one_of(HOSTILE_TEXT, WRONG_TYPES, NUMBERS))
    else:
        path = draw(st.sampled_from(ITEM_FIELDS))
        value = draw(st.one_of(HOSTILE_TEXT, NUMBERS, WRONG_TYPES, st.just(HUGE_LITERAL)))
    if value == HUGE_LITERAL:
        # Python's JSON parser refuses it, before any field is known: named as the file.
        text = json.dumps(with_value(path, "@@HUGE@@")).replace('"@@HUGE@@"', HUGE_LITERAL)
        return text, path, "CONFIG"
    return json.dumps(with_value(path, value)), path, "items.0" if kind == "item" else path


NOT_NUMBERS = st.one_of(
    st.booleans(),
    st.text(max_size=8),
    st.integers(min_value=-5, max_value=10**6).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["60", "1e3", "true", " 5", "0x10", "inf"]),
)
"""What a number field must never take: booleans, and text, numeric-looking or not."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(INT_FIELDS + FLOAT_FIELDS), NOT_NUMBERS)
def test_a_number_field_refuses_text_and_booleans_in_one_line_naming_it(
    path: str, value: Any
) -> None:
    """``cost_usd = true`` was a budget of 1, ``calls = "60"`` a limit of 60: now each is
    refused, one line naming the field and saying what it is."""
    with tempfile.TemporaryDirectory() as directory:
        with pytest.raises(ConfigError) as caught:
            parse_config(with_value(path, value), Path(directory))
    lines = caught.value.problems
    assert named(lines, path), (path, value, lines)
    [line] = [line for line in lines if line.startswith(path + ":")]
    words = "is a boolean" if isinstance(value, bool) else "is text"
    assert words in line and "\n" not in line, line


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_configs())
def test_dry_run_validates_or_names_the_field_never_a_traceback(
    case: tuple[str, str, str],
) -> None:
    text, path, where = case
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "p.json"
        config.write_text(text)
        result = CliRunner().invoke(app, ["dry-run", str(config)])
        loaded = None if result.exit_code == 2 else load_config(config)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        path,
        repr(result.exception),
    )
    assert result.exit_code in (0, 1, 2), (path, result.output)
    if result.exit_code == 2:
        lines = result.stderr.splitlines()
        assert lines and all(line.startswith("laneway: ") for line in lines), lines
        problems = [line.removeprefix("laneway: ") for line in lines]
        # Template problems name the stage (``stages.s: bad template ...``).
        stage = where.startswith("stages.0.") and named(problems, "stages.s")
        assert named(problems, where) or stage, (path, problems)
        return
    # It loaded: every value it holds is one a run can store and pass on.
    assert loaded is not None
    frozen = loaded.canonical_json()
    assert limits.value_problem(json.loads(frozen, parse_constant=_no_constant)) is None
    assert config_from_frozen(frozen).canonical_json() == frozen
    for stage in loaded.stages:
        assert int(stage.log_cap_mib * 1024 * 1024) <= limits.JSON_INT_MAX


def _no_constant(name: str) -> Any:
    raise AssertionError(f"a loaded config holds {name}")
