"""README.md's examples run as written (issue 21, item 4): every fenced block is read
from README.md (found by its fence, never by its line number) and checked by its kind.

- ``toml``/``json`` pipeline configs: a whole config loads and passes preflight
  (`laneway dry-run`); a fragment (a stage table, ``[notify]``, ``[[closeout]]``, …)
  does so merged into ``MINIMAL``. Every one that names scripts, and the whole one, is
  then run end to end by `laneway run CONFIG --runtime-dir RT --json` as a real process,
  with small scripts written beside it (``JOB_BODY``) that write the declared outputs,
  refuse an input that was not handed over and report the README's usage result: the
  run must finish with every job succeeded, and what the config declares (outputs,
  nodes, ports, spend, closeout steps) must be in the ledger.
- the ``json`` job result is what the budget example's job writes; its usage must reach
  the ledger.
- ``sh`` blocks run top to bottom, as in a shell: each `laneway …` line through the CLI,
  against a ledger prepared to mean what the README says of it (``STATES``: job 3 failed,
  attempt 7 running, attempt 1 unknown, …), and must exit 0 (no line says otherwise),
  some printing what ``SAYS`` expects; other lines as ``OTHER_COMMANDS`` says. A path
  outside the checkout that a line names becomes one in the test's directory
  (``ELSEWHERE``).
- every `laneway …` line of any block, the `$ laneway …` lines of output samples
  included, must parse with the real command objects (subcommand, options, arguments).
  Lines that only parse: output samples (they show one moment of a ledger), and the
  service lines ``parse_only`` names (`worker`, `controller`, `web`, a `start-pipeline`
  that starts a detached controller, and the PostgreSQL block); `make demo`, `make test`
  and `make lint` only name Makefile targets.
- ``text`` and untyped blocks are output samples: only their command lines are checked.

A failure names the README line and quotes its block or line.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import textwrap
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import typer

from laneway.cli.main import app
from laneway.controller import db, ledger, ledger_open
from laneway.controller.clock import SystemClock
from laneway.controller.config import json_schema
from laneway.workers.gpu import FakeGpu
from laneway.workers.service import WorkerService
from tests.integration.test_cli import invoke
from tests.integration.test_cli_services import LANEWAY
from tests.support import GATE_BOUND, wait_for_file, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SQLITE_ONLY = pytest.mark.sqlite_only(
    "the README's examples use a runtime dir's SQLite ledger (`--runtime-dir rt`, "
    "`sqlite3 .demo-runtime/ledger.sqlite3`)"
)
RUN_TIMEOUT = 180
"""Seconds a `laneway run` of an example may take before the test gives up on it (a
guard against a hang, not a measurement)."""


# -- the blocks ---------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    line: int
    """The README line of its opening fence."""
    lang: str
    text: str

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'untyped'} block)"

    def quoted(self) -> str:
        return f"{self}:\n{textwrap.indent(self.text, '    ')}"


@dataclass(frozen=True)
class Command:
    line: int
    """Its README line."""
    words: tuple[str, ...]
    block: Block

    def __str__(self) -> str:
        return f"README.md:{self.line} (in the {self.block}): `{shlex.join(self.words)}`"

    @property
    def id(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.words)}"

    @property
    def is_laneway(self) -> bool:
        return Path(self.words[0]).name == "laneway"

    @property
    def key(self) -> str:
        """The command without its program, reason and runtime dir: ``retry 3``,
        ``reconcile 1 --as failed`` (how ``SAYS`` names it)."""
        kept = []
        for word in self.words[1:]:
            if word in ("--reason", "--runtime-dir"):
                break
            kept.append(word)
        return " ".join(kept)


FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")


def readme_blocks() -> list[Block]:
    """Every fenced block of README.md, indented ones (inside a list) too."""
    blocks = []
    opened: tuple[int, str, str] | None = None  # (line, indent, lang)
    body: list[str] = []
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence["indent"], fence["lang"]), []
        elif fence and not fence["lang"]:
            blocks.append(Block(opened[0], opened[2], "\n".join(body)))
            opened = None
        else:
            body.append(line.removeprefix(opened[1]))
    assert opened is None, f"README.md:{opened[0]}: a fenced block that never closes"
    return blocks


def commands(block: Block) -> list[Command]:
    """The command lines of a block: every line of an ``sh`` block (comments dropped), and
    the ``$ ...`` lines of an output sample."""
    found = []
    for offset, text in enumerate(block.text.splitlines(), start=1):
        if block.lang == "sh":
            source = text
        elif text.startswith("$ "):
            source = text[2:]
        else:
            continue
        words = shlex.split(source, comments=True)
        if words:
            found.append(Command(block.line + offset, tuple(words), block))
    return found


BLOCKS = readme_blocks()
SH_BLOCKS = [block for block in BLOCKS if block.lang == "sh"]
OUTPUT_LANGS = ("", "text")
LANEWAY_LINES = [c for block in BLOCKS for c in commands(block) if c.is_laneway]


# -- configs --------------------------------------------------------------------------

MINIMAL_NODE = {"name": "box", "memory_floor_mib": 0, "max_jobs": 2}
MINIMAL: dict[str, Any] = {
    "name": "readme-fragment",
    "nodes": [MINIMAL_NODE],
    "lanes": [{"name": "main", "node": "box"}],
    "stages": [{"name": "greet", "argv": ["echo", "hello {item}"], "timeout_seconds": 60}],
    "items": [{"key": "one", "lane": "main"}],
}
"""What a fragment is merged into: its stages replace this one stage (which is there so
that a fragment without stages, such as ``[notify]``, makes a config that runs), its
nodes replace this node by name, its other keys are set."""
WHOLE_KEYS = set(json_schema()["required"])
STAND_INS = {"s3://my-bucket/laneway": "a file:// store in the test's directory"}
"""What a run replaces in an example, and with what: a bucket no test can reach (the
block calls the store optional and any fsspec URL; the file:// one is a real store)."""
SECRET = "readme-stand-in-secret"
"""The value of every ``${NAME}`` an example references (`export API_KEY=…`)."""


def parsed(block: Block) -> Any:
    return tomllib.loads(block.text) if block.lang == "toml" else json.loads(block.text)


def is_result(body: Any) -> bool:
    """A job's result (the README's spend example), not a config."""
    return isinstance(body, dict) and {"job_id", "usage"} <= set(body)


CONFIG_BLOCKS = [
    block for block in BLOCKS if block.lang in ("toml", "json") and not is_result(parsed(block))
]
RESULT_BLOCKS = [b for b in BLOCKS if b.lang in ("toml", "json") and is_result(parsed(b))]


def readme_result() -> dict[str, Any]:
    """The README's job result (its spend example), which a stage that spends writes."""
    assert len(RESULT_BLOCKS) == 1, f"one job result expected in README.md: {RESULT_BLOCKS}"
    body: dict[str, Any] = parsed(RESULT_BLOCKS[0])
    return body


def is_whole(block: Block) -> bool:
    return WHOLE_KEYS <= set(parsed(block))


def merged(fragment: dict[str, Any]) -> dict[str, Any]:
    """``fragment`` merged into ``MINIMAL``, plus a node for each node a stage names that
    neither defines (it gets ``MINIMAL_NODE``'s resources)."""
    config = copy.deepcopy(MINIMAL)
    for key, value in fragment.items():
        if key == "nodes":
            named = {node["name"]: node for node in value}
            kept = [named.pop(node["name"], node) for node in config["nodes"]]
            config["nodes"] = kept + list(named.values())
        else:
            config[key] = copy.deepcopy(value)
    known = {node["name"] for node in config["nodes"]}
    for stage in config["stages"]:
        for name in stage.get("nodes", []):
            if name not in known:
                config["nodes"].append({**MINIMAL_NODE, "name": name})
                known.add(name)
    return config


def config_of(block: Block) -> dict[str, Any]:
    body = parsed(block)
    return copy.deepcopy(body) if is_whole(block) else merged(body)


def scripts_named(config: dict[str, Any]) -> list[tuple[dict[str, Any], str, bool]]:
    """(stage or closeout step, script, whether a closeout step) for each script an argv
    names literally."""
    steps = [(stage, False) for stage in config["stages"]]
    steps += [(step, True) for step in config.get("closeout", [])]
    return [
        (step, word, closeout)
        for step, closeout in steps
        for word in step["argv"][1:]
        if word.endswith(".py") and "{" not in word
    ]


def spends(stage: dict[str, Any]) -> bool:
    """A stage with a budget or an expected cost: its job reports the README's result."""
    return "budget" in stage or "expected_usage" in stage


def output_files(stage: dict[str, Any]) -> list[str]:
    """One file per declared output (a glob's ``*`` as ``0``)."""
    return [name.replace("*", "0") for name in stage.get("outputs", [])]


JOB_BODY = """\
import json
import os
import sys
from pathlib import Path

SPEC = json.loads(SPEC_JSON)

for argument in sys.argv[1:]:
    if os.path.isabs(argument) and not os.path.exists(argument):
        sys.exit(f"{argument} was not handed to this job")
ports = [p for p in os.environ.get("LANEWAY_PORTS", "").split(",") if p]
if len(set(ports)) != SPEC["ports"]:
    sys.exit(f"LANEWAY_PORTS={ports}, expected {SPEC['ports']} distinct ports")
for name in SPEC["outputs"]:
    path = Path(os.environ["LANEWAY_WORKSPACE"], name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"from": sys.argv[0], "args": sys.argv[1:]}))
if SPEC["result"] is not None:
    result = {**SPEC["result"], "job_id": os.environ["LANEWAY_JOB_ID"]}
    Path(os.environ["LANEWAY_RESULT_PATH"]).write_text(json.dumps(result))
if SPEC["marker"] is not None:
    Path(SPEC["marker"]).write_text(" ".join(sys.argv[1:]))
print("ran", *sys.argv)
"""
"""What every script an example names does, after the line that sets its ``SPEC_JSON``."""


def write_scripts(config: dict[str, Any], directory: Path, where: str) -> None:
    """The scripts ``config`` names, in ``directory`` (the config's, where ``cwd = "."``
    looks), each doing ``JOB_BODY`` for its stage or closeout step."""
    for step, script, closeout in scripts_named(config):
        spec = {
            "outputs": output_files(step),
            "ports": step.get("ports", 0),
            "result": readme_result() if spends(step) else None,
            "marker": str(marker_of(step, directory)) if closeout else None,
        }
        header = (
            f'"""For the README example at {where} (tests/integration/test_readme_blocks.py)."""\n'
        )
        (directory / script).write_text(f"{header}SPEC_JSON = {json.dumps(spec)!r}\n" + JOB_BODY)


def marker_of(step: dict[str, Any], directory: Path) -> Path:
    """Where a closeout step's script writes the arguments it was given."""
    return directory / f"closeout-{step['name']}.txt"


def write_config(block: Block, directory: Path, *, for_run: bool = False) -> Path:
    """``block``'s config (merged if a fragment) and its scripts, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config_of(block)
    if for_run and config.get("artifact_store") in STAND_INS:
        config["artifact_store"] = (directory / "store").as_uri()
    write_scripts(config, directory, str(block))
    path = directory / "pipeline.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def set_references(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``${NAME}`` the block references, set (as `export API_KEY=…` does)."""
    for name in re.findall(r"\$\{(\w+)\}", block.text):
        monkeypatch.setenv(name, SECRET)


def query(runtime: Path, sql: str) -> list[tuple[Any, ...]]:
    """``sql`` on the runtime dir's ledger, read-only."""
    with sqlite3.connect(f"file:{runtime / db.LEDGER_FILENAME}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


# -- the ledgers the command lines act on ---------------------------------------------

OPS = """\
# The run the README's operator examples act on: lane main on node box; job 3 (item2.solve)
# and item7.solve failed, item4.solve an infra_failure; twelve attempts (`logs 12`); solve's
# answers stored as artifacts; the run still active, paused because judge's budget admits
# none of its jobs, so `pause`, `stop` and `resume` act on it.
name = "ops"

[[nodes]]
name = "box"
memory_floor_mib = 0
max_jobs = 4

[[lanes]]
name = "main"
node = "box"

[[stages]]
name = "solve"
argv = ["python3", "solve.py", "{item}"]
cwd = "."
outputs = ["answer.json"]
exit_codes = { 0 = "succeeded", 75 = "infra_failure" }

[[stages]]
name = "judge"
argv = ["true"]
needs = ["solve"]
budget = { cost_usd = 0.5 }
expected_usage = { cost_usd = 1 }
""" + "".join(f'\n[[items]]\nkey = "item{i}"\nlane = "main"\n' for i in range(1, 13))
OPS_SOLVE = """\
import json, os, sys
item = sys.argv[1]
if item in ("item2", "item7"):
    sys.exit("wrong answer")
if item == "item4":
    sys.exit(75)  # the provider's outage: infra_failure
with open(os.path.join(os.environ["LANEWAY_WORKSPACE"], "answer.json"), "w") as answer:
    json.dump({"item": item}, answer)
print("solved", item)
"""
RUNNING = (
    """\
# Seven attempts that run until the test lets them go (`cancel 7`, `cancel --run 1`).
name = "running"

[[nodes]]
name = "box"
memory_floor_mib = 0
max_jobs = 7

[[lanes]]
name = "main"
node = "box"

[[stages]]
name = "work"
argv = ["python3", "wait.py", "{release}"]
cwd = "."
timeout_seconds = GATE_BOUND
grace_seconds = 1
""".replace("GATE_BOUND", str(GATE_BOUND))
    + "".join(
        f'\n[[items]]\nkey = "item{i}"\nlane = "main"\nrelease = "RELEASE"\n' for i in range(1, 8)
    )
)
WAIT = wait_for_file("sys.argv[1]")
STATES = {
    "demo": "a copy of the demo's runtime dir after its run (`make demo`), as `.demo-runtime`",
    "ops": "a copy of a run of OPS, as `rt`",
    "config": "the README's whole config as `pipeline.toml`; no ledger yet",
    "unfinished": "`pipeline.toml` started (`start-pipeline --no-controller`): run 1 unfinished",
    "unknown": "`pipeline.toml` started, its first attempt (1) claimed and made unknown",
    "running": "RUNNING started, its seven attempts running under a worker in this process",
}
SHARED = {"demo", "ops"}
"""States one block's lines share, in order (an operator's session); the others are
made afresh for each line (each of the README's alternatives runs on its own)."""


def state_of(command: Command) -> str | None:
    """Which of ``STATES`` a line acts on (None: a line that is not `laneway` and names
    no runtime dir)."""
    if any(word.split("/")[0] == ".demo-runtime" for word in command.words):
        return "demo"
    if not command.is_laneway:
        return None
    subcommand = command.words[1]
    if subcommand == "reconcile":
        return "unknown"
    if subcommand == "cancel":
        return "running"
    if subcommand == "run" and "--continue" in command.words:
        return "unfinished"
    if subcommand in ("dry-run", "plan", "run"):
        return "config"
    return "ops"


def on_postgres(block: Block) -> bool:
    """A block for a PostgreSQL ledger (it exports a postgresql:// LANEWAY_DATABASE_URL):
    its lines only parse, its export is not checked."""
    return re.search(r"^export LANEWAY_DATABASE_URL=postgres", block.text, re.M) is not None


def parse_only(command: Command) -> str | None:
    """Why a `laneway` line is only parsed, not run; None: it runs."""
    if command.block.lang != "sh":
        return "an output sample: it shows one moment of some ledger"
    if on_postgres(command.block):
        return "its block sets up a PostgreSQL ledger"
    subcommand = command.words[1]
    if subcommand in ("worker", "controller", "web"):
        return "a long-running service"
    if subcommand == "start-pipeline" and "--no-controller" not in command.words:
        return "starts a detached `laneway controller`"
    return None


def the_whole_config() -> Block:
    """The README's one whole config ("A minimal one"), which `pipeline.toml` stands for."""
    whole = [block for block in CONFIG_BLOCKS if is_whole(block)]
    assert len(whole) == 1, f"one whole config expected in README.md: {whole}"
    return whole[0]


def write_hello(directory: Path) -> Path:
    """The README's whole config as ``directory/pipeline.toml``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pipeline.toml"
    path.write_text(the_whole_config().text)
    return path


def sqlite_env(**extra: str) -> dict[str, str]:
    """This environment for a real `laneway` process, its ledger the runtime dir's file."""
    env = {**os.environ, **extra}
    for name in ("LANEWAY_DATABASE_URL", "LANEWAY_READONLY_DATABASE_URL"):
        env.pop(name, None)
    return env


def run_example(config: Path, runtime: Path, *, expect: int = 0) -> dict[str, Any]:
    """`laneway run CONFIG --runtime-dir RUNTIME --json`, a real process; its final status."""
    done = subprocess.run(
        [*LANEWAY, "run", str(config), "--runtime-dir", str(runtime), "--json"],
        env=sqlite_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=config.parent,
    )
    assert done.returncode == expect, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    final: dict[str, Any] = json.loads(done.stdout)
    return final


@pytest.fixture(scope="module")
def demo_runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo pipeline's runtime dir after `laneway run` (what `make demo` leaves in
    .demo-runtime/); it ends at its budget with exit 3, as the README says."""
    runtime = tmp_path_factory.mktemp("demo") / "rt"
    env = sqlite_env(DEMO_API_KEY=SECRET, DEMO_PAID_CALLS=str(runtime.parent / "paid.jsonl"))
    command = [*LANEWAY, "run", str(ROOT / "configs/demo/pipeline.toml")]
    done = subprocess.run(
        [*command, "--runtime-dir", str(runtime), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    return runtime


@pytest.fixture(scope="module")
def ops_runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of ``OPS``: `laneway run` ends it blocked at judge's budget (exit 3)."""
    directory = tmp_path_factory.mktemp("ops")
    (directory / "ops.toml").write_text(OPS)
    (directory / "solve.py").write_text(OPS_SOLVE)
    runtime = directory / "rt"
    final = run_example(directory / "ops.toml", runtime, expect=3)
    assert final["jobs"]["solve"] == {"succeeded": 9, "failed": 3}, final["jobs"]
    assert query(runtime, "SELECT stage, state, outcome FROM v_job_current WHERE job_id = 3") == [
        ("solve", "failed", "failed")
    ]
    return runtime


def start_hello(directory: Path) -> Path:
    """`start-pipeline --no-controller` of the README's whole config; its runtime dir."""
    config = write_hello(directory)
    runtime = directory / "rt"
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    return runtime


def make_first_attempt_unknown(runtime: Path) -> None:
    """Claim the first job and mark its attempt unknown: a worker that died before it
    started anything (the README: "there may be no directory at all")."""
    engine = ledger_open.open_ledger(runtime)
    try:
        now = SystemClock().now()
        with db.transaction(db.session_factory(engine)) as session:
            worker = ledger.register_worker(
                session,
                node="box",
                host="readme",
                pid=os.getpid(),
                boot_id="readme-test",
                process_start_time=None,
                slots=1,
                now=now,
            )
            (claim,) = ledger.claim_jobs(
                session, worker_id=worker, node="box", free_slots=1, mem_available_mib=64e3, now=now
            )
            ledger.mark_unknown(
                session,
                claim.attempt_id,
                reason="the worker died before it started anything (test stand-in)",
                actor="controller",
                now=now,
            )
        assert claim.attempt_id == 1
    finally:
        engine.dispose()


@contextmanager
def running_attempts(directory: Path) -> Iterator[Path]:
    """``RUNNING`` started, with a worker in this process running its seven attempts;
    afterwards every attempt is let go and settled, and the worker stopped."""
    directory.mkdir(parents=True, exist_ok=True)
    release = directory / "release"
    config = directory / "running.toml"
    config.write_text(RUNNING.replace("RELEASE", str(release)))
    (directory / "wait.py").write_text(WAIT)
    runtime = directory / "rt"
    started = invoke(
        "start-pipeline", str(config), "--runtime-dir", str(runtime), "--no-controller"
    )
    assert started.exit_code == 0, started.output
    engine = ledger_open.open_ledger(runtime)
    service = WorkerService(
        engine, node="box", slots=7, memory_probe=lambda: (64e3, 128e3), gpu=FakeGpu()
    )
    service.start()
    try:

        def all_running() -> bool:
            service.tick()
            states = query(runtime, "SELECT state FROM attempts")
            return len(states) == 7 and {state for (state,) in states} == {"running"}

        wait_until(all_running)
        yield runtime
    finally:
        release.touch()

        def settled() -> bool:
            service.tick()
            return not service.in_flight

        wait_until(settled)
        service.stop()
        engine.dispose()


@contextmanager
def entered(
    state: str, directory: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Path]]:
    """``state`` made in ``directory``; yields what the README's names stand for there."""
    if state == "demo":
        runtime = directory / "demo-runtime"
        shutil.copytree(request.getfixturevalue("demo_runtime"), runtime)
        yield {".demo-runtime": runtime}
    elif state == "ops":
        shutil.copytree(request.getfixturevalue("ops_runtime"), directory / "rt")
        yield {"rt": directory / "rt"}
    elif state == "config":
        yield {"pipeline.toml": write_hello(directory), "rt": directory / "rt"}
    elif state in ("unfinished", "unknown"):
        runtime = start_hello(directory)
        if state == "unknown":
            make_first_attempt_unknown(runtime)
        yield {"pipeline.toml": directory / "pipeline.toml", "rt": runtime}
    elif state == "running":
        with running_attempts(directory) as runtime:
            yield {"rt": runtime}
    else:
        raise AssertionError(f"no state {state!r}; STATES has {sorted(STATES)}")


