from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session, sessionmaker

from controller import db, ledger
from controller.config import PipelineConfig
from controller.models import Job
from tests.support import FixedClock, make_config


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    path = tmp_path / "runtime"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ledger migrated to head per session; each test gets a copy (fast)."""
    directory = tmp_path_factory.mktemp("template")
    db.open_ledger(directory).dispose()
    return directory / db.LEDGER_FILENAME


@pytest.fixture
def engine(runtime: Path, migrated_template: Path) -> Iterator[Engine]:
    shutil.copyfile(migrated_template, runtime / db.LEDGER_FILENAME)
    engine = db.open_ledger(runtime)
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
    """Create a run from a config (default: one stage, one item); returns its id."""

    def _make(config: PipelineConfig | None = None) -> int:
        config = config or make_config()
        with db.transaction(factory) as session:
            run = ledger.create_run(
                session,
                config,
                runtime_dir=str(runtime),
                source_hashes={},
                actor="test",
                now=clock.now(),
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
