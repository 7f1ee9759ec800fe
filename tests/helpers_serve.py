"""Test helpers for ``bistat serve`` and the HTTP/vLLM engine adapters.

- ``FakeEngine``: a continuous-batching engine with the embedded engine's methods (``start``,
  ``submit`` -> Future, ``metrics``, ``step_log``, ``stop``) whose tokens are a deterministic
  function of the prompt, the position and the seed, so every test can predict its output.
- ``ByteTokenizer``: token id = byte + 3 (0 pad, 1 bos, 2 eos), with a tiny chat template.
- Run as a script, this module imitates ``vllm serve MODEL --host H --port P ...``: it prints
  vLLM-like log lines and serves the fake engine through ``bistat.engines.serve.server``. Environment knobs:
  ``FAKE_VLLM_REFUSE=1`` (print a refusal and exit 1), ``FAKE_VLLM_HANG=1`` (never get healthy),
  ``FAKE_VLLM_PIDFILE=PATH`` (write its pid), ``FAKE_VLLM_CHILD=1`` (also start a child process
  in its process group, to check that nothing is orphaned).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import Future

from bistat.engines.base import GenerationRequest, GenerationResult

EOS = 2
VOCAB = 259


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


def _hash(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def expected_token(prompt_ids: list[int], position: int, seed: int | None, temperature: float) -> int:
    """The token the fake generates at ``position``: a lower-case letter (or a space)."""
    h = _hash(sum(prompt_ids), len(prompt_ids), position, seed if temperature > 0 else None)
    return 3 + (32 if h % 7 == 0 else 97 + h % 26)


def expected_logprob(token: int, position: int) -> float:
    return -((_hash(token, position) % 1000) / 500.0) - 0.001


class FakeEngine:
    """Continuous batching: requests join and leave between steps, at most max_batch_size run."""

    def __init__(self, tokenizer: ByteTokenizer | None = None, *, max_batch_size: int = 8,
                 step_s: float = 0.001, eos_after: int | None = None,
                 fail_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.max_batch_size = max_batch_size
        self.step_s = step_s
        self.eos_after = eos_after  # emit EOS after this many tokens (unless ignore_eos)
        self.fail_prompt = fail_prompt  # a text prompt for which the engine returns an error
        self.step_log: list[tuple[float, int]] = []
        self._waiting: collections.deque = collections.deque()
        self._running: list[dict] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._counters = {"num_preemptions_total": 0.0, "generation_tokens_total": 0.0,
                          "prompt_tokens_total": 0.0}
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped += 1
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, req: GenerationRequest) -> Future:
        fut: Future = Future()
        with self._cv:
            self._waiting.append({"req": req, "fut": fut, "t_submit": time.monotonic()})
            self._cv.notify_all()
        return fut

    def metrics(self) -> dict[str, float]:
        with self._cv:
            return {"num_requests_running": float(len(self._running)),
                    "num_requests_waiting": float(len(self._waiting)), **self._counters}

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if isinstance(req.prompt, list):
            return list(req.prompt)
        text = req.prompt
        if req.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait()
                if self._stop:
                    for item in list(self._waiting) + self._running:
                        item["fut"].set_exception(RuntimeError("engine stopped"))
                    self._waiting.clear()
                    self._running.clear()
                    return
                while self._waiting and len(self._running) < self.max_batch_size:
                    item = self._waiting.popleft()
                    item.update(ids=self._prompt_ids(item["req"]), out=[], lps=[], tops=[],
                                t_first=None)
                    self._counters["prompt_tokens_total"] += len(item["ids"])
                    self._running.append(item)
                batch = list(self._running)
            self.step_log.append((time.monotonic(), len(batch)))
            if self.step_s:
                time.sleep(self.step_s)
            done = []
            for item in batch:
                req: GenerationRequest = item["req"]
                if self.fail_prompt is not None and req.prompt == self.fail_prompt:
                    done.append((item, "stop", "injected engine failure"))
                    continue
                pos = len(item["out"])
                tok = expected_token(item["ids"], pos, req.seed, req.temperature)
                if self.eos_after is not None and pos == self.eos_after and not req.ignore_eos:
                    tok = EOS
                lp = expected_logprob(tok, pos)
                alts = [(tok, lp)] + [((tok + j) % VOCAB, lp - j) for j in range(1, req.logprobs)]
                item["out"].append(tok)
                item["lps"].append(lp)
                item["tops"].append(alts)
                if item["t_first"] is None:
                    item["t_first"] = time.monotonic()
                if tok == EOS and not req.ignore_eos:
                    done.append((item, "stop", None))
                elif len(item["out"]) >= req.max_tokens:
                    done.append((item, "length", None))
            with self._cv:
                self._counters["generation_tokens_total"] += len(batch)
                for item, reason, error in done:
                    self._running.remove(item)
            for item, reason, error in done:
                req = item["req"]
                out = [t for t in item["out"]]
                text = self.tokenizer.decode([t for t in out if t != EOS])
                item["fut"].set_result(GenerationResult(
                    prompt_id=req.prompt_id, token_ids=out, text=text, logprobs=item["lps"],
                    top_logprobs=item["tops"], finish_reason=reason,
                    n_prompt_tokens=len(item["ids"]), t_submit=item["t_submit"],
                    t_first_token=item["t_first"], t_done=time.monotonic(), error=error))


def fake_app(**engine_kwargs):
    from bistat.engines.serve.server import create_app

    tok = ByteTokenizer()
    engine = FakeEngine(tok, **engine_kwargs)
    app = create_app(engine, tok, model_name="fake-model", max_model_len=512, vocab_size=VOCAB,
                     engine_description={"gemm": "fake"})
    return app, engine


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fake-vllm")
    parser.add_argument("cmd", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    args, rest = parser.parse_known_args(argv)
    print(f"INFO args: {sys.argv[1:]}", flush=True)
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                "VLLM_BATCH_INVARIANT"):
        print(f"INFO env {key}={os.environ.get(key)}", flush=True)
    if os.environ.get("FAKE_VLLM_PIDFILE"):
        with open(os.environ["FAKE_VLLM_PIDFILE"], "w") as fh:
            fh.write(str(os.getpid()))
    if os.environ.get("FAKE_VLLM_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_VLLM_PIDFILE"] + ".child", "w") as fh:
            fh.write(str(child.pid))
    if os.environ.get("FAKE_VLLM_REFUSE"):
        print("ERROR ValueError: VLLM_BATCH_INVARIANT is not supported on this platform", flush=True)
        return 1
    if os.environ.get("FAKE_VLLM_HANG"):
        time.sleep(600)
        return 0
    if os.environ.get("VLLM_BATCH_INVARIANT") == "1":
        print("INFO Batch invariant mode enabled: overriding matmul kernels", flush=True)
    print("INFO Using FLASH_ATTN attention backend.", flush=True)
    from bistat.engines.serve.server import create_app, serve

    tok = ByteTokenizer()
    app = create_app(FakeEngine(tok), tok, model_name=args.served_model_name or args.model,
                     max_model_len=512, vocab_size=VOCAB)
    serve(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
