"""The per-attempt supervisor's CPU and fsyncs, beside a bare fork+exec of the same job.

    .venv/bin/python bench/bench_supervisor.py
    (options: --sizes 200,1000  --reps 3  --fsync-attempts 50  --project DIR)

For each size N and each repetition, in one invocation and interleaved, this process
(a child subreaper, so every orphan's CPU is reaped into its RUSAGE_CHILDREN) runs N
attempts of ``/bin/true``, one after another, three ways:

- bare fork+exec: ``os.fork()``, ``os.execv("/bin/true")`` in the child,
  ``os.waitpid`` — the floor for "Python starts a process and waits for it";
- bare posix_spawn: ``os.posix_spawn`` + ``os.waitpid`` (vfork semantics: no page
  tables copied), for reference;
- laneway: the worker's path without the ledger. One supervisor launcher
  (``workers.launcher``, started with ``launcher_argv`` as ``spawning.Launcher`` starts
  it) per repetition; per attempt the attempt directory with its ``workspace``, an
  append-only ``supervisor.log``, a report pipe, and one request (the spec and the
  job's environment, as ``Spawning.start_supervisor`` builds them) sent with both
  descriptors (``SCM_RIGHTS``); then the supervisor's report is read, its exit waited
  for through a pidfd, and ``exit.json`` checked (exit code 0). After N attempts the
  launcher's socket is closed and the launcher reaped, so the CPU of the launcher, of
  every supervisor it forked and of every job lands in our RUSAGE_CHILDREN. The
  launcher's own start and exit (imports, measured per repetition with no attempt)
  is subtracted.

Per way: CPU ms per attempt (user+sys of RUSAGE_CHILDREN deltas; median and min-max
over reps), with the 1-minute load average (``/proc/loadavg``) read just before each
measurement printed beside it; for laneway also "over bare" (laneway minus bare
fork+exec: what the launcher and supervisor add to the job's own start) and this
process's own CPU per attempt (the worker's side of a spawn: not in the other figures).
The laneway figure is split, from the launcher's ``/proc/PID/stat`` just before it is
told to exit, into the launcher's own CPU (its start subtracted) and that of the
supervisors it reaped (each with its job: a supervisor waits for its job). "Supervisors
alone" is an estimate of issue 22's figure (the supervisor's own CPU per attempt): that
last share less the job's own CPU, taken as what bare posix_spawn's children cost in the
same rep (a supervisor starts its job the same way, by ``vfork`` and ``exec``).

Then fsyncs per attempt: ``--fsync-attempts`` more attempts through a launcher run
under ``strace -f -y -e trace=fsync,fdatasync``, counted by the name of what was
fsynced (skipped when strace is missing or not permitted). No assertions: numbers.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

TRUE = shutil.which("true", path="/bin:/usr/bin") or "/bin/true"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


# ------------------------------------------------------------------------ bare


def run_fork_exec(n: int) -> dict:
    load = loadavg()
    cpu0 = children_cpu()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                os.execv(TRUE, [TRUE])
            finally:
                os._exit(127)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            return {"ok": False, "load": load, "cpu": children_cpu() - cpu0}
    return {"ok": True, "load": load, "cpu": children_cpu() - cpu0}


def run_posix_spawn(n: int) -> dict:
    load = loadavg()
    cpu0 = children_cpu()
    env = dict(os.environ)
    for _ in range(n):
        pid = os.posix_spawn(TRUE, [TRUE], env)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            return {"ok": False, "load": load, "cpu": children_cpu() - cpu0}
    return {"ok": True, "load": load, "cpu": children_cpu() - cpu0}


# --------------------------------------------------------------------- laneway


class LauncherDriver:
    """One launcher, driven as ``spawning.Launcher`` drives it (without the ledger)."""

    def __init__(self, wrap: list[str] | None = None) -> None:
        from laneway.workers import launcher

        self.launcher = launcher
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [*(wrap or []), *launcher.launcher_argv(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=[theirs.fileno()],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        finally:
            theirs.close()
        self.sock = ours

    def attempt(self, root: Path, number: int, base_env: dict[str, str]) -> bool:
        directory = root / f"attempt-{number}"
        os.mkdir(directory, 0o700)
        os.mkdir(directory / "workspace", 0o700)
        log_fd = os.open(
            directory / "supervisor.log",
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
            0o600,
        )
        env = dict(base_env)
        env.update(
            {
                "LANEWAY_IDEMPOTENCY_KEY": f"bench-{number}",
                "LANEWAY_JOB_ID": str(number),
                "LANEWAY_ATTEMPT_ID": str(number),
                "LANEWAY_ATTEMPT": "1",
                "LANEWAY_RUN_ID": "1",
                "LANEWAY_ITEM": f"i{number}",
                "LANEWAY_STAGE": "noop",
                "LANEWAY_LANE": "a",
                "LANEWAY_ATTEMPT_DIR": str(directory),
                "LANEWAY_WORKSPACE": str(directory / "workspace"),
                "LANEWAY_RESULT_PATH": str(directory / "result.json"),
                "LANEWAY_PORTS": "",
            }
        )
        spec = {
            "attempt_id": number,
            "attempt_dir": str(directory),
            "argv": [TRUE],
            "cwd": str(directory / "workspace"),
            "timeout_seconds": 60.0,
            "grace_seconds": 5.0,
            "log_cap_bytes": 1 << 30,
            "secret_env": [],
            "strip_env": [],
        }
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            socket.send_fds(
                self.sock, [json.dumps({"spec": spec, "env": env}).encode()], [write_end, log_fd]
            )
            reply = json.loads(self.sock.recv(4096))
        finally:
            os.close(write_end)
            os.close(log_fd)
        with os.fdopen(read_end, "rb") as report:
            line = report.readline()
        pid = int(reply["pid"])
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None  # exited and reaped already
        if pidfd is not None:
            select.select([pidfd], [], [])
            os.close(pidfd)
        try:
            record = json.loads((directory / "exit.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(json.loads(line).get("child_pid")) and record.get("exit_code") == 0

    def close(self) -> None:
        self.sock.close()
        self.process.wait()
        common.reap_orphans()


def run_laneway(n: int, root: Path, base_env: dict[str, str]) -> dict:
    load = loadavg()
    cpu0, own0 = children_cpu(), self_cpu()
    driver = LauncherDriver()
    ok = all(driver.attempt(root, number, base_env) for number in range(n))
    split = common.proc_stat(driver.process.pid)  # before it exits: (own, reaped children)
    driver.close()
    result = {"ok": ok, "load": load, "cpu": children_cpu() - cpu0, "self": self_cpu() - own0}
    if split is not None:
        result["launcher"], result["supervisors"] = split[0], split[1]
    return result


def launcher_alone() -> float:
    """CPU seconds of a launcher started and closed with no attempt."""
    cpu0 = children_cpu()
    LauncherDriver().close()
    return children_cpu() - cpu0


# ---------------------------------------------------------------------- fsyncs

FSYNC_LINE = re.compile(r"^\d+\s+(fsync|fdatasync)\(\d+<([^>]*)>")


def count_fsyncs(n: int, base_env: dict[str, str]) -> tuple[float, Counter[str]] | str:
    """fsyncs per attempt through a launcher under strace, and their count by name."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace not installed"
    root = Path(tempfile.mkdtemp(prefix="laneway-bench-fsync-"))
    out = root / "strace.txt"
    try:
        wrap = [strace, "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o", str(out)]
        driver = LauncherDriver(wrap)
        ok = all(driver.attempt(root, number, base_env) for number in range(n))
        driver.close()
        if not ok:
            return "attempts failed under strace"
        names: Counter[str] = Counter()
        for line in out.read_text().splitlines():
            match = FSYNC_LINE.match(line)
            if match:
                path = match.group(2)
                name = (
                    "attempt directory"
                    if path.startswith(str(root)) and (os.path.dirname(path) == str(root))
                    else os.path.basename(path)
                )
                names[f"{match.group(1)} {name}"] += 1
        if not names and "attempt-" not in out.read_text():
            # Either no fsync at all, or strace could not trace (no ptrace here).
            pass
        return sum(names.values()) / n, names
    except OSError as exc:
        return f"strace: {exc}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------ main


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--sizes", type=common.int_list, default=[200, 1000], help="N per row (default 200,1000)"
    )
    parser.add_argument(
        "--fsync-attempts",
        type=int,
        default=50,
        help="attempts run under strace to count fsyncs (0: skip; default %(default)s)",
    )
    args = parser.parse_args()
    project = common.use_project_and_say(args.project)
    common.become_subreaper()
    base_env = dict(os.environ)
    print(f"job: {TRUE}; reps: {args.reps}; cores: {os.cpu_count()}")
    for n in args.sizes:
        samples: dict[str, list[dict]] = {"fork": [], "spawn": [], "laneway": []}
        alone: list[float] = []
        for _ in range(args.reps):
            root = Path(tempfile.mkdtemp(prefix="laneway-bench-supervisor-"))
            try:
                samples["fork"].append(run_fork_exec(n))
                samples["spawn"].append(run_posix_spawn(n))
                alone.append(launcher_alone())
                samples["laneway"].append(run_laneway(n, root, base_env))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        print_size(n, samples, alone)
    if args.fsync_attempts > 0:
        counted = count_fsyncs(args.fsync_attempts, base_env)
        print()
        if isinstance(counted, str):
            print(f"fsyncs per attempt: not counted ({counted})")
        else:
            per, names = counted
            print(f"fsyncs per attempt (strace, {args.fsync_attempts} attempts): {per:.2f}")
            for name, count in sorted(names.items()):
                print(f"  {name}: {count / args.fsync_attempts:.2f}")
    del project


