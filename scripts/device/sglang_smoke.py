"""Device side (PAYLOAD=sglang, after install.sh): SGLang 0.5.23 serves SmolLM2 and answers, once with
its default settings and once with ``--enable-deterministic-inference``, through bistat's own
``sglang-server`` adapter (start, /health_generate, /model_info, /server_info, one chat request
over /generate with token ids and logprobs, stop). Prints the versions, the attention backend and
the deterministic flag each server reports, the answer, and the start time; writes
``$OUT/sglang_smoke.json``. Exit 1 if either mode failed.

    . scripts/device/env.sh && python3 scripts/device/sglang_smoke.py [MODEL] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from bistat.engines.base import GenerationRequest  # noqa: E402
from bistat.engines.sglang_server import SGLangServerEngine  # noqa: E402

MODES = {"default": {}, "deterministic": {"enable_deterministic_inference": True}}


def smoke(model: str, mode: str, timeout_s: float, out: Path) -> dict:
    engine = SGLangServerEngine(model, args={**MODES[mode], "mem_fraction_static": 0.3,
                                             "max_running_requests": 8},
                                health_timeout_s=timeout_s, stop_grace_s=20,
                                log_path=out / f"sglang_smoke_{mode}.log",
                                http={"retries": 0, "metrics_interval_s": 0})
    t0 = time.monotonic()
    record: dict = {"mode": mode}
    try:
        info = engine.start()
        record.update(start_s=round(time.monotonic() - t0, 1), version=info.version,
                      commit=info.commit, versions=info.args["versions"],
                      server_reported=info.args["server_reported"],
                      log_findings=list(info.log_findings)[-8:])
        results = []
        engine.run_pass([GenerationRequest(prompt_id="capital", prompt="What is the capital of "
                                           "France?", max_tokens=16, logprobs=2, chat=True)],
                        concurrency=1, on_result=results.append, on_metrics=lambda s: None)
        (r,) = results
        record.update(error=r.error, text=r.text, token_ids=r.token_ids,
                      logprobs=r.logprobs, finish_reason=r.finish_reason)
    except Exception as exc:  # noqa: BLE001 - the smoke test reports every failure
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.stop()
    record["ok"] = record.get("error") is None
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="/tmp/model/smollm2")
    ap.add_argument("--timeout", type=float, default=400.0)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    try:  # the card the smoke test ran on: name, UUID, serial, driver
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,serial,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except OSError as exc:
        gpu = f"nvidia-smi: {exc}"
    print(f"[sglang-smoke] GPU: {gpu}", flush=True)
    records = [{"gpu": gpu, **smoke(args.model, mode, args.timeout, out)} for mode in MODES]
    for r in records:
        print(f"[sglang-smoke] {r['mode']}: {'OK' if r['ok'] else 'FAILED'} "
              + json.dumps({k: v for k, v in r.items() if k not in ("mode", "ok", "gpu")})[:1500])
    (out / "sglang_smoke.json").write_text(json.dumps(records, indent=1) + "\n")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
