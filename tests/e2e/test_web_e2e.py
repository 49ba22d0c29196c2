"""The browser pages in a real browser: Chromium from the OS packages driven by Playwright,
against a real `ferrum serve` (the default model and Gemma 3 270M beside it) that needs an
API key, and one serving the tiny llama with the tiny vision projector (images). Skipped
where Chromium or Playwright is missing (`scripts/install test` installs both where it can)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import running_server
from tests.tiny_models import write_tiny_llama
from tests.tiny_vision import data_uri, image_bytes, write_tiny_mmproj

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "web-test-key"
# The screenshots in docs/ are made by these tests with FERRUM_SCREENSHOTS=docs; otherwise they
# go to a temporary folder, so that a test run leaves the tree as it was.
DOCS = Path(os.environ.get("FERRUM_SCREENSHOTS") or tempfile.mkdtemp(prefix="ferrum-web-"))
DEFAULT, SECOND = "smollm2-135m-instruct", "gemma3-270m"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with running_server(
        tmp_path_factory, "ferrum-web", "--api-key", KEY, models=(DEFAULT, SECOND)
    ) as url:
        yield url


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory) -> Iterator[str]:
    """The tiny llama as "eye" (with the tiny projector: it sees) and as "text"; no key."""
    folder = tmp_path_factory.mktemp("vision")
    llama = write_tiny_llama(folder / "tiny-llama.gguf")
    mmproj = write_tiny_mmproj(folder / "mmproj.gguf")
    with running_server(
        tmp_path_factory, "ferrum-web-vision", "--mmproj", f"eye={mmproj}", "--ctx-size", "512",
        models=(f"eye={llama}", f"text={llama}"),
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(20_000)
    yield page
    context.close()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}).json()


def _enter_key(page) -> None:
    page.locator("#key-box").wait_for(state="visible")
    page.fill("#key-input", KEY)
    page.click("#key-save")


def _open_chat(page, url: str) -> None:
    page.goto(url + "/")
    _enter_key(page)
    page.locator(f'#model option[value="{DEFAULT}"]').wait_for(state="attached")


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _not_blank(page, path: Path) -> None:
    """The screenshot's pixels vary (not one colour): decoded and measured in the browser."""
    data = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    probe = page.context.new_page()
    spread = probe.evaluate(
        """async (src) => {
            const img = new Image(); img.src = src; await img.decode();
            const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
            const g = c.getContext('2d'); g.drawImage(img, 0, 0);
            const px = g.getImageData(0, 0, c.width, c.height).data;
            let n = 0, sum = 0, sq = 0;
            for (let i = 0; i < px.length; i += 4 * 7) {
                const v = px[i] + px[i+1] + px[i+2]; n++; sum += v; sq += v * v;
            }
            return Math.sqrt(sq / n - (sum / n) ** 2);
        }""",
        data,
    )
    probe.close()
    assert spread > 10, f"{path.name} looks blank (spread {spread:.1f})"


def test_key_then_a_streamed_answer_that_is_still_there_after_a_reload(server, page):
    _open_chat(page, server)
    assert page.evaluate("localStorage.getItem('ferrum.apiKey')") == KEY
    page.click("#settings-toggle")
    page.fill("#max-tokens", "48")  # settings are kept in the browser too
    page.click("#settings-toggle")
    _send(page, "Write one sentence about the sea.")
    answer = page.locator(".msg.assistant").last
    answer.locator(".regenerate").wait_for()  # shown once the answer finished
    text = answer.locator(".body").inner_text()
    stats = answer.locator(".stats").inner_text()
    assert text.strip() and "tok/s" in stats and "TTFT" in stats and "cached" in stats
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=str(DOCS / "webui-chat.png"))
    _not_blank(page, DOCS / "webui-chat.png")
    page.reload()  # the key and the conversation are both kept in the browser
    page.locator(".msg.assistant .body").last.wait_for()
    assert page.locator(".msg.assistant .body").last.inner_text() == text
    assert page.locator("#key-box").is_hidden()