ELSEWHERE = {"/tmp/run1.html": "run1.html"}
"""The files outside the checkout that README lines name, and what each is instead: a
file of that name in the test's directory."""


def substituted(words: tuple[str, ...], places: dict[str, Path]) -> list[str]:
    """``words`` with each README name of ``places`` (or a path under it) replaced."""
    out = []
    for word in words:
        head, _, rest = word.partition("/")
        if word in places:
            out.append(str(places[word]))
        elif head in places and rest:
            out.append(str(places[head] / rest))
        else:
            out.append(word)
    return out


SAYS = {
    "dry-run pipeline.toml": "preflight: ok",
    "run pipeline.toml": "— finished",
    "run --continue 1": "— finished",
    "status": "run 1 (",
    "explain 3": "job 3 (item2.solve, lane main, run 1): failed",
    "logs 12 --follow": "solved item",
    "artifacts 1": "answer.json",
    "pause 1": "pause set on run 1",
    "pause 1 --lane main": "pause set on run 1 lane main",
    "stop 1": "stop set on run 1",
    "resume 1": "cleared 4 control(s) on run 1",  # the budget's pause and the three above
    "halt --all": "halt set on every run",
    "clear-halt --all": "cleared 1 control(s) on every run",
    "retry 3": "job 3 is ready for a new attempt",
    "retry item7.solve --run 1": "job 13 is ready for a new attempt",
    "retry --run 1 --stage solve --outcome infra_failure": "ready for a new attempt: 7",
    "cancel 7": "TERM sent to 1 supervisor(s)",
    "cancel --run 1": "TERM sent to 7 supervisor(s)",
    "reconcile 1 --as succeeded": "reconciled as succeeded; job is now succeeded",
    "reconcile 1 --as failed": "reconciled as failed; job is now failed",
    "reconcile 1 --as not-run": "reconciled as not-run; job is now ready",
}
"""What a line must print, by its ``Command.key``; a line without an entry is checked
by its exit code (and files it writes) only."""


