"""Logprobs: entries whose texts add up exactly to the output, through the engine and the API."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.engine.contracts import TokenLogprobs
from ferrum.engine.logprobs import LogprobTracker
from ferrum.engine.text import TextPipeline
from tests.factories import fake_app, fake_engine, run_to_completion, sampling
from tests.profiles import examples

# A vocabulary of multi-byte pieces: tokens split characters, stop strings straddle tokens.
PIECES = ["a", "b", "ab", "é".encode()[:1], "é".encode()[1:], "€".encode(), " x", "!"]


def _piece(token: int) -> bytes:
    p = PIECES[token]
    return p if isinstance(p, bytes) else p.encode()


def _run(tokens: list[int], stop: list[str]) -> tuple[str, list[str]]:
    """Feeds tokens as the engine does; returns the content and the logprob entries' texts."""
    pipe = TextPipeline(_piece, stop, split_think=False)
    tracker = LogprobTracker()
    content, texts = [], []
    for t in tokens:
        delta = pipe.feed_token(t)
        content.append(delta.content)
        tracker.add(TokenLogprobs(t, -1.0), delta.raw)
        texts += [e.text for e in tracker.release(pipe.released_chars, pipe.mid_character)]
        if delta.stopped:
            break
    tail = pipe.finish()
    content.append(tail.content)
    tracker.extend_last(tail.raw)
    texts += [e.text for e in tracker.finish(pipe.released_chars)]
    return "".join(content), texts


@settings(max_examples=examples(300), deadline=None)
@given(
    tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=30),
    stop=st.lists(st.sampled_from(["b", "ab!", "é x", "x!", "€€"]), max_size=2),
)
def test_entry_texts_concatenate_to_the_content(tokens, stop):
    content, texts = _run(tokens, stop)
    assert "".join(texts) == content
    assert len(texts) <= len(tokens)


def test_a_token_inside_a_character_carries_nothing_and_the_next_the_character():
    # "é" is split over tokens 3 and 4.
    assert _run([0, 3, 4, 1], []) == ("aéb", ["a", "", "é", "b"])


def test_a_stop_string_cuts_the_straddling_token_and_drops_the_rest():
    # stop "b x": tokens "a" "ab" " x" "!" → content "aa"; "ab" keeps "a", " x" is dropped
    assert _run([0, 2, 6, 7], ["b x"]) == ("aa", ["a", "a"])


def test_engine_reports_logprobs_only_when_asked():
    engine = fake_engine()
    engine.add_request("plain", [1, 2, 3], sampling(max_tokens=5))
    engine.add_request("lp", [1, 2, 3], sampling(max_tokens=5, logprobs=2))
    results = run_to_completion(engine)
    assert results["plain"]["final"].logprobs is None
    # run_to_completion keeps only the final output's entries; rerun collecting all of them
    engine = fake_engine()
    engine.add_request("lp", [1, 2, 3], sampling(max_tokens=5, logprobs=2))
    entries = []
    while engine.has_work:
        for out in engine.step():
            entries += out.logprobs or []
    assert [e.token for e in entries] == results["lp"]["tokens"]
    assert "".join(e.text for e in entries) == results["lp"]["content"]
    assert all(len(e.top) == 2 for e in entries)


@pytest.fixture
def client():
    with TestClient(fake_app()) as c:
        yield c


def _chat(**kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    return {**body, **kw}


def test_chat_logprobs_whole_and_streamed(client):
    whole = client.post("/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=3)).json()
    choice = whole["choices"][0]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for e in entries:
        assert bytes(e["bytes"]).decode() == e["token"] and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 3
        assert set(e["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    body = _chat(logprobs=True, top_logprobs=3, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [
        e for ev in events for c in ev["choices"] for e in (c["logprobs"] or {}).get("content", [])
    ]
    assert streamed == entries


def test_chat_without_logprobs_has_null_logprobs(client):
    r = client.post("/v1/chat/completions", json=_chat(logprobs=False, top_logprobs=None))
    assert r.json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_shape(client):
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]


def test_stop_token_ids_end_the_output_without_showing_the_token(client):
    free = client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0}
    )
    text = free.json()["choices"][0]["text"]
    stop_char = text[3]
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop_token_ids": [ord(stop_char)]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == text[: text.index(stop_char)]
    assert choice["finish_reason"] == "stop"
