"""Prompt sources and per-pass request orders."""

from __future__ import annotations

import json

import pytest

from bistat.run.workload import (
    CHAT_CAPACITY,
    WorkloadError,
    load_prompts,
    pass_order,
    prompt_seed,
    requests_for_pass,
)


def test_builtin_chat_has_1200_distinct_prompts_and_is_deterministic():
    prompts = load_prompts("builtin:chat", CHAT_CAPACITY, seed=0)
    assert CHAT_CAPACITY == 1200
    assert len({p.prompt for p in prompts}) == 1200
    assert len({p.prompt_id for p in prompts}) == 1200
    assert all(p.chat for p in prompts)
    assert [p.prompt for p in load_prompts("builtin:chat", 3, seed=99)] == [
        "Explain photosynthesis to a ten-year-old.",
        "List five questions a curious person might ask about the French Revolution, with short answers.",
        "Tell me a surprising story involving black holes.",
    ]
    assert prompts[40].prompt == "What are the three most important facts about photosynthesis?"


def test_builtin_chat_first_prompts_vary_in_template():
    prompts = load_prompts("builtin:chat", 40, seed=0)
    templates = {p.prompt.split(" ")[0] for p in prompts}
    assert len(templates) >= 10


def test_builtin_chat_too_many_prompts():
    with pytest.raises(WorkloadError) as exc:
        load_prompts("builtin:chat", 1201, seed=0)
    assert str(exc.value) == (
        "builtin:chat: n_prompts = 1201 but the built-in chat source holds 1200 distinct prompts; "
        "lower workload.n_prompts or use a file:PATH.jsonl source")


def test_token_ids_are_seeded_prefix_stable_and_in_range():
    a = load_prompts("builtin:token-ids?length=8&vocab=50&low=5", 6, seed=3)
    b = load_prompts("builtin:token-ids?length=8&vocab=50&low=5", 3, seed=3)
    assert [p.prompt for p in a[:3]] == [p.prompt for p in b]
    assert all(len(p.prompt) == 8 and all(5 <= t < 50 for t in p.prompt) for p in a)
    assert not any(p.chat for p in a)
    c = load_prompts("builtin:token-ids?length=8&vocab=50&low=5", 3, seed=4)
    assert [p.prompt for p in c] != [p.prompt for p in b]
    assert len(load_prompts("builtin:token-ids", 1, seed=0)[0].prompt) == 32


@pytest.mark.parametrize("source, message", [
    ("builtin:token-ids?len=3", "builtin:token-ids?len=3: unknown parameter 'len'; expected one of 'length', 'vocab', 'low'"),
    ("builtin:token-ids?vocab=x", "builtin:token-ids?vocab=x: parameter 'vocab' must be an integer, got 'x'"),
    ("builtin:token-ids?low=10&vocab=10", "builtin:token-ids?low=10&vocab=10: need 0 <= low < vocab, got low=10, vocab=10; set vocab to the model's vocabulary size"),
    ("builtin:poems", "workload.source: unknown source 'builtin:poems'; expected one of 'builtin:chat', 'builtin:token-ids', 'file:PATH.jsonl'"),
])
def test_bad_sources(source, message):
    with pytest.raises(WorkloadError) as exc:
        load_prompts(source, 2, seed=0)
    assert str(exc.value) == message