def check_laneway(command: Command, places: dict[str, Path]) -> None:
    args = substituted(command.words[1:], places)
    result = invoke(*args)
    assert result.exit_code == 0, (
        f"{command}: exit {result.exit_code}, the README expects 0\n"
        f"ran: laneway {shlex.join(args)}\n{result.output}"
    )
    said = SAYS.get(command.key)
    assert said is None or said in result.output, (
        f"{command}: expected {said!r} in its output\n{result.output}"
    )
    if "--html" in command.words:
        written = Path(args[args.index("--html") + 1])
        assert written.read_text().startswith("<!"), f"{command}: no HTML at {written}"


def check_make(command: Command, places: dict[str, Path]) -> None:
    """`make TARGET ...`: each target is one the Makefile defines."""
    makefile = (ROOT / "Makefile").read_text()
    for target in command.words[1:]:
        if "=" not in target:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), (
                f"{command}: the Makefile has no target {target!r}"
            )


def check_export(command: Command, places: dict[str, Path]) -> None:
    """`export NAME=…`: NAME is a ``${NAME}`` a README config references."""
    name = command.words[1].partition("=")[0]
    referenced = {n for block in CONFIG_BLOCKS for n in re.findall(r"\$\{(\w+)\}", block.text)}
    assert name in referenced, f"{command}: no README config references ${{{name}}}"


