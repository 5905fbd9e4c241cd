"""The content-addressed store and the output/input file handling of
workers/artifacts.py, on a local fsspec store."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from controller.outcome import Verdict
from controller.states import Outcome
from workers import artifacts

pytestmark = pytest.mark.no_ledger


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_outputs_by_name_and_glob_and_a_symlink_out_of_the_workspace_is_not_one(tmp_path):
    workspace = tmp_path / "workspace"
    write(workspace / "a.json", b"{}")
    write(workspace / "shards" / "0.jsonl", b"zero")
    write(tmp_path / "secret.txt", b"not the job's to hand over")
    os.symlink(tmp_path / "secret.txt", workspace / "leak.txt")
    found, missing = artifacts.find_outputs(workspace, ["a.json", "shards/*.jsonl", "leak.txt"])
    assert [o.name for o in found] == ["a.json", "shards/0.jsonl"]
    assert found[1].sha256 == hashlib.sha256(b"zero").hexdigest() and found[1].size_bytes == 4
    assert missing == ["leak.txt"]
    assert artifacts.find_outputs(workspace, ["none/*.bin"])[1] == ["none/*.bin"]


def test_put_is_content_addressed_private_and_never_rewrites(tmp_path):
    store = artifacts.ArtifactStore((tmp_path / "store").as_uri())
    (output,), _ = artifacts.find_outputs(write(tmp_path / "w" / "x", b"bytes").parent, ["x"])
    location = store.put(output)
    obj = tmp_path / "store" / "sha256" / output.sha256[:2] / output.sha256
    assert location == store.location(output.sha256) and obj.read_bytes() == b"bytes"
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600
    assert [p.name for p in obj.parent.iterdir()] == [output.sha256]  # no temporary left
    before = obj.stat().st_mtime_ns
    assert store.put(output) == location and obj.stat().st_mtime_ns == before


def test_a_damaged_object_is_a_store_error_not_overwritten(tmp_path):
    store = artifacts.ArtifactStore((tmp_path / "store").as_uri())
    (output,), _ = artifacts.find_outputs(write(tmp_path / "w" / "x", b"bytes").parent, ["x"])
    store.put(output)
    obj = tmp_path / "store" / "sha256" / output.sha256[:2] / output.sha256
    obj.write_bytes(b"other")
    with pytest.raises(artifacts.StoreError, match="reads back as sha256"):
        store.put(output)
    assert obj.read_bytes() == b"other"


def test_fetch_keeps_only_matching_bytes(tmp_path):
    source = write(tmp_path / "object", b"payload")
    good = hashlib.sha256(b"payload").hexdigest()
    target = tmp_path / "inputs" / "prepare" / "x"
    artifacts.fetch(source.as_uri(), good, "prepare/x", target)
    assert target.read_bytes() == b"payload" and stat.S_IMODE(target.stat().st_mode) == 0o600
    wrong = "0" * 64
    other = tmp_path / "inputs" / "prepare" / "y"
    with pytest.raises(artifacts.InputMismatch) as caught:
        artifacts.fetch(source.as_uri(), wrong, "prepare/y", other)
    assert wrong in str(caught.value) and good in str(caught.value)
    assert sorted(p.name for p in other.parent.iterdir()) == ["x"]  # nothing of y kept
    with pytest.raises(artifacts.StoreError, match="not in the store"):
        artifacts.fetch((tmp_path / "gone").as_uri(), good, "prepare/z", other)


def test_deliver_passes_failures_through_and_fails_a_missing_output(tmp_path):
    attempt = tmp_path / "attempt"
    write(attempt / "workspace" / "a.json", b"{}")
    url = (tmp_path / "store").as_uri()
    failed = Verdict(Outcome.FAILED, "exit code 1")
    assert artifacts.deliver(failed, str(attempt), ["a.json"], url) == (failed, [])
    ok = Verdict(Outcome.SUCCEEDED, "exit code 0")
    verdict, stored = artifacts.deliver(ok, str(attempt), ["a.json", "b.json"], url)
    assert verdict.outcome is Outcome.FAILED and "b.json" in verdict.reason and stored == []
    verdict, stored = artifacts.deliver(ok, str(attempt), ["a.json"], url)
    assert verdict is ok and [row["name"] for row in stored] == ["a.json"]


def test_a_large_file_runs_between_after_every_chunk_of_each_transfer(tmp_path, monkeypatch):
    """Storing and fetching one file call ``between`` (the worker's lease renewal) after
    each chunk they hash, write, read back or copy, not only between files: one large
    file cannot outlast the leases."""
    monkeypatch.setattr(artifacts, "CHUNK", 4)
    attempt_dir = tmp_path / "attempt"
    data = b"0123456789abcdefghij"  # 5 chunks
    write(attempt_dir / "workspace" / "big.bin", data)
    calls: list[int] = []
    store_url = (tmp_path / "store").as_uri()
    verdict, stored = artifacts.deliver(
        Verdict(Outcome.SUCCEEDED, "exit code 0"),
        str(attempt_dir),
        ["big.bin"],
        store_url,
        between=lambda: calls.append(1),
    )
    assert verdict.outcome is Outcome.SUCCEEDED and len(stored) == 1
    # 5 while hashing, 1 before the transfer, 5 while writing, 5 while reading back.
    assert len(calls) == 16
    calls.clear()
    target = tmp_path / "given" / "big.bin"
    artifacts.fetch(
        stored[0]["location"],
        stored[0]["sha256"],
        "p/big.bin",
        target,
        between=lambda: calls.append(1),
    )
    assert target.read_bytes() == data and len(calls) == 5
