#!/usr/bin/env bash
# The device-script and server tests with the machine busy: a CPU-bound process per core beside
# pytest. These tests start scripts, processes and servers and watch them; they wait on events (a
# line in a log, a file, a status, a served answer), never on wall time alone, so they must pass
# however slow the machine is. CI runs this after the suite (.ci/run). Usage, from the repository
# root with bistat installed (. .venv/bin/activate): bash scripts/test_busy.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=()
stop_hogs() { if [ ${#hogs[@]} -gt 0 ]; then kill "${hogs[@]}" 2>/dev/null || true; fi; }
trap stop_hogs EXIT
for _ in $(seq "$(nproc)"); do
  python -c 'while True: pass' &
  hogs+=("$!")
done
echo "test_busy: ${#hogs[@]} CPU-bound process(es) beside pytest (pids ${hogs[*]})"
python -m pytest -q tests/test_device_*.py tests/test_engine_http_*.py \
  tests/test_engine_command_server.py tests/test_engine_vllm_server.py tests/test_engine_sglang.py \
  tests/test_serve_*.py tests/test_server_reports.py "$@"
