from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session, sessionmaker

from laneway.controller import db, ledger, ledger_open
from laneway.controller.config import PipelineConfig
from laneway.controller.models import Job
from tests import backends
from tests.support import FixedClock, make_config


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that opens a ledger (it uses ``ledger_backend``, directly or through
    ``runtime``/``engine``, or sits in a directory whose conftest uses it for all) runs
    once per backend in ``tests.backends.backends()``."""
    if "ledger_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("no_ledger"):
        metafunc.parametrize("ledger_backend", ["sqlite"], indirect=True)
        return
    only = metafunc.definition.get_closest_marker("sqlite_only")
    params = []
    for backend in backends.backends():
        marks = []
        if backend != "sqlite" and only is not None:
            marks.append(pytest.mark.skip(reason=f"SQLite only: {only.args[0]}"))
        params.append(pytest.param(backend, marks=marks, id=backend))
    metafunc.parametrize("ledger_backend", params, indirect=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if backends.POSTGRES_URL:
        backends.drop_template()


@pytest.fixture
def ledger_backend(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """``sqlite``: the ledger is the runtime dir's file (LANEWAY_DATABASE_URL unset);
    ``postgres``: LANEWAY_DATABASE_URL names a fresh database of this test's own."""
    backend: str = getattr(request, "param", "sqlite")
    if backend == "sqlite":
        monkeypatch.delenv("LANEWAY_DATABASE_URL", raising=False)
        monkeypatch.delenv("LANEWAY_READONLY_DATABASE_URL", raising=False)
        yield backend
        return
    name = backends.create_database()
    monkeypatch.setenv("LANEWAY_DATABASE_URL", backends.database_url(name))
    monkeypatch.setenv("LANEWAY_READONLY_DATABASE_URL", backends.reader_url(name))
    try:
        yield backend
    finally:
        backends.drop_database(name)


@pytest.fixture
def on_postgres(ledger_backend: str) -> bool:
    return ledger_backend == "postgres"


@pytest.fixture
def runtime(tmp_path: Path, ledger_backend: str) -> Path:
    path = tmp_path / "runtime"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ledger migrated to head per session; each test gets a copy (fast)."""
    directory = tmp_path_factory.mktemp("template")
    ledger_open.open_ledger(directory).dispose()
    return directory / db.LEDGER_FILENAME


@pytest.fixture
def engine(runtime: Path, ledger_backend: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    if ledger_backend == "sqlite":
        template: Any = request.getfixturevalue("migrated_template")
        shutil.copyfile(template, runtime / db.LEDGER_FILENAME)
    engine = ledger_open.open_ledger(runtime)
    yield engine
    engine.dispose()


@pytest.fixture
def factory(engine: Engine) -> sessionmaker[Session]:
    return db.session_factory(engine)


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture
def make_run(
    factory: sessionmaker[Session], runtime: Path, clock: FixedClock
) -> Callable[..., int]:
    """Create a run from a config (default: one stage, one item); returns its id.
    ``create``: more of ``ledger.create_run``'s arguments (``distrust``,
    ``source_hashes``: none by default)."""

    def _make(config: PipelineConfig | None = None, **create: Any) -> int:
        config = config or make_config()
        create.setdefault("source_hashes", {})
        with db.transaction(factory) as session:
            run = ledger.create_run(
                session,
                config,
                runtime_dir=str(runtime),
                actor="test",
                now=clock.now(),
                **create,
            )
            return run.id

    return _make


@pytest.fixture
def register_worker(factory: sessionmaker[Session], clock: FixedClock) -> Callable[..., str]:
    def _register(node: str = "n1") -> str:
        with db.transaction(factory) as session:
            return ledger.register_worker(
                session,
                node=node,
                host="test",
                pid=1,
                boot_id="boot",
                process_start_time=1,
                slots=4,
                now=clock.now(),
            )

    return _register


def force_job_state(session: Session, job_id: int, state: str) -> None:
    """Test-only arrangement: put a job in a state without going through the ledger."""
    terminal = state in ("succeeded", "failed", "skipped", "cancelled")
    finished = FixedClock().now() if terminal else None
    session.execute(update(Job).where(Job.id == job_id).values(state=state, finished_at=finished))


@pytest.fixture(autouse=True)
def _readers_closed_after_each_test() -> Iterator[None]:
    """Each test's ledgers' cached read-only engines (``db.reader``) are disposed after
    it: one process opening a thousand ledgers must not keep their files open."""
    yield
    db.forget_readers()


@pytest.fixture(autouse=True)
def _dev_null_stays_a_device() -> Iterator[None]:
    """A test that plants links for laneway to refuse must never leave the machine's own
    files changed: once, during a run against code without the link rules, /dev/null was
    left a symlink (and tmux, among others, stopped working). Name the test that does it."""
    import os
    import stat

    yield
    mode = os.lstat(os.devnull).st_mode
    assert stat.S_ISCHR(mode), f"{os.devnull} is no longer a character device after this test"
