"""OpenAIHTTPEngine through ``bistat serve``'s app over the real embedded engine (tiny random
model): the HTTP path returns bitwise the same tokens and logprobs as the engine in-process."""

from __future__ import annotations

from bistat.engines.embedded.engine import EmbeddedEngine
from bistat.engines.base import GenerationRequest
from bistat.engines.openai_http import OpenAIHTTPEngine
from bistat.model.testing import tiny_random_model
from bistat.engines.serve.server import BackgroundServer, create_app


def test_http_results_equal_in_process_results_in_invariant_mode():
    model = tiny_random_model(0, tokenizer="byte")
    engine = EmbeddedEngine(model, gemm="invariant", max_batch_size=8, max_model_len=128)
    app = create_app(engine, model.tokenizer, model_name="tiny", max_model_len=128,
                     vocab_size=int(model.config.vocab_size))
    reqs = [GenerationRequest(prompt_id=f"p{i}", prompt=[1] + [5 + i, 9, 12 + i], max_tokens=6,
                              logprobs=2, ignore_eos=True) for i in range(6)]
    with BackgroundServer(app) as srv:
        direct = {r.prompt_id: engine.submit(r).result(timeout=60) for r in reqs}
        client = OpenAIHTTPEngine(srv.url)
        client.start()
        results, samples = [], []
        client.run_pass(reqs, concurrency=6, on_result=results.append, on_metrics=samples.append)
    assert len(results) == 6
    for r in results:
        d = direct[r.prompt_id]
        assert r.error is None
        assert r.token_ids == d.token_ids and len(r.token_ids) == 6
        assert r.logprobs == d.logprobs  # float64 round trip through JSON is exact
        assert [t[:2] for t in r.top_logprobs] == [sorted(t, key=lambda p: -p[1])[:2] for t in d.top_logprobs]
    assert samples[-1].generation_tokens_total == 2 * 6 * 6
