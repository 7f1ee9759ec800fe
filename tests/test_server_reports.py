"""``openai`` arms record their servers: each arm's server is asked what it declares (``GET
/version``, ``GET /v1/models``), and the finding's environment, activation, engine line and
``same versions`` check read that, not the client. Two arms that differ only in ``url`` are
compared on what their servers declare; a server that declares nothing is *unknown*, never "same
settings as the control". Driven over HTTP against servers on loopback, as a user's run is.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Mount, Route

import helpers_runner as h
from bistat.analysis.summary import analyze_run
from bistat.engines.serve.server import BackgroundServer, create_app
from bistat.report.finding import render_markdown
from bistat.run.runner import start_run
from helpers_serve import VOCAB, ByteTokenizer, FakeEngine

def _server(gemm: str | None, *, version: bool = True) -> Starlette:
    """A ``bistat serve`` application on the fake engine declaring ``gemm``; ``version=False``:
    its ``/version`` answers 404 and its model list says nothing but the id (a server that
    declares nothing about itself)."""
    tok = ByteTokenizer()
    app = create_app(FakeEngine(tok), tok, model_name="fake-model", max_model_len=512,
                     vocab_size=VOCAB, engine_description={"gemm": gemm} if gemm else None)
    if version:
        return app

    async def nothing(request):
        return Response(status_code=404)

    async def models(request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [{"id": "fake-model"}]})

    return Starlette(routes=[Route("/version", nothing), Route("/v1/models", models),
                             Mount("/", app)],
                     lifespan=app.router.lifespan_context)   # starts the engine as app would


def test_bistat_serve_declares_its_gemm_and_version():
    with BackgroundServer(_server(None)) as srv:
        answer = httpx.get(srv.url + "/version").json()
    assert answer == {"version": "0.1.0", "server": "bistat serve", "model": "fake-model",
                      "max_model_len": 512}
    from bistat.engines.embedded.engine import EmbeddedEngine  # noqa: F401 - the real one's gemm

    class Gemm(FakeEngine):
        gemm = "invariant"
        max_batch_size = 8

    tok = ByteTokenizer()
    app = create_app(Gemm(tok), tok, model_name="m", max_model_len=64, vocab_size=VOCAB)
    with BackgroundServer(app) as srv:
        answer = httpx.get(srv.url + "/version").json()
    assert answer == {"version": "0.1.0", "server": "bistat serve", "model": "m",
                      "max_model_len": 64, "engine": "embedded", "gemm": "invariant",
                      "max_batch_size": 8}


def _run(tmp_path, control_app, treatment_app):
    """Register a two-arm ``openai`` declaration on the two servers, run it, analyse it."""
    from bistat.declare.prereg import register

    with BackgroundServer(control_app) as c, BackgroundServer(treatment_app) as t:
        data = h.declaration(
            engine={"kind": "openai", "model": "fake-model",
                    "args": {"retries": 0, "metrics_interval_s": 0}},
            arms=[{"name": "blas", "role": "control", "args": {"url": c.url}},
                  {"name": "invariant", "role": "treatment", "args": {"url": t.url}}],
            workload={"source": "builtin:token-ids?vocab=200", "n_prompts": 6, "passes": 2,
                      "warmup_passes": 0, "max_tokens": 3, "retries": 0},
            validity={"min_mean_running": False})
        (tmp_path / "experiments").mkdir()
        decl = h.write_toml(tmp_path / "experiments" / "fakerun.toml", data)
        reg, _ = register(decl, registrations_dir=tmp_path / "preregistrations")
        outcome = start_run(reg.experiment(), reg.reference(), tmp_path / "run",
                            command=["bistat", "run"])
    assert outcome.status == "complete", outcome.detail
    return analyze_run(tmp_path / "run", reg.path)


def test_two_arms_that_differ_only_in_url_are_compared_on_what_their_servers_declare(tmp_path):
    s = _run(tmp_path, _server("blas"), _server("invariant"))
    reports = {r.arm: (r.describe(), r.settings_text()) for r in s.servers}
    assert reports == {
        "blas": ("bistat serve 0.1.0", "gemm=blas, max_model_len=512, model=fake-model, "
                                       "owned_by=bistat, root=fake-model"),
        "invariant": ("bistat serve 0.1.0", "gemm=invariant, max_model_len=512, "
                                            "model=fake-model, owned_by=bistat, root=fake-model")}
    act = {a.arm: a for a in s.activation}
    assert act["invariant"].requested == ("server gemm=invariant (control's server: blas)",)
    assert act["invariant"].status == "requested; not confirmed by a probe"
    versions = next(v for v in s.validity if v.name == "same versions")
    assert (versions.passed, versions.observed) == (
        True, "blas: bistat serve 0.1.0; invariant: bistat serve 0.1.0")
    md = render_markdown(s)
    assert "Engine: openai → bistat serve 0.1.0 · " in md
    assert "| engine | openai → bistat serve 0.1.0 | openai → bistat serve 0.1.0 |" in md
    assert "| server (as it declares itself) | bistat serve 0.1.0 | bistat serve 0.1.0 |" in md
    assert ("| invariant | treatment | `server gemm=invariant (control's server: blas)` | "
            "bistat serve 0.1.0: gemm=invariant, max_model_len=512, model=fake-model, "
            "owned_by=bistat, root=fake-model | not run | requested; not confirmed by a probe |"
            in md)
    assert "same settings as the control" not in md


def test_a_server_that_declares_nothing_is_unknown_never_the_same_settings(tmp_path):
    s = _run(tmp_path, _server("blas"), _server(None, version=False))
    act = {a.arm: a for a in s.activation}
    assert act["invariant"].status == (
        "unknown: the server of invariant declares nothing (GET /version), so whether this arm "
        "runs other settings than the control cannot be told")
    assert act["invariant"].requested == (
        "server settings unknown (invariant: the server declares nothing)",)
    versions = next(v for v in s.validity if v.name == "same versions")
    assert versions.passed is None
    assert versions.detail == ("the server of arm(s) invariant declares no version (GET "
                               "/version): unknown, so the arms' software cannot be compared")
    md = render_markdown(s)
    assert "Engine: openai → bistat serve 0.1.0, unknown (the server reports nothing) · " in md
    assert "same settings as the control" not in md


@pytest.mark.parametrize("control_gemm", ["invariant"])
def test_two_servers_declaring_the_same_settings_are_the_same_settings(tmp_path, control_gemm):
    s = _run(tmp_path, _server(control_gemm), _server("invariant"))
    act = {a.arm: a for a in s.activation}
    assert (act["invariant"].requested, act["invariant"].status) == (
        (), "same settings as the control")