def check_sqlite3(command: Command, places: dict[str, Path]) -> None:
    """`sqlite3 LEDGER QUERY`: the query runs (with Python's sqlite3, read-only) and
    returns rows."""
    ledger_file, sql = substituted(command.words[1:], places)
    with sqlite3.connect(f"file:{ledger_file}?mode=ro", uri=True) as conn:
        rows = conn.execute(sql).fetchall()
    assert rows, f"{command}: no rows"


def check_ls(command: Command, places: dict[str, Path]) -> None:
    (directory,) = substituted(command.words[1:], places)
    assert Path(directory).is_dir() and any(Path(directory).iterdir()), (
        f"{command}: {directory} is not a directory with files in it"
    )


def check_cat(command: Command, places: dict[str, Path]) -> None:
    (file,) = substituted(command.words[1:], places)
    assert Path(file).is_file() and Path(file).read_text(), f"{command}: {file} is not there"


OTHER_COMMANDS: dict[str, Callable[[Command, dict[str, Path]], None]] = {
    "make": check_make,
    "export": check_export,
    "sqlite3": check_sqlite3,
    "ls": check_ls,
    "cat": check_cat,
}
"""How the lines that are not `laneway` are checked. `make demo`/`make test` build a venv
and run the demo or the suite: only their targets are checked."""


