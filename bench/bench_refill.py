"""Slot-refill latency of laneway: one child's exit -> the next child's exec, p50/p99/max.

    .venv/bin/python bench/bench_refill.py
    (options: --sizes 100,500  --slots 1,2  --reps 3  --project DIR)

For each size N and slot count S it runs `laneway run CONFIG --runtime-dir DIR --quiet`
on a generated config: one node with max_jobs=S, one lane, N items, one stage whose
command stamps the wall clock when it starts and again just before it exits:

    bash -c 'echo $EPOCHREALTIME > "$STAMP_DIR/$ID.start";
             echo $EPOCHREALTIME > "$STAMP_DIR/$ID.end"'

(ID is LANEWAY_JOB_ID; STAMP_DIR comes from the stage's `env`; `sh` with `date +%s%N`
where bash is missing). The refill latency of a start is that start minus the latest
end before it (starts with no end before them are skipped): on 1 slot, exactly "child
exit -> next child exec"; on S slots, the time from the latest slot freeing to the next
start. It covers the child's exit, the supervisor noticing and writing exit.json, the
worker settling, claiming the next job, starting its supervisor and that starting the
child, plus the stamping command's own start (bash exec).

Beside it, the same stamping command under `xargs -P S` (the floor of the method: a
fork+exec and the stamping itself). Per row: p50, p99 and max of the refill latency,
each as median (min-max) over reps, in ms. No assertions: numbers to compare.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

BASH_STAMP = (
    'ID="$LANEWAY_JOB_ID$1"; echo $EPOCHREALTIME > "$STAMP_DIR/$ID.start"; '
    'echo $EPOCHREALTIME > "$STAMP_DIR/$ID.end"'
)
SH_STAMP = (
    'ID="$LANEWAY_JOB_ID$1"; date +%s.%N > "$STAMP_DIR/$ID.start"; '
    'date +%s.%N > "$STAMP_DIR/$ID.end"'
)


def stamp_argv() -> list[str]:
    if shutil.which("bash"):
        return ["bash", "-c", BASH_STAMP]
    return ["sh", "-c", SH_STAMP]


def toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(directory: Path, stamps: Path, n: int, slots: int) -> Path:
    argv = ", ".join(toml_str(part) for part in stamp_argv())
    lines = [
        'name = "bench-refill"',
        "[[nodes]]",
        'name = "n1"',
        "memory_floor_mib = 0",
        f"max_jobs = {slots}",
        "[[lanes]]",
        'name = "a"',
        'node = "n1"',
        "[[stages]]",
        'name = "stamp"',
        f"argv = [{argv}]",
        f"env = {{ STAMP_DIR = {toml_str(str(stamps))} }}",
        "timeout_seconds = 60",
    ]
    for i in range(n):
        lines += ["[[items]]", f'key = "i{i}"', 'lane = "a"']
    path = directory / "pipeline.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def refill_ms(stamps: Path) -> tuple[list[float], int]:
    """Sorted refill latencies (ms) from the stamp files, and how many jobs stamped."""
    starts, ends = {}, {}
    for path in stamps.iterdir():
        try:
            value = float(path.read_text().strip())
        except ValueError:
            continue
        (starts if path.suffix == ".start" else ends)[path.stem] = value
    events = sorted([(t, 1) for t in starts.values()] + [(t, 0) for t in ends.values()])
    latest_end = None
    latencies = []
    for t, is_start in events:
        if is_start:
            if latest_end is not None:
                latencies.append((t - latest_end) * 1000)
        else:
            latest_end = t
    return sorted(latencies), len(starts)


def summarize(latencies: list[float]) -> dict[str, float]:
    return {
        "p50": common.percentile(latencies, 50),
        "p99": common.percentile(latencies, 99),
        "max": latencies[-1] if latencies else float("nan"),
    }


def run_laneway(project: Path, n: int, slots: int, root: Path) -> dict:
    stamps = root / "stamps"
    stamps.mkdir()
    config = write_config(root, stamps, n, slots)
    prefix, env, cwd = common.laneway_cli(project)
    argv = [*prefix, "run", str(config), "--runtime-dir", str(root / "runtime"), "--quiet"]
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    latencies, count = refill_ms(stamps)
    result = summarize(latencies)
    result["ok"] = proc.returncode == 0 and count == n
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        result["error"] = f"exit {proc.returncode}: {last[-100:]}"
    return result


def run_xargs(n: int, slots: int, root: Path) -> dict:
    stamps = root / "stamps"
    stamps.mkdir()
    argv = stamp_argv()
    env = {"STAMP_DIR": str(stamps), "PATH": "/usr/bin:/bin"}
    feed = "".join(f"{i}\n" for i in range(n))
    proc = subprocess.run(
        ["xargs", f"-P{slots}", "-n1", *argv, "stamp"],
        input=feed,
        env=env,
        capture_output=True,
        text=True,
    )
    latencies, count = refill_ms(stamps)
    result = summarize(latencies)
    result["ok"] = proc.returncode == 0 and count == n
    return result


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--sizes", type=common.int_list, default=[100, 500])
    parser.add_argument("--slots", type=common.int_list, default=[1, 2])
    args = parser.parse_args()
    project = args.project.resolve()
    print(f"project: {project}; reps: {args.reps}; stamp: {stamp_argv()[0]}")
    headers = ["N", "slots", "runner", "p50 ms", "p99 ms", "max ms", "check"]
    rows = []
    for n in args.sizes:
        for slots in args.slots:
            samples: dict[str, list[dict]] = {"laneway": [], f"xargs -P{slots}": []}
            for _ in range(args.reps):
                root = Path(tempfile.mkdtemp(prefix="laneway-bench-refill-"))
                try:
                    (root / "l").mkdir()
                    (root / "x").mkdir()
                    samples["laneway"].append(run_laneway(project, n, slots, root / "l"))
                    samples[f"xargs -P{slots}"].append(run_xargs(n, slots, root / "x"))
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            for runner, runs in samples.items():
                bad = [r for r in runs if not r["ok"]]
                check = "ok" if not bad else f"{len(bad)} rep(s) FAILED " + bad[0].get("error", "")
                rows.append(
                    [
                        str(n),
                        str(slots),
                        runner,
                        *(common.fmt([r[k] for r in runs], 2) for k in ("p50", "p99", "max")),
                        check,
                    ]
                )
    print("refill latency, ms: median (min-max) over reps")
    print(common.table(headers, rows, left=3))


if __name__ == "__main__":
    main()