def print_size(n: int, samples: dict[str, list[dict]], alone: list[float]) -> None:
    def per(rows: list[dict], key: str = "cpu", minus: list[float] | None = None) -> list[float]:
        return [
            (row[key] - (minus[i] if minus else 0.0)) / n * 1000
            for i, row in enumerate(rows)
            if key in row
        ]

    def loads(rows: list[dict]) -> str:
        return ", ".join(f"{row['load']:.2f}" for row in rows)

    def check(rows: list[dict]) -> str:
        bad = sum(1 for row in rows if not row["ok"])
        return "ok" if not bad else f"{bad} rep(s) FAILED"

    fork = per(samples["fork"])
    lane = per(samples["laneway"], minus=alone)
    over = [lane_ms - fork_ms for lane_ms, fork_ms in zip(lane, fork, strict=True)]
    rows = [
        [
            "bare fork+exec+wait",
            common.fmt(fork, 3),
            "",
            loads(samples["fork"]),
            check(samples["fork"]),
        ],
        [
            "bare posix_spawn+wait",
            common.fmt(per(samples["spawn"]), 3),
            "",
            loads(samples["spawn"]),
            check(samples["spawn"]),
        ],
        [
            "laneway launcher+supervisor",
            common.fmt(lane, 3),
            common.fmt(over, 3),
            loads(samples["laneway"]),
            check(samples["laneway"]),
        ],
        [
            "  of which the launcher",
            common.fmt(per(samples["laneway"], "launcher", minus=alone), 3),
            "",
            "",
            "",
        ],
        [
            "  of which supervisors + jobs",
            common.fmt(per(samples["laneway"], "supervisors"), 3),
            "",
            "",
            "",
        ],
        [
            "  supervisors alone (est.)",
            common.fmt(
                [
                    sup - job
                    for sup, job in zip(
                        per(samples["laneway"], "supervisors"), per(samples["spawn"]), strict=True
                    )
                ],
                3,
            ),
            "",
            "",
            "",
        ],
        [
            "  worker side (this process)",
            common.fmt(per(samples["laneway"], "self"), 3),
            "",
            "",
            "",
        ],
    ]
    print()
    print(
        f"N = {n} attempts of true, one at a time (CPU ms per attempt, median (min-max) over "
        f"reps; launcher start+exit {common.fmt([a * 1000 for a in alone], 1)} ms subtracted)"
    )
    print(
        common.table(
            ["way", "CPU ms/attempt", "over bare fork+exec", "load avg (1 min), per rep", "check"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