def parse_only_line(command: Command) -> bool:
    return command.is_laneway and parse_only(command) is not None


def runnable(block: Block) -> bool:
    return not on_postgres(block) and not all(parse_only_line(c) for c in commands(block))


# -- the tests ------------------------------------------------------------------------


@pytest.mark.no_ledger
def test_every_block_is_of_a_kind_this_test_checks():
    kinds = {"sh": SH_BLOCKS, "config": CONFIG_BLOCKS, "result": RESULT_BLOCKS}
    for block in BLOCKS:
        known = block.lang in OUTPUT_LANGS or any(block in found for found in kinds.values())
        assert known, f"no check for this kind of block; teach this test\n{block.quoted()}"
    for block in SH_BLOCKS:
        for command in commands(block):
            assert command.is_laneway or command.words[0] in OTHER_COMMANDS, (
                f"{command}: a command this test does not know; add it to OTHER_COMMANDS"
            )
    # The README's one whole config, and a stage that reports the README's result.
    assert the_whole_config().lang == "toml"
    assert any(spends(stage) for b in CONFIG_BLOCKS for stage in config_of(b)["stages"])
    assert all(commands(block) for block in SH_BLOCKS), "an sh block with no command"
    run = [c for b in SH_BLOCKS if runnable(b) for c in commands(b) if not parse_only_line(c)]
    for command in run:
        outside = [w for w in command.words if w.startswith("/") and w not in ELSEWHERE]
        assert not outside, f"{command}: names {outside}; give it a place in ELSEWHERE"
    unused = set(SAYS) - {command.key for command in run if command.is_laneway}
    assert not unused, f"SAYS names lines the README no longer has: {sorted(unused)}"


