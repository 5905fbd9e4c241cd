#!/usr/bin/env bash
# Install the peers the benchmarks compare laneway against, into the bench's own
# environment (never into laneway's dependencies). Idempotent: safe to run again.
#
#     bash bench/setup_peers.sh
#
# - Debian's task-spooler (binary `tsp` or `ts`) and GNU parallel, via apt-get;
# - bench/.venv-peers (gitignored): a venv with huey, used by bench_kernel.py through
#   bench/.venv-peers/bin/python in a subprocess.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

need=()
command -v tsp >/dev/null 2>&1 || { command -v ts >/dev/null 2>&1 && ts -h 2>&1 | grep -qi "spooler"; } || need+=(task-spooler)
command -v parallel >/dev/null 2>&1 || need+=(parallel)
if [ "${#need[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    "${sudo_cmd[@]}" apt-get update -qq || true
    "${sudo_cmd[@]}" apt-get install -y -qq "${need[@]}"
fi

python="${PYTHON:-python3}"
if [ ! -x "$here/.venv-peers/bin/python" ]; then
    "$python" -m venv "$here/.venv-peers"
fi
if ! "$here/.venv-peers/bin/python" -c "import huey" 2>/dev/null; then
    "$here/.venv-peers/bin/python" -m pip install -q --disable-pip-version-check huey
fi

echo "peers:"
if command -v tsp >/dev/null 2>&1; then echo "  task-spooler: $(command -v tsp)"; \
elif command -v ts >/dev/null 2>&1; then echo "  task-spooler: $(command -v ts)"; fi
echo "  task-spooler package: $(dpkg-query -W -f='${Version}' task-spooler 2>/dev/null || echo '?')"
echo "  parallel: $(parallel --version 2>/dev/null | head -1)"
echo "  huey: $("$here/.venv-peers/bin/python" -c 'import huey; print(huey.__version__)')"
