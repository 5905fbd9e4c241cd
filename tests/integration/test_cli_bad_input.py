"""Bad input to the command line: numbers out of range, files that are not files, a
query starting with "--", an argv no process can take. Each is a one-line refusal (or a
recorded outcome), never a traceback or a hang, and a refused command changes nothing
already recorded."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import inspect, text
from typer.testing import CliRunner, Result

from laneway.cli.main import app
from laneway.controller import db, ledger_open, limits
from tests.support import claim_on_n1, launch_supervisor, make_config
from tests.unit.test_config_hostile import hostile_configs

runner = CliRunner()

GOOD = f"""
name = "bad-input"
[[nodes]]
name = "n1"
memory_floor_mib = 0
max_jobs = 2
[[lanes]]
name = "a"
node = "n1"
[[stages]]
name = "only"
argv = ["{sys.executable}", "-c", "pass"]
timeout_seconds = 30
[[items]]
key = "x1"
lane = "a"
"""


def call(*args: str) -> Result:
    """The CLI in this process; a traceback would be ``result.exception``."""
    before = os.environ.get("LANEWAY_DATABASE_URL")
    try:
        result = runner.invoke(app, list(args))
    finally:
        if before is None:
            os.environ.pop("LANEWAY_DATABASE_URL", None)
        else:
            os.environ["LANEWAY_DATABASE_URL"] = before
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def one_line(result: Result, code: int) -> str:
    assert result.exit_code == code, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("laneway: ")
    return line


@pytest.fixture
def started(tmp_path: Path, ledger_backend: str) -> Path:
    """A runtime dir holding one run of GOOD."""
    config = tmp_path / "good.toml"
    config.write_text(GOOD)
    runtime = tmp_path / "rt"
    result = call("start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller")
    assert result.exit_code == 0, result.output
    return runtime


# Numbers on the command line.


@pytest.mark.no_ledger
@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["worker", "--node", "n1", "--slots", str(10**20)], "--slots"),
        (["worker", "--node", "n1", "--lease-seconds", "nan"], "--lease-seconds"),
        (["worker", "--node", "n1", "--lease-seconds", "inf"], "--lease-seconds"),
        (["controller", "--interval", "-1"], "--interval"),
        (["controller", "--interval", "nan"], "--interval"),
        (["controller", "--interval", "inf"], "--interval"),
        (["controller", "--lost-after", "inf"], "--lost-after"),
        (["controller", "--lost-after", "nan"], "--lost-after"),
        (["sql", "--timeout", "inf", "SELECT 1"], "--timeout"),
        (["sql", "--timeout", "nan", "SELECT 1"], "--timeout"),
    ],
)
def test_number_options_refuse_what_the_service_cannot_use(
    tmp_path: Path, args: list[str], option: str
) -> None:
    """Before, each reached the service (an overflow storing the slots, a negative wait,
    a lease that never expires) instead of a usage error naming the option."""
    result = call(*args, "--runtime-dir", str(tmp_path / "none"))
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.stderr


# reconcile --result FILE.


@pytest.mark.no_ledger
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("/dev/zero", "cannot read /dev/zero: not a regular file (a character device)"),
        ("fifo", "not a regular file (a FIFO)"),
        ('{"a": NaN}', "is not JSON (NaN is not a number JSON allows)"),
        ('{"a": Infinity}', "is not JSON (Infinity is not a number JSON allows)"),
        ('{"a": "x\\u0000"}', "the value at ['a'] holds a NUL character"),
        ('{"a": ["\\ud800"]}', "the value at ['a'][0] holds a lone surrogate"),
        ('{"a": ' + str(2**64) + "}", "does not fit the ledger"),
        ('{"a": ' + "1" * 5000 + "}", "is not JSON (Exceeds the limit"),
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
        ("[1]", "must hold a JSON object"),
        (b"\xff\xfe", "is not JSON ("),
    ],
)
def test_reconcile_result_is_a_bounded_read_of_a_json_object(
    tmp_path: Path, content: str | bytes, words: str
) -> None:
    """`reconcile --result /dev/zero` raised MemoryError; a FIFO hung."""
    if content == "/dev/zero":
        path = Path("/dev/zero")
    elif content == "fifo":
        path = tmp_path / "result.fifo"
        os.mkfifo(path)
    else:
        path = tmp_path / "result.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = call(
        "reconcile", "1", "--as", "failed", "--reason", "r", "--result", str(path),
        "--runtime-dir", str(tmp_path / "rt"),
    )  # fmt: skip
    line = one_line(result, 2)
    assert line.startswith("laneway: --result: ") and words in line, line


@pytest.mark.no_ledger
def test_a_result_past_its_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"pad": "x" * 2000}))
    monkeypatch.setattr(limits, "RESULT_MAX_BYTES", 1000)
    result = call(
        "reconcile", "1", "--as", "failed", "--reason", "r", "--result", str(path),
        "--runtime-dir", str(tmp_path / "rt"),
    )  # fmt: skip
    assert "larger than 1000 bytes" in one_line(result, 2)


# laneway sql with a leading comment.


def test_a_query_starting_with_a_comment_is_a_query_not_an_option(started: Path) -> None:
    """`laneway sql $'-- c\\nSELECT 1'` was refused as an unknown option."""
    query = "-- how many jobs\nSELECT COUNT(*) AS n FROM jobs"
    for args in (
        ["sql", query, "--runtime-dir", str(started), "--json"],
        ["sql", "--runtime-dir", str(started), "--json", "--", query],
    ):
        result = call(*args)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == [{"n": 1}]


# A NUL that reaches the supervisor anyway is a recorded spawn error.


@pytest.mark.no_ledger
def test_a_nul_in_argv_is_a_recorded_spawn_error_not_a_dead_supervisor(tmp_path: Path) -> None:
    """Before, Popen's ValueError killed the supervisor: no exit record, and the
    attempt went unknown."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    proc, report = launch_supervisor(tmp_path, ["echo", "a\x00b"], grace=1)
    assert proc.wait(timeout=30) == 0
    record = json.loads((attempt / "exit.json").read_text())
    assert "embedded null byte" in record["spawn_error"] and "error" in report
    assert record["exit_code"] is None


