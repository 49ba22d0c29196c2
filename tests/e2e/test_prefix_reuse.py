"""Greedy output with prefix reuse == output with --no-prefix-cache, on the built-in Gemma 3
270M (sliding-window attention), requests sent one after another."""

from __future__ import annotations

import openai
import pytest

# Minutes on 2 cores (each answer is computed twice, on servers of their own): not everyday.
pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a meticulous assistant for a small bakery. You know the opening hours (8 to 6), "
    "the menu (bread, croissants, cakes, coffee) and the prices. Answer in one sentence. "
) * 14  # longer than Gemma 3's 512-token sliding window once templated


@pytest.fixture(scope="module")
def clients(server, server_no_cache):
    def make(url):
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    return make(server), make(server_no_cache)


def _chat(client, messages, **kw):
    r = client.chat.completions.create(
        model="x", messages=messages, max_tokens=24, temperature=0, **kw
    )
    return r


def test_identical_prompts_reuse_and_match(clients):
    cached, fresh = clients
    msgs = [{"role": "user", "content": "Write a haiku about bread."}]
    want = _chat(fresh, msgs).choices[0].message.content
    first = _chat(cached, msgs)
    second = _chat(cached, msgs)
    assert first.choices[0].message.content == want == second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_shared_system_prompt_reuses_and_matches(clients):
    cached, fresh = clients
    hits = []
    for q in ("When do you open?", "Do you sell coffee?", "How much is a croissant?"):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        got = _chat(cached, msgs)
        assert got.choices[0].message.content == _chat(fresh, msgs).choices[0].message.content
        hits.append(got.usage.prompt_tokens_details.cached_tokens)
    assert hits[1] > 512 and hits[2] > 512  # the whole system prompt, past the window


def test_five_turn_conversation_reuses_and_matches(clients):
    cached, fresh = clients
    msgs = [{"role": "system", "content": SYSTEM}]
    for turn, q in enumerate(
        ["Hello!", "What bread do you have?", "And cakes?", "Is there coffee?", "Thanks, bye."]
    ):
        msgs.append({"role": "user", "content": q})
        got = _chat(cached, msgs)
        want = _chat(fresh, msgs)
        assert got.choices[0].message.content == want.choices[0].message.content, turn
        if turn:
            assert got.usage.prompt_tokens_details.cached_tokens > 0
        msgs.append({"role": "assistant", "content": got.choices[0].message.content})


def test_n_forks_share_the_prefill_and_match(clients):
    cached, fresh = clients
    msgs = [{"role": "user", "content": "Name a kind of cake."}]
    got = _chat(cached, msgs, n=3)
    want = _chat(fresh, msgs).choices[0].message.content
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [want] * 3
    # sampled forks differ from each other but each is reproducible with the same seed
    a = _chat(cached, msgs, n=2, seed=7, extra_body={"temperature": 1.0})
    b = _chat(cached, msgs, n=2, seed=7, extra_body={"temperature": 1.0})
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
