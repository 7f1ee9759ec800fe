"""Settings for the whole test suite.

The tests never reach the network: bistat's newest-release checks (``bistat.declare.releases``, made at
registration, at the start of a vLLM run and by ``bistat doctor``) record "not checked" with
``BISTAT_PACKAGE_INDEX=off``, which subprocesses inherit too; the tests of the check itself pass
an ``httpx.MockTransport``.
"""

import os

os.environ["BISTAT_PACKAGE_INDEX"] = "off"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random LLaMA with SmolLM2's tokenizer on disk (``faults_support``), for the tests
    that drive bistat through its CLI; they skip when SmolLM2 is not cached."""
    import faults_support as s

    source = s.smollm2_folder()
    if source is None:
        pytest.skip("smollm2-135m is not cached (its tokenizer is needed): bistat model fetch smollm2-135m")
    return str(s.build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", source))


@pytest.fixture(autouse=True)
def _engine_kinds_as_before():
    """Engine kinds a test registers (``tests/fakes.py``'s ``fake``, a test adapter) end with it:
    a later test's expected "expected one of ..." message must not depend on which tests ran
    before it (``test_experiment`` failed after ``test_register_checks`` and ``test_prereg``)."""
    from bistat.engines import registry

    kinds, adapters = dict(registry.ENGINE_KINDS), dict(registry.ADAPTERS)
    yield
    for live, saved in ((registry.ENGINE_KINDS, kinds), (registry.ADAPTERS, adapters)):
        live.clear()
        live.update(saved)
