"""The browser pages' routes and the llama-server introspection routes they read (/slots,
/props), over the fake app: who may load what, and what a listing never shows."""

from __future__ import annotations

import json
import threading
import time

from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from ferrum.web import page_answer, read_static
from tests.factories import FakeRunner, fake_app

KEY, OTHER = "k-one", "k-two"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_pages_and_their_files_are_served_with_a_strict_policy():
    with TestClient(fake_app()) as c:
        html = {"Accept": "text/html,application/xhtml+xml"}
        chat, dash = c.get("/", headers=html), c.get("/dashboard")
        assert chat.status_code == dash.status_code == 200
        assert chat.headers["content-type"].startswith("text/html")
        assert '<script src="/web/chat.js">' in chat.text and "/web/dashboard.js" in dash.text
        policy = chat.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy
        # Attached images show as data: URIs; images from anywhere else stay blocked.
        assert "img-src 'self' data:;" in policy
        js = c.get("/web/chat.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert c.get("/web/style.css").headers["content-type"].startswith("text/css")
        missing = c.get("/web/../app.py")
        assert missing.status_code == 404 and "error" in missing.json()
        assert c.get("/web/nothing.js").status_code == 404
        # A client that is no browser still gets the Ollama API's answer at `/`.
        assert c.get("/").text.startswith("ferrum is running")


def test_no_webui_turns_both_pages_off():
    with TestClient(fake_app(webui=False)) as c:
        for path in ("/dashboard", "/web/chat.js"):
            assert c.get(path).status_code == 404, path
        chat = c.get("/", headers={"Accept": "text/html"})
        assert chat.headers["content-type"].startswith("text/plain")  # no chat page
        assert c.get("/v1/models").status_code == 200


def test_with_keys_the_pages_load_but_every_route_they_read_asks_for_the_key():
    with TestClient(fake_app(keys=Keys((KEY,)))) as c:
        page = c.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "chat.js" in page.text
        assert c.get("/web/common.js").status_code == 200
        for path in ("/v1/models", "/slots", "/props", "/metrics"):
            assert c.get(path).status_code == 401, path
        assert c.get("/slots", headers=_bearer(KEY)).status_code == 200
        assert c.get("/props", headers=_bearer(KEY)).status_code == 200


def test_public_metrics_opens_the_dashboards_figures_but_never_slots():
    with TestClient(fake_app(keys=Keys((KEY,)), public_metrics=True)) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/props").status_code == 200
        assert c.get("/slots").status_code == 401
        assert c.get("/slots", headers=_bearer("wrong")).status_code == 401


def test_props_in_llama_servers_shape_with_the_kv_ledger():
    with TestClient(fake_app()) as c:
        props = c.get("/props").json()
        assert props["model_alias"] == "fake" and props["loaded"] is True
        assert props["total_slots"] == 4
        assert props["default_generation_settings"]["n_ctx"] > 0
        kv = props["kv"]
        assert kv["blocks_free"] == kv["blocks_total"] > 0 and kv["blocks_parked"] == 0
        assert c.get("/props", params={"model": "fake"}).json()["model_alias"] == "fake"
        missing = c.get("/props", params={"model": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert c.get("/slots", params={"model": "nope"}).status_code == 404


def _stream_in_thread(c: TestClient, key: str, prompt: str) -> threading.Thread:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 400, "stream": True}

    def send() -> None:
        with c.stream("POST", "/v1/completions", json=body, headers=_bearer(key)) as r:
            for _ in r.iter_lines():
                pass

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _busy_slots(c: TestClient, key: str, want: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        slots = c.get("/slots", headers=_bearer(key)).json()
        # Running, not only queued: a waiting request is listed beside the idle slots.
        busy = [s for s in slots if s["is_processing"]]
        if len(busy) >= want:
            return slots
        time.sleep(0.01)
    raise AssertionError("the requests never showed up in /slots")


def test_slots_lists_lengths_and_states_never_text_and_ids_only_to_their_owner():
    runner = FakeRunner(step_delay_s=0.01)
    with TestClient(fake_app(runner, keys=Keys((KEY, OTHER)))) as c:
        secret = "the secret prompt of key one"
        threads = [_stream_in_thread(c, KEY, secret), _stream_in_thread(c, OTHER, "hi")]
        slots = _busy_slots(c, KEY, want=2)
        assert secret not in json.dumps(slots)
        assert len(slots) == 4  # --parallel of the fake app: two busy, two idle
        busy = [s for s in slots if s["is_processing"]]
        assert {s["state"] for s in busy} <= {"prefill", "decoding"}
        mine = [s for s in busy if s["n_prompt_tokens"] == len(secret.encode()) + 1]
        theirs = [s for s in busy if s not in mine]
        assert len(mine) == len(theirs) == 1
        assert mine[0]["id_task"] and theirs[0]["id_task"] is None  # the other key's id hidden
        assert all(s["prompt"] == "" and s["model"] == "fake" for s in slots)
        assert mine[0]["next_token"]["n_decoded"] >= 0 and mine[0]["params"]["n_predict"] == 400
        for t in threads:
            t.join(timeout=30)
        assert all(s["state"] == "idle" for s in c.get("/slots", headers=_bearer(KEY)).json())


def test_the_no_webui_flag_reaches_the_server_config():
    from ferrum.cli import _build, make_parser
    from ferrum.config import ServerConfig

    args = make_parser().parse_args(["serve", "--no-webui"])
    assert _build(ServerConfig, args).no_webui is True
    assert ServerConfig().no_webui is False


def test_an_app_routing_by_hand_gets_the_pages_and_the_api_keeps_its_own_root():
    files = read_static()
    page = page_answer("/dashboard", "", files)
    assert page is not None and b"dashboard.js" in page.body
    assert "script-src 'self'" in page.headers["content-security-policy"]
    chat = page_answer("/", "text/html,application/xhtml+xml", files)
    assert chat is not None and b"chat.js" in chat.body
    assert page_answer("/", "*/*", files) is None  # an Ollama client probing `GET /`
    assert page_answer("/web/plot.js", "*/*", files) is not None
    assert page_answer("/web/nothing.js", "*/*", files) is None
    assert page_answer("/v1/models", "text/html", files) is None
