"""`ferrum cluster`'s application on a local Ray instance: two replicas of the default chat
model, one thread each, as on this project's 2-core machines.

The tests share one application, in order: routing and the APIs first, then a replica
killed mid-stream, then a scale-down (the last, since it changes the deployment).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ferrum.bench.process import free_port  # noqa: E402
from ferrum.cluster.app import build_app  # noqa: E402
from ferrum.cluster.settings import ClusterConfig, ClusterSettings  # noqa: E402
from ferrum.config import EngineConfig, ModelsConfig, ServerConfig  # noqa: E402

MODEL = "smollm2-135m-instruct"


def settings_for(folder: str, replicas: int) -> ClusterSettings:
    return ClusterSettings(
        engine=EngineConfig(threads=1, ctx_size=2048, parallel=4, cache_dir=f"{folder}/kv"),
        server=ServerConfig(),
        models=ModelsConfig(model=(MODEL,), models_dir=f"{folder}/models"),
        cluster=ClusterConfig(replicas=replicas, stats_period=0.5, drain_timeout=120),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, Any]]:
    folder = str(tmp_path_factory.mktemp("cluster"))
    port = free_port()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=128 * 1024 * 1024,
        logging_level="WARNING",
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings_for(folder, 2)), name="ferrum", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(url, 2)
        yield {"url": url, "folder": folder}
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for_replicas(url: str, n: int, timeout: float = 90.0, without: str = "") -> dict[str, Any]:
    """/health once it shows n replicas posting (none of them `without`)."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = httpx.get(url + "/health", timeout=10)
        body = r.json()
        if r.status_code == 200 and len(body["replicas"]) == n and without not in body["replicas"]:
            return body
        time.sleep(0.5)
    raise AssertionError(f"{n} healthy replicas not seen: {body}")


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_a_conversation_stays_on_the_replica_that_holds_it(cluster):
    url = cluster["url"]
    for conv in range(6):
        messages = [
            {"role": "system", "content": f"You are assistant {conv}. " + "Answer briefly. " * 8},
            {"role": "user", "content": f"Say something about the number {conv}."},
        ]
        first, held = None, 0
        for turn in range(3):
            r = chat(url, messages)
            assert r.status_code == 200, r.text
            replica = r.headers["x-ferrum-replica"]
            usage = r.json()["usage"]
            if first is None:
                first = replica
            else:
                assert replica == first, f"conversation {conv} turn {turn} moved"
                # everything but the last sampled token of the turn before was held
                assert usage["prompt_tokens_details"]["cached_tokens"] >= held - 1
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "More?"}]
            held = usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_apis_and_their_errors_pass_through(cluster):
    url = cluster["url"]
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"

    bad = chat(url, "not a list")  # type: ignore[arg-type]
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "messages"

    bad_ollama = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": 5}, timeout=30)
    assert bad_ollama.status_code == 400 and isinstance(bad_ollama.json()["error"], str)

    ollama = httpx.post(
        url + "/api/chat",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": False,
            "options": {"num_predict": 4},
        },
        timeout=60,
    )
    assert ollama.status_code == 200 and ollama.json()["done"] is True

    anthropic = httpx.post(
        url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert anthropic.status_code == 200 and anthropic.json()["type"] == "message"
    no_tokens = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": []}, timeout=30)
    assert no_tokens.status_code == 400 and no_tokens.json()["type"] == "error"

    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]] == [MODEL]
    # The ingress has no docs of its own (they were served without a key): a replica's are
    # relayed, behind its gate like every route.
    assert httpx.get(url + "/openapi.json", timeout=30).json()["info"]["title"] == "ferrum"


def test_a_responses_conversation_finds_its_stored_history(cluster):
    """The history of previous_response_id lives on one replica: every continuation (and a
    GET of the response) must reach it, whatever the load."""
    url = cluster["url"]
    r = httpx.post(
        url + "/v1/responses",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    for _ in range(5):
        previous = r.json()["id"]
        r = httpx.post(
            url + "/v1/responses",
            json={
                "model": MODEL,
                "input": "And?",
                "previous_response_id": previous,
                "max_output_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert httpx.get(url + f"/v1/responses/{previous}", timeout=30).status_code == 200


def test_metrics_and_health_cover_every_replica(cluster):
    url = cluster["url"]
    health = wait_for_replicas(url, 2)
    assert all(h["model"] == MODEL for h in health["replicas"].values())
    text = httpx.get(url + "/metrics", timeout=30).text
    labelled = {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if 'replica="' in line
    }
    assert labelled == set(health["replicas"])


def test_the_dashboard_is_served_by_the_ingress(cluster):
    url = cluster["url"]
    wait_for_replicas(url, 2)
    page = httpx.get(url + "/dashboard", timeout=30)
    assert page.status_code == 200 and "/web/dashboard.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(url + "/web/dashboard.js", timeout=30).status_code == 200
    # /props and /slots: every replica's, merged from what each posted to the board.
    health = wait_for_replicas(url, 2)
    deadline = time.monotonic() + 30
    while True:
        props = httpx.get(url + "/props", params={"model": MODEL}, timeout=30).json()
        if len(props.get("replicas", ())) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {p["replica"] for p in props["replicas"]} == set(health["replicas"])
    assert props["total_slots"] == sum(p["total_slots"] for p in props["replicas"])
    slots = httpx.get(url + "/slots", timeout=30).json()
    assert {s["replica"] for s in slots} == set(health["replicas"])
    assert all(s["prompt"] == "" for s in slots)


def _stream_until_error(url: str) -> tuple[list[str], dict[str, str]]:
    body = {
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        headers = dict(r.headers)
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                os.kill(int(headers["x-ferrum-replica-pid"]), signal.SIGKILL)
    return events, headers


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error(cluster):
    url = cluster["url"]
    started = time.monotonic()
    events, headers = _stream_until_error(url)
    killed = headers["x-ferrum-replica"].rsplit("#", 1)[-1]
    assert time.monotonic() - started < 60  # never a hang
    last = json.loads(events[-1].removeprefix("data: "))
    assert "error" in last and "replica" in last["error"]["message"]
    # New requests go to the replica left while Ray restarts the other.
    for i in range(4):
        r = chat(url, [{"role": "user", "content": f"Still there? {i}"}])
        assert r.status_code == 200, r.text
    wait_for_replicas(url, 2, timeout=120, without=killed)  # Ray started another


@pytest.mark.slow
def test_a_scale_down_finishes_the_requests_of_the_replica_removed(cluster):
    url = cluster["url"]

    def one(i: int) -> httpx.Response:
        # A system prompt of its own from the first block (the template's default one would
        # be a shared prefix): nothing to follow, so the router spreads them by load.
        messages = [
            {"role": "system", "content": f"{i} is the number of this story."},
            {"role": "user", "content": "Write it."},
        ]
        body = {"messages": messages, "max_tokens": 120, "ignore_eos": True, "temperature": 0}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = []
        for i in range(6):  # a little apart: each is counted in flight before the next
            answers.append(pool.submit(one, i))
            time.sleep(0.3)
        time.sleep(1.0)  # every request is running somewhere
        serve.run(build_app(settings_for(cluster["folder"], 1)), name="ferrum", route_prefix="/")
        results = [a.result() for a in answers]
    assert len({r.headers["x-ferrum-replica"] for r in results}) == 2  # both replicas served
    for r in results:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 120
    deadline = time.monotonic() + 60
    while len(httpx.get(url + "/health", timeout=10).json()["replicas"]) != 1:
        assert time.monotonic() < deadline, "the removed replica still reports"
        time.sleep(1)