@pytest.mark.no_ledger
@pytest.mark.parametrize("block", CONFIG_BLOCKS, ids=str)
def test_each_config_loads_and_passes_preflight(block, tmp_path, monkeypatch):
    """`laneway dry-run` of the config (a fragment merged into MINIMAL), with its
    scripts in place and its ``${NAME}`` references set."""
    set_references(block, monkeypatch)
    config = write_config(block, tmp_path)
    result = invoke("dry-run", str(config), "--json")
    assert result.exit_code == 0, f"{block.quoted()}\n{result.output}"
    assert json.loads(result.stdout)["preflight"] == {"ok": True, "reasons": []}


RUN_BLOCKS = [b for b in CONFIG_BLOCKS if is_whole(b) or scripts_named(config_of(b))]


@SQLITE_ONLY
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=str)
def test_each_config_with_scripts_runs_end_to_end(block, tmp_path, monkeypatch):
    """`laneway run` of the config with its scripts written (``JOB_BODY``): the run
    finishes, every job succeeded, and the ledger holds what the config declares. An
    example that reserves more memory than this machine has free is skipped, saying so."""
    config = config_of(block)
    needed = sum(stage.get("memory_mib", 0) for stage in config["stages"]) + max(
        node["memory_floor_mib"] for node in config["nodes"]
    )
    if psutil.virtual_memory().available / 2**20 < needed + 512:
        pytest.skip(f"{block} reserves {needed} MiB; this machine has less free")
    set_references(block, monkeypatch)
    path = write_config(block, tmp_path, for_run=True)
    runtime = tmp_path / "rt"
    final = run_example(path, runtime)
    jobs = len(config["items"]) * len(config["stages"])
    assert final["run"]["state"] == "finished", block.quoted()
    assert final["totals"] == {"succeeded": jobs}, f"{block.quoted()}\n{outcomes(runtime)}"
    check_what_it_declares(config, runtime, tmp_path, final, block)


