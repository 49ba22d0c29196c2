"""N-gram speculation on Gemma 3 270M, a sliding-window model, through the server: a request
that copies a passage verifies guesses, keeps most of them, and is answered whole; the window
cache never fails a decode (a lost window would end the request with an error)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import running_server

PASSAGE = (
    "The preparation thread takes turns at the cores with the engines. Between two engine "
    "steps it prepares what is waiting, for at most a share of an engine step's time, then "
    "gives the cores back. A running stream's gap grows by at most that share. "
)


@pytest.fixture(scope="module")
def speculating(tmp_path_factory) -> Iterator[str]:
    with running_server(tmp_path_factory, "speculating", "--spec-type", "ngram") as url:
        yield url


def _counter(metrics: str, name: str) -> float:
    found = re.findall(rf"^{name}_total{{[^}}]*}} ([0-9.e+]+)$", metrics, re.M)
    return sum(float(v) for v in found)


def test_a_copy_is_guessed_verified_and_answered_whole(speculating):
    prompt = f"Copy this text exactly.\n\nText: {PASSAGE * 3}\n\nCopy: {PASSAGE[:60]}"
    with httpx.Client(base_url=speculating, timeout=120) as http:
        answers = [
            http.post("/v1/completions", json={
                "model": "gemma3-270m", "prompt": prompt, "max_tokens": 64,
                "temperature": 0, "ignore_eos": True,
            }).json()
            for _ in range(2)
        ]  # fmt: skip
        metrics = http.get("/metrics").text
    for answer in answers:
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == 64
    drafted = _counter(metrics, "ferrum_spec_draft_tokens")
    accepted = _counter(metrics, "ferrum_spec_accepted_tokens")
    assert drafted > 0 and accepted > drafted / 2, (drafted, accepted)