# The largest values a config accepts are values a run stores and claims.


def test_the_largest_values_a_config_accepts_are_stored_and_claimed(
    factory: Any, clock: Any, register_worker: Any, runtime: Path
) -> None:
    """Before, an integer of 2**63 in max_jobs, memory_floor_mib or gpu.total_mib
    passed dry-run and overflowed the ledger (controller/ledger/runs.py; on PostgreSQL
    anything past 2**31-1 did, its INTEGER columns are 4 bytes), and log_cap_mib = inf
    passed and overflowed the claim."""
    big = limits.LEDGER_INT_MAX
    config = make_config(
        [
            {
                "name": "only",
                "argv": ["true"],
                "log_cap_mib": limits.MAX_MIB - 1,
                "capture": {"max_mib": limits.MAX_MIB - 1},
                "cap": big,
                "exit_codes": {
                    "0": "succeeded",
                    str(big): "failed",
                    str(limits.LEDGER_INT_MIN): "failed",
                },
            }
        ],
        items=[
            {"key": "i1", "lane": "a", "n": limits.JSON_INT_MAX, "m": limits.JSON_INT_MIN},
            {"key": "i2", "lane": "b"},
        ],
        max_jobs=limits.MAX_SLOTS,
        lanes=[{"name": "a", "node": "n1", "caps": {"only": big}}, {"name": "b", "node": "n2"}],
        nodes=[
            {"name": "n1", "memory_floor_mib": 0, "max_jobs": limits.MAX_SLOTS},
            {
                "name": "n2",
                "memory_floor_mib": big,
                "max_jobs": 1,
                "gpu": {"total_mib": big, "baseline_mib": big},
            },
        ],
        batch_cap=big,
        infra_breaker=big,
    )
    from laneway.controller import ledger

    with db.transaction(factory) as session:
        run = ledger.create_run(
            session, config, runtime_dir=str(runtime), source_hashes={}, actor="t",
            now=clock.now(),
        )  # fmt: skip
        run_id = run.id
    worker = register_worker()
    (claimed,) = claim_on_n1(factory, worker, clock, slots=limits.MAX_SLOTS)
    assert claimed.run_id == run_id
    assert claimed.log_cap_bytes == (limits.MAX_MIB - 1) << 20 <= limits.JSON_INT_MAX