def test_switching_model_then_stop_ends_the_request_on_the_server(server, page):
    _open_chat(page, server)
    page.select_option("#model", SECOND)  # loads on the first request
    page.click("#settings-toggle")
    page.fill("#max-tokens", "3000")
    _send(page, "Once upon a time")
    answer = page.locator(".msg.assistant").last
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant:last-child .body').textContent.length > 20"
    )
    assert SECOND in answer.locator(".role").text_content()
    assert _health(server)["models"][SECOND]["active_requests"] == 1
    page.click("#stop")
    answer.locator(".regenerate").wait_for()
    deadline = time.monotonic() + 10
    while _health(server)["models"][SECOND]["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server)["models"][SECOND]["active_requests"] == 0
    assert "stopped" in answer.locator(".stats").inner_text()


def test_model_output_with_html_and_script_links_is_shown_as_text(server, page):
    hostile = (
        "<script>window.__ran = 1</script> <img src=x onerror=\"window.__ran = 2\">\n\n"
        "[x](javascript:alert(1)) and [safe](https://example.com/) and **bold**\n\n"
        "```html\n<b>code</b>\n```"
    )
    chunks = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "thinking <i>hard</i>"}}]},
        {"choices": [{"index": 0, "delta": {"content": hostile}}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 7}}},
    ]  # fmt: skip
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body),
    )
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    _open_chat(page, server)
    _send(page, "anything")
    answer = page.locator(".msg.assistant").last
    answer.locator(".regenerate").wait_for()
    shown = answer.locator(".body")
    assert "<script>window.__ran = 1</script>" in shown.inner_text()
    assert "onerror" in shown.inner_text()
    assert shown.locator("script, img, b").count() == 0
    links = shown.locator("a")
    assert links.count() == 1 and links.first.get_attribute("href") == "https://example.com/"
    assert "[x](javascript:alert(1))" in shown.inner_text()
    assert shown.locator("strong").inner_text() == "bold"
    assert shown.locator("pre code").inner_text() == "<b>code</b>"
    assert answer.locator("details.reasoning pre").text_content() == "thinking <i>hard</i>"
    assert "cached 7" in answer.locator(".stats").inner_text()
    page.wait_for_timeout(200)
    assert page.evaluate("window.__ran") is None and dialogs == []