def outcomes(runtime: Path) -> str:
    """Each attempt's job, outcome and why, and the end of its stderr.log: what a failed
    example did."""
    rows = query(
        runtime,
        "SELECT j.item, j.stage, a.outcome, a.state_reason, a.attempt_dir FROM attempts a "
        "JOIN v_job_current j ON j.job_id = a.job_id ORDER BY a.id",
    )
    lines = []
    for item, stage, outcome, reason, attempt_dir in rows:
        stderr = Path(attempt_dir, "stderr.log")
        tail = stderr.read_text()[-500:] if stderr.is_file() else ""
        lines.append(f"{item}.{stage}: {outcome} ({reason}) {tail}")
    return "\n".join(lines)


def check_what_it_declares(
    config: dict[str, Any], runtime: Path, directory: Path, final: dict[str, Any], block: Block
) -> None:
    """The ledger holds what the example's config declares: each output stored, each
    hand-off read, each stage on its nodes, its ports and its spend; each closeout step
    ran with ``{run}`` and ``{runtime_dir}`` filled in."""
    stored = set(query(runtime, "SELECT stage, name FROM v_artifacts"))
    read = set(query(runtime, "SELECT stage, input_stage, input_name FROM v_lineage"))
    for stage in config["stages"]:
        name = stage["name"]
        where = f"{block}, stage {name}"
        for output in output_files(stage):
            assert (name, output) in stored, f"{where}: {output} not stored ({stored})"
        for need in stage.get("needs", []):
            needed = [stage_ for stage_ in config["stages"] if stage_["name"] == need]
            for output in output_files(needed[0]):
                assert (name, need, output) in read, f"{where}: did not read {need}/{output}"
        attempts = query(
            runtime,
            "SELECT a.node, a.ports, a.id FROM attempts a JOIN jobs j ON j.id = a.job_id "
            f"WHERE j.stage = '{name}'",
        )
        assert attempts, f"{where}: no attempt"
        for node, ports, attempt_id in attempts:
            if "nodes" in stage:
                assert node in stage["nodes"], f"{where}: ran on {node}"
            assert len(json.loads(ports or "null") or []) == stage.get("ports", 0), (
                f"{where}: {ports}"
            )
            if spends(stage):
                usage = dict(
                    query(
                        runtime,
                        f"SELECT key, value FROM attempt_usage WHERE attempt_id = {attempt_id}",
                    )
                )
                assert usage == readme_result()["usage"], f"{where}: usage {usage}"
    steps = config.get("closeout", [])
    closeout = final["closeout"]
    logs = sorted(runtime.glob("runs/*/closeout/*.log"))
    said = "\n".join(f"{log.name}: {log.read_text()[-500:]}" for log in logs)
    assert closeout["failed_steps"] == [], f"{block.quoted()}\n{closeout}\n{said}"
    assert len(closeout["steps"]) == len(steps), closeout
    for step in steps:
        marker = marker_of(step, directory)
        assert marker.is_file(), f"{block}: closeout step {step['name']} did not run\n{closeout}"
        assert marker.read_text() == f"{final['run']['id']} {runtime}", marker.read_text()


