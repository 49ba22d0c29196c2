"""The prefix cache's RAM and disk tiers through a real server on the default chat model
(SmolLM2): a conversation pushed out of a small KV pool comes back from RAM, and a server
restarted on the same cache folder answers a repeated long prompt from disk.

Oracle: a restored state holds the very bytes that were computed, so a restored request
gives the same text and logprobs as one that reuses the same prompt still resident (both
recompute only the last prompt token). Against a fresh prefill the difference is batch-shape
noise (that last token computed alone rather than in a batch of 500): measured here at
0.07 nats on the first token's logprob; the first token itself agrees.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import running_server

# Two servers of its own and minutes on 2 cores: not everyday.
pytestmark = pytest.mark.slow

SMOLLM2 = ("smollm2-135m-instruct",)
# 1,024 cells: two of these ~530-token prompts fit, a third pushes the oldest out. No
# speculation: its verification batches would add batch-shape noise of their own.
FLAGS = ("--ctx-size", "1024", "--parallel", "2", "--spec-type", "none")
TOPICS = ["bridges", "rivers", "mills"]


def _prompt(topic: str) -> str:
    notes = " ".join(f"Note {i} on {topic}: stone, water and time shape every old {topic}."
                     for i in range(30))  # fmt: skip
    return f"<|im_start|>user\n{notes}\nSummarise the notes.<|im_end|>\n<|im_start|>assistant\n"


def _complete(url: str, topic: str) -> dict[str, Any]:
    body = {"model": "x", "prompt": _prompt(topic), "max_tokens": 16, "temperature": 0,
            "logprobs": 1}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return {
        "text": choice["text"],
        "first_logprob": choice["logprobs"]["token_logprobs"][0],
        "first_token": choice["logprobs"]["tokens"][0],
        "prompt_tokens": usage["prompt_tokens"],
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def _same_answer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["text"] == b["text"] and a["first_logprob"] == b["first_logprob"]


@pytest.fixture(scope="module")
def ram_run(tmp_path_factory) -> dict[str, Any]:
    """One server: a prompt fresh, again while resident, then pushed out, then restored."""
    with running_server(tmp_path_factory, "ram", *FLAGS, "--cache-disk", "0",
                        models=SMOLLM2) as url:  # fmt: skip
        fresh = _complete(url, TOPICS[0])
        resident = _complete(url, TOPICS[0])
        for topic in TOPICS[1:]:
            _complete(url, topic)
        restored = _complete(url, TOPICS[0])
        health = httpx.get(f"{url}/health").json()
    return {"fresh": fresh, "resident": resident, "restored": restored, "health": health}


def test_an_evicted_prompt_comes_back_from_ram(ram_run) -> None:
    resident, restored = ram_run["resident"], ram_run["restored"]
    assert resident["cached"] == restored["cached"] == restored["prompt_tokens"] - 1
    assert _same_answer(restored, resident)
    tiers = ram_run["health"]["prefix_cache"]["tiers"]
    assert tiers["restores"] == 1 and tiers["ram"]["hits"] == 1 and tiers["failures"] == 0


def test_restored_against_fresh_is_within_batch_shape_noise(ram_run) -> None:
    fresh, restored = ram_run["fresh"], ram_run["restored"]
    assert fresh["first_token"] == restored["first_token"]
    assert abs(fresh["first_logprob"] - restored["first_logprob"]) < 0.2


def test_a_restarted_server_answers_from_disk(tmp_path_factory, ram_run) -> None:
    folder = tmp_path_factory.mktemp("kv")
    flags = (*FLAGS, "--cache-dir", str(folder))
    with running_server(tmp_path_factory, "before", *flags, models=SMOLLM2) as url:
        _complete(url, TOPICS[0])
    assert list(folder.rglob("*.kv")), "nothing saved at shutdown"
    with running_server(tmp_path_factory, "after", *flags, models=SMOLLM2) as url:
        again = _complete(url, TOPICS[0])
        tiers = httpx.get(f"{url}/health").json()["prefix_cache"]["tiers"]
    assert again["cached"] == again["prompt_tokens"] - 1
    assert _same_answer(again, ram_run["resident"])
    assert tiers["disk"]["hits"] == 1 and tiers["failures"] == 0