def test_file_source_reads_all_three_kinds(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"id": "a", "prompt": "raw text"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
        + json.dumps({"id": 7, "token_ids": [1, 2, 3]}) + "\n"
        + json.dumps({"id": "unused", "prompt": "x"}) + "\n",
        encoding="utf-8")
    prompts = load_prompts("file:p.jsonl", 3, seed=0, base_dir=tmp_path)
    assert [(p.prompt_id, p.index, p.prompt, p.chat) for p in prompts] == [
        ("a", 0, "raw text", False), ("1", 1, "hi", True), ("7", 2, (1, 2, 3), False)]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a"}', '{"prompt": '], "p.jsonl:2: not valid JSON (Expecting value at column 12)"),
    (['["a"]'], "p.jsonl:1: expected a JSON object, got list"),
    (['{"prompt": "a", "token_ids": [1]}'], "p.jsonl:1: expected exactly one of 'prompt', 'messages', 'token_ids', got 'prompt', 'token_ids'"),
    (['{"id": "x"}'], "p.jsonl:1: expected exactly one of 'prompt', 'messages', 'token_ids', got none"),
    (['{"prompt": "a", "extra": 1}'], "p.jsonl:1: unknown field(s) 'extra'; allowed: 'id', 'prompt', 'messages', 'token_ids'"),
    (['{"token_ids": [1, -2]}'], "p.jsonl:1: 'token_ids' must be a non-empty list of non-negative integers"),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "p.jsonl:2: duplicate id 'a' (first on line 1); ids must be unique"),
    (['{"messages": [{"role": "system", "content": "x"}]}'], """p.jsonl:1: 'messages' must hold exactly one {"role": "user", "content": "..."} message; for other conversations apply the chat template yourself and use 'prompt'"""),
    (['{"prompt": "a"}'], "p.jsonl: holds 1 prompts but workload.n_prompts = 2; add prompts or lower n_prompts"),
])
def test_file_source_errors_name_file_and_line(tmp_path, lines, message):
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(WorkloadError) as exc:
        load_prompts("file:p.jsonl", 2, seed=0, base_dir=tmp_path)
    assert str(exc.value) == message


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError) as exc:
        load_prompts("file:nope.jsonl", 1, seed=0, base_dir=tmp_path)
    assert str(exc.value) == "nope.jsonl: prompt file not found; check workload.source"


def test_pass_orders_differ_between_passes_and_arms_and_are_reproducible():
    a0 = pass_order(64, seed=0, arm="blas", pass_index=0, shuffle=True)
    assert sorted(a0) == list(range(64))
    assert a0 == pass_order(64, seed=0, arm="blas", pass_index=0, shuffle=True)
    assert a0 != pass_order(64, seed=0, arm="blas", pass_index=1, shuffle=True)
    assert a0 != pass_order(64, seed=0, arm="invariant", pass_index=0, shuffle=True)
    assert a0 != pass_order(64, seed=1, arm="blas", pass_index=0, shuffle=True)
    assert pass_order(5, seed=0, arm="blas", pass_index=3, shuffle=False) == [0, 1, 2, 3, 4]


def test_requests_carry_explicit_sampling_settings_and_per_prompt_seeds():
    prompts = load_prompts("builtin:chat", 8, seed=0)
    r1 = requests_for_pass(prompts, seed=5, arm="a", pass_index=0, shuffle=True, max_tokens=9,
                           temperature=0.7, top_p=0.9, top_k=40, ignore_eos=True)
    r2 = requests_for_pass(prompts, seed=5, arm="b", pass_index=4, shuffle=True, max_tokens=9,
                           temperature=0.7, top_p=0.9, top_k=40, ignore_eos=True)
    assert {r.prompt_id for r in r1} == {p.prompt_id for p in prompts}
    assert [r.prompt_id for r in r1] != [r.prompt_id for r in r2]
    seeds1 = {r.prompt_id: r.seed for r in r1}
    assert seeds1 == {r.prompt_id: r.seed for r in r2}  # same seed per prompt in every pass and arm
    assert len(set(seeds1.values())) == 8
    assert all((r.max_tokens, r.temperature, r.top_p, r.top_k, r.ignore_eos, r.chat, r.logprobs)
               == (9, 0.7, 0.9, 40, True, True, 1) for r in r1)
    assert prompt_seed(5, 0) == seeds1["chat-0000"]


def test_output_lengths_uniform_in_the_declared_range_and_the_same_in_every_pass_and_arm():
    from bistat.run.workload import load_prompts, requests_for_pass

    prompts = load_prompts("builtin:token-ids", 400, 0)
    common = dict(seed=0, shuffle=True, max_tokens=110, temperature=0.0, top_p=1.0, top_k=-1,
                  ignore_eos=True, max_tokens_min=90)
    a = {r.prompt_id: r.max_tokens for r in requests_for_pass(prompts, arm="a", pass_index=0, **common)}
    b = {r.prompt_id: r.max_tokens for r in requests_for_pass(prompts, arm="b", pass_index=3, **common)}
    assert a == b
    lengths = sorted(a.values())
    assert lengths[0] == 90 and lengths[-1] == 110 and len(set(lengths)) == 21
    # uniform: each of the 21 lengths about 400/21 = 19 times (a loose band, seeded draw)
    counts = [lengths.count(n) for n in range(90, 111)]
    assert min(counts) >= 7 and max(counts) <= 35
    fixed = requests_for_pass(prompts, arm="a", pass_index=0, **{**common, "max_tokens_min": None})
    assert {r.max_tokens for r in fixed} == {110}