def test_the_dashboard_moves_while_the_server_works(server, page):
    stop = threading.Event()

    def load() -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": DEFAULT, "prompt": "Tell me a story", "max_tokens": 120}
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.post(f"{server}/v1/completions", json=body, headers=headers)

    threads = [threading.Thread(target=load) for _ in range(2)]
    page.goto(server + "/dashboard")
    _enter_key(page)
    tile = page.locator(f'section[data-model="{DEFAULT}"] [data-k="decode_tps"]')
    tile.wait_for()
    for t in threads:
        t.start()
    try:
        page.wait_for_function(
            """(model) => {
                const section = document.querySelector(`section[data-model="${model}"]`);
                const v = (k) => section && section.querySelector(`[data-k="${k}"]`);
                // the engine's turns at the cores move with its steps (server.py's seats)
                return ["decode_tps", "turns_rate"].every((k) => parseFloat(v(k).textContent) > 0);
            }""",
            arg=DEFAULT,
        )
        page.locator("#slots tbody td", has_text="decoding").first.wait_for()
        page.wait_for_timeout(1000)  # a point more on the charts
        page.screenshot(path=str(DOCS / "webui-dashboard.png"), full_page=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    _not_blank(page, DOCS / "webui-dashboard.png")
    assert "(another key's)" not in page.locator("#slots").inner_text()  # its own requests


def _cluster_metrics(poll: int) -> str:
    """Two replicas' /metrics as `ferrum cluster` merges them; the turns counters grow."""
    lines = []
    for replica, queued in (("r1", 3), ("r2", 7)):
        at = f'model="m",replica="{replica}"'
        lines += [
            f"ferrum_queue_depth{{{at}}} {queued}",
            f'ferrum_engine_turns_total{{engine="chat",{at}}} {poll * 10 * queued}',
            f'ferrum_engine_turn_seconds_total{{engine="chat",{at}}} {poll * 0.5}',
            f'ferrum_models_loaded{{replica="{replica}"}} 1',
        ]
    return "\n".join(lines) + "\n"


def test_the_dashboard_shows_each_replica_of_a_cluster(server, page):
    polls = {"n": 0}
    kv = {"block_size": 16, "blocks_total": 64, "blocks_free": 40, "blocks_parked": 8}
    each = [{"replica": r, "loaded": True, "kv": kv} for r in ("r1", "r2")]
    props = {"model_alias": "m", "loaded": True, "kv": kv, "replicas": each}
    slot = {
        "model": "m", "id": 0, "id_task": "cmpl-1", "state": "decoding", "n_prompt_tokens": 5,
        "n_cached_tokens": 0, "n_computed_tokens": 6,
        "next_token": {"n_decoded": 1, "n_remain": 9},
    }  # fmt: skip

    def metrics(route) -> None:
        polls["n"] += 1
        route.fulfill(body=_cluster_metrics(polls["n"]), content_type="text/plain")

    page.route("**/metrics", metrics)
    page.route("**/props*", lambda r: r.fulfill(json=props))
    page.route("**/slots", lambda r: r.fulfill(json=[{**slot, "replica": "r2"}]))
    page.goto(server + "/dashboard")
    for replica, queued in (("r1", "3"), ("r2", "7")):
        tile = page.locator(f'section[data-model="m"][data-replica="{replica}"] [data-k="queue"]')
        playwright_api.expect(tile).to_have_text(queued)
    turns = page.locator('section[data-replica="r2"] [data-k="turns_rate"]')
    page.wait_for_function("(el) => parseFloat(el.textContent) > 0", arg=turns.element_handle())
    playwright_api.expect(page.locator("#slots tbody tr").first).to_contain_text("r2")
    page.select_option("#replica", "r2")
    playwright_api.expect(page.locator('section[data-replica="r1"]')).to_be_hidden()
    playwright_api.expect(page.locator('section[data-replica="r2"]')).to_be_visible()


def test_an_image_attached_where_the_model_sees_is_sent_shown_and_kept(
    vision_server, page, tmp_path
):
    expect = playwright_api.expect
    png = tmp_path / "noise.png"
    png.write_bytes(image_bytes(1))
    uri = data_uri(png.read_bytes())
    page.goto(vision_server + "/")
    page.locator('#model option[value="eye"]').wait_for(state="attached")
    page.select_option("#model", "text")
    expect(page.locator("#attach")).to_be_hidden()  # that model does not see
    page.select_option("#model", "eye")
    expect(page.locator("#attach")).to_be_visible()
    page.click("#settings-toggle")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    page.click("#settings-toggle")
    page.set_input_files("#image", str(png))
    expect(page.locator("#attachments img")).to_have_attribute("src", uri)
    with page.expect_request("**/v1/chat/completions") as sent:
        _send(page, "what is")
    body = sent.value.post_data_json
    image = {"type": "image_url", "image_url": {"url": uri}}
    assert body["messages"][-1]["content"] == [image, {"type": "text", "text": "what is"}]
    answer = page.locator(".msg.assistant").last
    answer.locator(".regenerate").wait_for()
    assert answer.locator(".error").count() == 0
    expect(page.locator("#attachments")).to_be_hidden()  # sent: the composer is empty again
    # The oracle: the same body asked whole, with no page in between.
    whole = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    oracle = httpx.post(f"{vision_server}/v1/chat/completions", json=whole, timeout=60).json()
    kept = page.evaluate("JSON.parse(localStorage.getItem('ferrum.chats')).chats[0].messages")
    assert kept[-1]["content"] == oracle["choices"][0]["message"]["content"]
    assert f"prompt {oracle['usage']['prompt_tokens']}" in answer.locator(".stats").inner_text()
    page.screenshot(path=str(DOCS / "webui-image.png"))
    page.reload()  # the image is kept with the conversation and shown again
    expect(page.locator(".msg.user .thumbs img")).to_have_attribute("src", uri)
