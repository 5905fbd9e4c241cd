"""The content-addressed store and the output/input file handling of
workers/artifacts.py, on a local fsspec store."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from laneway.controller.attempt import artifacts
from laneway.controller.outcome import Verdict
from laneway.controller.states import Outcome

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
    location = store.put(output).location
    obj = tmp_path / "store" / "sha256" / output.sha256[:2] / output.sha256
    assert location == store.location(output.sha256) and obj.read_bytes() == b"bytes"
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600
    assert [p.name for p in obj.parent.iterdir()] == [output.sha256]  # no temporary left
    before = obj.stat().st_mtime_ns
    assert store.put(output) == artifacts.Placed(location) and obj.stat().st_mtime_ns == before


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


def test_a_symlink_is_never_an_output_even_to_a_file_inside_the_workspace(tmp_path):
    workspace = tmp_path / "workspace"
    write(workspace / "real.txt", b"real")
    os.symlink("real.txt", workspace / "alias.txt")
    os.symlink(".", workspace / "loop")
    found, missing = artifacts.find_outputs(workspace, ["alias.txt", "*.txt", "loop/real.txt"])
    assert [o.name for o in found] == ["real.txt"] and missing == ["alias.txt", "loop/real.txt"]


@pytest.mark.parametrize(
    "pattern",
    [
        "*.txt",
        "**",
        "**/*.txt",
        "a/**",
        "a/**/c.txt",
        "**/b/*",
        "a/*/c.txt",
        ".h*/*",
        "[ab]/x?.txt",
    ],
)
def test_glob_matching_is_glob_glob_where_there_is_no_link(tmp_path, pattern):
    import glob

    workspace = tmp_path / "workspace"
    for name in ("top.txt", "a/c.txt", "a/b/c.txt", "a/b/d.bin", "a/x1.txt", "b/x2.txt"):
        write(workspace / name, b"x")
    for name in (".hidden/h.txt", "a/.dot.txt", "a/.d/c.txt"):
        write(workspace / name, b"x")
    expected = sorted(
        Path(p).relative_to(workspace).as_posix()
        for p in glob.glob(str(workspace / pattern), recursive=True)
        if Path(p).is_file()
    )
    found, _ = artifacts.find_outputs(workspace, [pattern])
    assert sorted(o.name for o in found) == expected


def symlink_loops(workspace: Path, names: int = 40) -> None:
    """``ln -s . a; ln -s . b ...``: what made ``glob.glob(recursive=True)`` walk 2^40 paths."""
    for i in range(names):
        os.symlink(".", workspace / f"l{i}")


def test_a_doublestar_glob_never_follows_a_directory_link_and_renews_leases(tmp_path):
    """The walk behind ``**`` does not enter links (a loop of them is nothing to walk),
    is bounded, and offers to renew the leases every RENEW_EVERY names. Run in a
    separate process by test_output_bounds.py with a timeout: here, the bounded walk."""
    workspace = tmp_path / "workspace"
    for i in range(3 * artifacts.RENEW_EVERY):
        write(workspace / "d" / f"{i}.txt", b"%d" % i)
    symlink_loops(workspace)
    calls: list[int] = []
    found, missing = artifacts.find_outputs(workspace, ["**/*.txt"], lambda: calls.append(1))
    assert len(found) == 3 * artifacts.RENEW_EVERY and not missing
    # The walk's renewals (every RENEW_EVERY names) and one per chunk hashed.
    assert len(calls) >= 3 + len(found)


@pytest.mark.parametrize("bound", ["matches", "entries", "depth"])
def test_outputs_past_a_bound_are_a_harness_failure_and_nothing_is_stored(
    tmp_path, monkeypatch, bound
):
    attempt = tmp_path / "attempt"
    workspace = attempt / "workspace"
    if bound == "depth":
        deep = workspace.joinpath(*["d"] * (artifacts.MAX_OUTPUT_DEPTH + 2))
        write(deep / "x.txt", b"deep")
    else:
        monkeypatch.setattr(artifacts, f"MAX_OUTPUT_{bound.upper()}", 5)
        for i in range(10):
            write(workspace / f"{i}.txt", b"x")
    store = tmp_path / "store"
    verdict, stored = artifacts.deliver(
        Verdict(Outcome.SUCCEEDED, "exit code 0"), str(attempt), ["**/*.txt"], store.as_uri()
    )
    assert verdict.outcome is Outcome.HARNESS_FAILURE and stored == []
    assert {"matches": "more than 5 files", "entries": "more than 5 names", "depth": "deep"}[
        bound
    ] in verdict.reason
    assert not store.exists()


def bytes_read() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_an_output_over_its_cap_is_not_read_nor_stored(tmp_path):
    """A 2 GiB sparse file (the default cap is 1 GiB) is judged by its size: nothing of
    it is read, nothing stored, the attempt settles harness_failure naming the cap."""
    attempt = tmp_path / "attempt"
    workspace = attempt / "workspace"
    write(workspace / "small.txt", b"fine")
    with open(workspace / "huge.bin", "wb") as huge:
        huge.truncate(2 << 30)
    store = tmp_path / "store"
    before = bytes_read()
    verdict, stored = artifacts.deliver(
        Verdict(Outcome.SUCCEEDED, "exit code 0"),
        str(attempt),
        ["small.txt", "*.bin"],
        store.as_uri(),
    )
    assert bytes_read() - before < 1 << 20
    assert verdict.outcome is Outcome.HARNESS_FAILURE and stored == []
    assert "huge.bin" in verdict.reason and "output_max_mib (1024 MiB)" in verdict.reason
    assert not store.exists()
    verdict, stored = artifacts.deliver(
        Verdict(Outcome.SUCCEEDED, "exit code 0"),
        str(attempt),
        ["small.txt"],
        store.as_uri(),
        max_bytes=4,
    )
    assert verdict.outcome is Outcome.SUCCEEDED and [s["name"] for s in stored] == ["small.txt"]


def test_the_default_cap_is_the_configs():
    from tests.support import make_config

    stage = make_config().stages[0]
    assert stage.output_max_mib == artifacts.DEFAULT_OUTPUT_MAX_MIB


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    """The local file store (temporary name, fsync, rename) and an fsspec store that is
    not local (one put_file), each as ``ArtifactStore`` sees it."""
    if request.param == "file":
        yield artifacts.ArtifactStore((tmp_path / "store").as_uri())
        return
    import fsspec

    url = f"memory://laneway-test-{os.getpid()}-{id(tmp_path)}"
    yield artifacts.ArtifactStore(url)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_a_damaged_object_is_replaced_by_a_producer_with_the_right_bytes(tmp_path, store):
    """An object that does not hash to its name heals: the next producer with the right
    bytes replaces it, and the settle's diagnostics say so (before: every producer of
    those bytes failed with harness_failure, for good)."""
    attempt = tmp_path / "attempt"
    write(attempt / "workspace" / "x", b"bytes")
    ok = Verdict(Outcome.SUCCEEDED, "exit code 0")
    verdict, (first,) = artifacts.deliver(ok, str(attempt), ["x"], store.url)
    assert verdict is ok
    key = store._key(first["sha256"])
    store.fs.pipe_file(key, b"rotten")  # a disk error, a hand edit
    bad = hashlib.sha256(b"rotten").hexdigest()
    verdict, (again,) = artifacts.deliver(ok, str(attempt), ["x"], store.url)
    assert verdict.outcome is Outcome.SUCCEEDED and again == first
    (note,) = verdict.diagnostics
    assert bad in note and "replaced" in note and first["location"] in note
    store.fs.invalidate_cache()
    assert store.fs.cat_file(key) == b"bytes"
    if store.local:
        obj = Path(key)
        assert stat.S_IMODE(obj.stat().st_mode) == 0o600
        assert [p.name for p in obj.parent.iterdir()] == [obj.name]  # no temporary left
    # Verified now: the next producer leaves it as it is and says nothing.
    verdict, _ = artifacts.deliver(ok, str(attempt), ["x"], store.url)
    assert verdict is ok


def test_a_store_that_still_reads_back_wrong_is_a_store_error(tmp_path, monkeypatch):
    store = artifacts.ArtifactStore((tmp_path / "store").as_uri())
    (output,), _ = artifacts.find_outputs(write(tmp_path / "w" / "x", b"bytes").parent, ["x"])
    monkeypatch.setattr(store, "_hash_object", lambda key, between=None: "f" * 64)
    with pytest.raises(artifacts.StoreError, match="reads back as sha256"):
        store.put(output)


def test_fetch_under_an_attempt_dir_refuses_a_planted_link_and_writes_nothing_outside(tmp_path):
    from laneway.controller import durable

    source = write(tmp_path / "object", b"payload")
    good = hashlib.sha256(b"payload").hexdigest()
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (attempt / "inputs").mkdir()
    os.symlink(outside, attempt / "inputs" / "prepare")
    target = attempt / "inputs" / "prepare" / "x"
    with pytest.raises(durable.PathRefused):
        artifacts.fetch(source.as_uri(), good, "prepare/x", target, root=attempt)
    assert list(outside.iterdir()) == []
    os.unlink(attempt / "inputs" / "prepare")
    (attempt / "inputs" / "prepare").mkdir()
    os.symlink(outside / "x", target)  # the file's own name, planted
    with pytest.raises(durable.PathRefused, match="exists before"):
        artifacts.fetch(source.as_uri(), good, "prepare/x", target, root=attempt)
    assert list(outside.iterdir()) == []
    os.unlink(target)
    artifacts.fetch(source.as_uri(), good, "prepare/x", target, root=attempt)
    assert target.read_bytes() == b"payload" and not target.is_symlink()
