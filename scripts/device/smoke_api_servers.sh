#!/bin/bash
# Device side, once per fresh machine before the served studies (≈ 1-2 min): does `vllm serve`
# start and answer with the front-end settings the studies registered (two API-server processes,
# no access log), and does /metrics still carry the scheduler gauges? If not, amend the
# registrations here before any data (bistat register --amend) and drop api_server_count.
# Usage: bash scripts/device/smoke_api_servers.sh [MODEL]   (default /tmp/model/smollm2)
set -uo pipefail
. "$(dirname "$0")/env.sh"
MODEL=${1:-/tmp/model/smollm2}; PORT=18731; LOG=/tmp/smoke-api-servers.log
t0=$SECONDS
setsid vllm serve "$MODEL" --port $PORT --api-server-count 2 --disable-uvicorn-access-log \
  --no-enable-prefix-caching --gpu-memory-utilization 0.2 --max-model-len 2048 > $LOG 2>&1 &
pid=$!
ok=0
for _ in $(seq 1 150); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    2>/dev/null && { ok=1; break; }
  kill -0 $pid 2>/dev/null || break; sleep 1
done
if [ $ok = 1 ]; then
  echo "[smoke] healthy after $((SECONDS - t0)) s"
  MODEL=$MODEL PORT=$PORT python3 - <<'PY'
import json, os, urllib.request as u
base = f"http://127.0.0.1:{os.environ['PORT']}"
body = {"model": os.environ["MODEL"], "max_tokens": 8, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "return_token_ids": True,
        "messages": [{"role": "user", "content": "Name the capital of France."}]}
req = u.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"})
c = json.load(u.urlopen(req, timeout=60))["choices"][0]
print("[smoke] answer:", repr(c["message"]["content"]), "| top_logprobs per token:",
      len(c["logprobs"]["content"][0]["top_logprobs"]), "| token_ids:", "token_ids" in c)
metrics = u.urlopen(base + "/metrics", timeout=10).read().decode()
print("\n".join(l for l in metrics.splitlines()
                if l.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))))
PY
else
  echo "[smoke] FAILED to become healthy in $((SECONDS - t0)) s; log tail:"; tail -30 $LOG
fi
kill -TERM -- -$pid 2>/dev/null; sleep 3; kill -KILL -- -$pid 2>/dev/null; gpu_clean
[ $ok = 1 ]