@pytest.mark.no_ledger
def test_the_whole_config_needs_its_secret_set_as_the_readme_says(tmp_path, monkeypatch):
    """ "Without `API_KEY` set, the preflight says so and the command exits 1"."""
    monkeypatch.delenv("API_KEY", raising=False)
    result = invoke("dry-run", str(write_hello(tmp_path)))
    assert result.exit_code == 1, result.output
    assert "${API_KEY} is not set" in result.output


@pytest.mark.no_ledger
@pytest.mark.parametrize("command", LANEWAY_LINES, ids=lambda command: command.id)
def test_each_laneway_line_parses(command):
    """The subcommand exists and takes every option and argument as written."""
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    subcommand = group.commands.get(command.words[1])
    assert subcommand is not None, f"{command}: laneway has no command {command.words[1]!r}"
    try:
        with subcommand.make_context(command.words[1], list(command.words[2:])):
            pass
    except typer.TyperException as error:  # typer's click: a usage error, a bad value
        pytest.fail(f"{command}: {error}")


@SQLITE_ONLY
@pytest.mark.parametrize("block", [b for b in SH_BLOCKS if runnable(b)], ids=str)
def test_each_sh_block_runs_as_written(block, tmp_path, monkeypatch, request):
    """The block's lines in order, each `laneway` line through the CLI against the state
    it describes (``state_of``); lines ``parse_only`` names are skipped here."""
    monkeypatch.chdir(tmp_path)  # a default `.laneway` is this test's own
    monkeypatch.setenv("API_KEY", SECRET)  # the README's `export API_KEY=…`, in force
    elsewhere = {name: tmp_path / file for name, file in ELSEWHERE.items()}
    with ExitStack() as shared:
        kept: dict[str, dict[str, Path]] = {}
        for number, command in enumerate(commands(block)):
            if parse_only_line(command):
                continue
            check = check_laneway if command.is_laneway else OTHER_COMMANDS[command.words[0]]
            state = state_of(command)
            if state is None:
                check(command, elsewhere)
            elif state in SHARED:
                if state not in kept:
                    directory = tmp_path / state
                    kept[state] = shared.enter_context(entered(state, directory, request))
                check(command, {**elsewhere, **kept[state]})
            else:
                with entered(state, tmp_path / f"{state}-{number}", request) as places:
                    check(command, {**elsewhere, **places})