# A refused start-pipeline or run changes nothing already recorded.


def recorded(runtime: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every file under the runtime dir (SQLite's -shm and -wal, which a reader's
    open and close may create and remove, aside) with its sha256, and every ledger
    row of every table."""
    files = {
        str(path.relative_to(runtime)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(runtime.rglob("*"))
        if path.is_file() and not path.name.endswith(("-shm", "-wal"))
    }
    engine = db.make_engine(ledger_open.existing_ledger_url(runtime), readonly=True)
    try:
        with engine.connect() as connection:
            rows = {
                table: sorted(
                    repr(tuple(row)) for row in connection.execute(text(f'SELECT * FROM "{table}"'))
                )
                for table in sorted(inspect(connection).get_table_names())
            }
    finally:
        engine.dispose()
    return files, rows


def refused_configs(tmp_path: Path) -> dict[str, tuple[str, int]]:
    """Config text and the exit code of its refusal."""
    source = GOOD.replace('name = "bad-input"', 'name = "bad-input"\nsources = ["/dev/zero"]')
    long_argv = GOOD.replace('"-c", "pass"', f'"-c", "pass", "{"x" * (130 * 1024)}"')
    return {
        "inf.toml": (GOOD.replace("timeout_seconds = 30", "log_cap_mib = inf"), 2),
        "huge.toml": (GOOD.replace("max_jobs = 2", f"max_jobs = {2**63}"), 2),
        "floor.toml": (GOOD.replace("memory_floor_mib = 0", f"memory_floor_mib = {2**31}"), 2),
        "nul.json": (json.dumps({"name": "x\x00"}), 2),
        "source.toml": (source, 1),
        "argv.toml": (long_argv, 1),
        "again.toml": (GOOD, 1),  # the same pipeline has an unfinished run: refused
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["start-pipeline", "run"])
def test_a_refused_start_changes_nothing_already_recorded(
    started: Path, tmp_path: Path, command: str
) -> None:
    before = recorded(started)
    for name, (content, code) in refused_configs(tmp_path).items():
        config = tmp_path / name
        config.write_text(content)
        args = [command, str(config), "--runtime-dir", str(started)]
        result = call(*args, *(["--no-controller"] if command == "start-pipeline" else []))
        assert result.exit_code == code, (name, result.output)
        assert recorded(started) == before, name


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=hostile_configs())
def test_a_hostile_config_that_dry_run_refuses_start_pipeline_refuses_unchanged(
    started: Path, case: tuple[str, str, str]
) -> None:
    """The property over config values, against a runtime dir with a run in it: a
    config that dry-run refuses is refused by start-pipeline too, with nothing recorded
    changed. (Every example shares the runtime dir, which is what is asserted.)"""
    content, path, _ = case
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "p.json"
        config.write_text(content)
        if call("dry-run", str(config)).exit_code == 0:
            return  # a valid config: starting it would record a run, as it should
        before = recorded(started)
        result = call(
            "start-pipeline", str(config), "--runtime-dir", str(started), "--no-controller"
        )
        assert result.exit_code in (1, 2), (path, result.output)
        assert recorded(started) == before, path
