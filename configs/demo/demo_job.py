"""What every demo job shares: reading laneway's environment, writing result.json
atomically, and the paid-call simulator. Standard library only."""

from __future__ import annotations

import json
import os
import time


def env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(f"{name} is not set: run this under laneway")
    return value


def write_result(**fields: object) -> None:
    """result.json at LANEWAY_RESULT_PATH, carrying our job id; temp + fsync + rename."""
    path = env("LANEWAY_RESULT_PATH")
    payload = {"job_id": env("LANEWAY_JOB_ID"), **fields}
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def write_output(name: str, payload: dict[str, object]) -> None:
    """A declared output: written to the attempt's workspace, where laneway hashes and
    stores it when the attempt succeeds."""
    with open(os.path.join(env("LANEWAY_WORKSPACE"), name), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)


def read_input(path: str) -> dict[str, object]:
    """An input laneway fetched and verified before this job started."""
    with open(path, encoding="utf-8") as handle:
        loaded: dict[str, object] = json.load(handle)
    return loaded


def paid_call(prompt: str) -> str:
    """Simulate one billed provider call: one line per real call, with the key the
    provider would deduplicate on. A second line with the same key = a double charge."""
    key = env("LANEWAY_IDEMPOTENCY_KEY")
    if len(env("DEMO_API_KEY")) < 8:
        raise SystemExit("DEMO_API_KEY looks wrong")
    line = json.dumps({"idempotency_key": key, "item": env("LANEWAY_ITEM"), "at": time.time()})
    fd = os.open(env("DEMO_PAID_CALLS"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"answer to {prompt}"


def work(seconds: float) -> None:
    """Stand-in for real work (kept short so the demo ends quickly)."""
    time.sleep(seconds)
