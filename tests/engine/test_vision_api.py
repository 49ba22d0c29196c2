"""Images through the OpenAI chat API on a real server build: the tiny llama served as
"eye" with the tiny projector (`--mmproj eye=PATH`) and as "text" without one."""

from __future__ import annotations

import base64

import pytest

from ferrum.models.projectors import attach
from ferrum.models.registry import ModelSpec
from tests.tiny_vision import N_IMAGE_TOKENS, data_uri, flat_image_bytes, image_bytes


def _png(seed: int, size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> str:
    return data_uri(image_bytes(seed, size, fmt), fmt)


def _flat(size: tuple[int, int]) -> str:
    return data_uri(flat_image_bytes(size))


def _chat(client, url: str, model: str = "eye", **extra):
    image = {"type": "image_url", "image_url": {"url": url}}
    content = [{"type": "text", "text": "what is"}, image]
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, **extra}  # fmt: skip
    return client.post("/v1/chat/completions", json=body)


def test_models_with_a_projector_say_they_see(client):
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["eye"]["capabilities"] == ["vision"] and "capabilities" not in cards["text"]
    assert "vision" in client.post("/api/show", json={"model": "eye"}).json()["capabilities"]
    assert "vision" not in client.post("/api/show", json={"model": "text"}).json()["capabilities"]


def test_an_image_is_answered_repeatably_and_counted_in_the_prompt(client):
    first, again = _chat(client, _png(1)), _chat(client, _png(1))
    assert first.status_code == 200, first.text
    text_only = client.post("/v1/chat/completions", json={
        "model": "eye", "messages": [{"role": "user", "content": "what is"}], "max_tokens": 1,
    }).json()["usage"]["prompt_tokens"]  # fmt: skip
    assert first.json()["usage"]["prompt_tokens"] == text_only + N_IMAGE_TOKENS
    content = first.json()["choices"][0]["message"]["content"]
    assert content == again.json()["choices"][0]["message"]["content"]
    jpeg = _chat(client, _png(1, fmt="JPEG"))
    assert jpeg.status_code == 200, jpeg.text


def test_a_text_model_asked_about_an_image_names_itself(client):
    r = _chat(client, _png(1), model="text")
    assert r.status_code == 400
    error = r.json()["error"]
    assert "'text'" in error["message"] and error["param"] == "messages[0].content[1]"


@pytest.mark.parametrize(
    "url, words",
    [
        ("https://example.com/cat.png", "data URI"),
        ("data:image/png;base64,not base64!", "base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode(),
            "readable",
        ),
        (_flat((5000, 4000)), "pixels"),
        ("data:image/png;base64," + "A" * (11 * 1024 * 1024), "bytes"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(client, url, words):
    r = _chat(client, url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "messages[0].content[1]"
    assert error["message"].startswith("messages[0].content[1]: ")  # named in the text too
    assert _chat(client, _png(1)).status_code == 200  # and the server goes on


def test_mmproj_flags_name_a_served_model_and_a_file(mmproj):
    specs = [ModelSpec("a", lambda: ""), ModelSpec("b", lambda: "")]
    assert attach(specs, [f"b={mmproj}"])[1].mmproj == mmproj
    with pytest.raises(ValueError, match="several models"):
        attach(specs, [mmproj])
    with pytest.raises(ValueError, match="no model 'c'"):
        attach(specs, [f"c={mmproj}"])
    with pytest.raises(ValueError, match="file not found"):
        attach(specs[:1], ["/nope/mmproj.gguf"])
    assert attach(specs[:1], [mmproj])[0].mmproj == mmproj


def _metric(client, name: str, model: str = "eye") -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return float(sample.value)
    return 0.0


def test_the_same_image_again_reuses_its_encoding_and_its_kv_and_metrics_say_so(client):
    names = ("ferrum_images_encoded_total", "ferrum_image_encode_seconds_count",
             "ferrum_image_encodings_reused_total", "ferrum_image_tokens_reused_total")  # fmt: skip
    before = {name: _metric(client, name) for name in names}
    image = _png(7)  # sent by no other test
    first, again = _chat(client, image), _chat(client, image, max_tokens=3)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    moved = {name: _metric(client, name) - before[name] for name in names}
    assert moved["ferrum_images_encoded_total"] == 1 == moved["ferrum_image_encode_seconds_count"]
    assert moved["ferrum_image_encodings_reused_total"] == 1
    usage = again.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == usage["prompt_tokens"] - 1  # all but the last token, image and all
    assert moved["ferrum_image_tokens_reused_total"] == N_IMAGE_TOKENS
    assert _metric(client, "ferrum_images_encoded_total", model="text") == 0


def test_an_image_too_long_for_one_step_is_a_400_naming_the_messages(
    tiny_llama, mmproj_gemma3, tmp_path
):
    """Gemma 3's kind of projector decodes an image whole; with 8 slots in a 20-position
    step, its 16 rows cannot fit beside the other slots' decodes: refused before any decode,
    and the server goes on serving."""
    from fastapi.testclient import TestClient

    from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
    from ferrum.server import build_server

    engine_cfg = EngineConfig(ctx_size=512, parallel=8, batch_size=20, threads=2,
                              cache_ram=0, cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=(f"eye={tiny_llama}",), models_dir=str(tmp_path),
                          mmproj=(f"eye={mmproj_gemma3}",))  # fmt: skip
    with TestClient(build_server(engine_cfg, ServerConfig(port=9999), models)[0]) as client:
        r = _chat(client, _png(1))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "does not fit one step" in error["message"]
        body = {"model": "eye", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ok = client.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text
