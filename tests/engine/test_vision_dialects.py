"""Images through the Ollama, Anthropic and Responses dialects on a real server build: each
dialect's image and question is translated into the OpenAI chat body's `image_url` parts, so
the oracle is the OpenAI route itself: the same image and question give the same answer
(greedy, the tiny llama with the tiny projector, "eye") and the same prompt count in each
dialect's own usage. Errors come in each dialect's own shape, naming the part as its client
wrote it, and every answer is checked against the dialect's published schema."""

from __future__ import annotations

import base64

import anthropic
import httpx2
import ollama
import openai
import pytest

from tests import schemas
from tests.schema_check import OllamaBridge, conforms, ollama_answer
from tests.schemas import checked
from tests.tiny_vision import N_IMAGE_TOKENS, flat_image_bytes, image_bytes

QUESTION, MAX_TOKENS = "what is", 8
PNG = image_bytes(1)
B64 = base64.b64encode(PNG).decode()




def _openai(client, b64: str = B64, model: str = "eye") -> dict:
    """The oracle: the OpenAI chat route with the image before the question (as Ollama
    places a message's images)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
    content = [image, {"type": "text", "text": QUESTION}]
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    schemas.validate_chat(r.json())
    usage = r.json()["usage"]
    return {"text": r.json()["choices"][0]["message"]["content"],
            "prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"]}  # fmt: skip


def _anthropic_body(source: dict, model: str = "eye") -> dict:
    content = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    return {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def _base64_source(data: str = B64, media_type: str = "image/png") -> dict:
    return {"type": "base64", "media_type": media_type, "data": data}


def _responses_body(part: dict, model: str = "eye") -> dict:
    content = [part, {"type": "input_text", "text": QUESTION}]
    return {"model": model, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "input": [{"role": "user", "content": content}]}  # fmt: skip


def _ollama_chat_body(images: list[str], model: str = "eye") -> dict:
    return {"model": model, "stream": False,
            "options": {"temperature": 0, "num_predict": MAX_TOKENS},
            "messages": [{"role": "user", "content": QUESTION, "images": images}]}  # fmt: skip


def _ollama_generate_body(images: list[str], model: str = "eye", **extra) -> dict:
    return {"model": model, "stream": False, "prompt": QUESTION, "images": images,
            "options": {"temperature": 0, "num_predict": MAX_TOKENS}, **extra}  # fmt: skip


def _ollama(client, path: str, body: dict):
    r = client.post(path, json=body)
    ollama_answer(path, r.status_code, r.headers["content-type"], r.content)
    return r


def _anthropic(client, body: dict, path: str = "/v1/messages"):
    r = client.post(path, json=body)
    if r.status_code >= 400:
        conforms("anthropic-messages", "ErrorResponse", r.json())
    elif path == "/v1/messages":
        conforms("anthropic-messages", "Message", r.json())
    return r


def _responses(client, body: dict):
    r = client.post("/v1/responses", json=body)
    if r.status_code >= 400:
        schemas.validate_error(r.json())
    else:
        schemas.validate_response(r.json())
    return r


def test_the_image_matters_to_the_oracle(client):
    """Without this the equalities below could hold for an image that is dropped."""
    ours, other = _openai(client), _openai(client, base64.b64encode(image_bytes(2)).decode())
    text_only = client.post("/v1/chat/completions", json={
        "model": "eye", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1,
    }).json()["usage"]["prompt_tokens"]  # fmt: skip
    assert ours["prompt"] == text_only + N_IMAGE_TOKENS
    assert ours["text"] != other["text"]


def test_anthropic_image_blocks_answer_as_openai_does(client):
    oracle = _openai(client)
    r = _anthropic(client, _anthropic_body(_base64_source()))
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == oracle["text"]
    usage = r.json()["usage"]  # the image asked about again: read from the prefix cache
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == oracle["prompt"]
    assert usage["cache_read_input_tokens"] == oracle["prompt"] - 1
    assert usage["output_tokens"] == oracle["completion"]
    count = _anthropic(client, _anthropic_body(_base64_source()), "/v1/messages/count_tokens")
    assert count.json() == {"input_tokens": oracle["prompt"]}


def test_responses_input_image_answers_as_openai_does_and_is_kept_for_the_next_turn(client):
    oracle = _openai(client)
    part = {"type": "input_image", "image_url": "data:image/png;base64," + B64, "detail": "auto"}
    r = _responses(client, _responses_body(part))
    assert r.status_code == 200, r.text
    said = [c["text"] for item in r.json()["output"] if item["type"] == "message"
            for c in item["content"]]  # fmt: skip
    assert "".join(said) == oracle["text"]
    assert r.json()["usage"]["input_tokens"] == oracle["prompt"]
    assert r.json()["usage"]["output_tokens"] == oracle["completion"]
    later = {"model": "eye", "previous_response_id": r.json()["id"], "input": "and?",
             "max_output_tokens": 2, "temperature": 0}  # fmt: skip
    again = _responses(client, later)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["input_tokens"] > oracle["prompt"]  # the image came along
    blind = _responses(client, later | {"model": "text"})
    assert blind.status_code == 400 and blind.json()["error"]["param"] == "previous_response_id"
    assert "'text'" in blind.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_ollama_images_answer_as_openai_does(client, path):
    oracle = _openai(client)
    body = _ollama_chat_body([B64]) if path == "/api/chat" else _ollama_generate_body([B64])
    r = _ollama(client, path, body)
    assert r.status_code == 200, r.text
    text = r.json()["message"]["content"] if path == "/api/chat" else r.json()["response"]
    assert text == oracle["text"]
    assert r.json()["prompt_eval_count"] == oracle["prompt"]
    assert r.json()["eval_count"] == oracle["completion"]
    # A JPEG's base64 and a data URI are taken too (the decoder reads what the bytes are).
    jpeg = base64.b64encode(image_bytes(1, fmt="JPEG")).decode()
    for image in (jpeg, "data:image/png;base64," + B64):
        body["messages" if path == "/api/chat" else "images"] = (
            [{"role": "user", "content": QUESTION, "images": [image]}]
            if path == "/api/chat" else [image]
        )  # fmt: skip
        assert _ollama(client, path, body).status_code == 200


def test_each_dialects_own_client_sends_an_image(client):
    """The SDKs' own request shapes (the ollama client base64-encodes bytes itself), over the
    app in process; the OpenAI client checks every answer against the published schemas."""
    oracle = _openai(client)["text"]
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="k", max_retries=0,
                                 http_client=client)  # fmt: skip
    body = _anthropic_body(_base64_source())
    # This SDK's create() takes no temperature: sent as the JSON field it is.
    extra = {"temperature": body.pop("temperature")}
    said = claude.messages.create(**body, extra_body=extra)
    assert said.content[0].type == "text" and said.content[0].text == oracle
    seen = checked.Checked()
    transport = checked.CheckingTransport(seen, inner=client._transport)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                        http_client=httpx2.Client(transport=transport))  # fmt: skip
    part = {"type": "input_image", "image_url": "data:image/png;base64," + B64, "detail": "auto"}
    assert oai.responses.create(**_responses_body(part)).output_text == oracle
    assert seen.answers == 1
    local = ollama.Client(host="http://testserver", transport=OllamaBridge(client))
    message = {"role": "user", "content": QUESTION, "images": [PNG]}
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    assert local.chat("eye", [message], options=options).message.content == oracle
    assert local.generate("eye", QUESTION, images=[PNG], options=options).response == oracle


# -- errors, in each dialect's shape, naming the model or the part ----------------------------

BROKEN = base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode()
HUGE = base64.b64encode(flat_image_bytes((5000, 4000))).decode()
CASES = [("text", B64, "'text'"), ("eye", BROKEN, "readable"), ("eye", HUGE, "pixels"),
         ("eye", "not base64!", "base64")]  # fmt: skip


@pytest.mark.parametrize("model, image, words", CASES)
def test_anthropic_image_errors_name_the_block(client, model, image, words):
    r = _anthropic(client, _anthropic_body(_base64_source(image), model))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and message.startswith("messages[0].content[0]: "), message


@pytest.mark.parametrize("model, image, words", CASES)
def test_responses_image_errors_name_the_part(client, model, image, words):
    part = {"type": "input_image", "image_url": "data:image/png;base64," + image}
    r = _responses(client, _responses_body(part, model))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "input[0].content[0]", error


@pytest.mark.parametrize("model, image, words", CASES)
def test_ollama_image_errors_name_the_image(client, model, image, words):
    chat = _ollama(client, "/api/chat", _ollama_chat_body([B64, image], model))
    assert chat.status_code == 400, chat.text
    # The first image is the one named when the model takes none.
    k = 0 if model == "text" else 1
    assert words in chat.json()["error"]
    assert chat.json()["error"].startswith(f"messages[0].images[{k}]: ")
    generate = _ollama(client, "/api/generate", _ollama_generate_body([image], model))
    assert generate.status_code == 400, generate.text
    assert generate.json()["error"].startswith("images[0]: ") and words in generate.json()["error"]


def test_what_no_dialect_fetches_or_reads_is_refused_by_name(client):
    url = _anthropic(client, _anthropic_body({"type": "url", "url": "https://example.com/a.png"}))
    assert url.status_code == 400
    assert url.json()["error"]["message"].startswith("messages[0].content[0].source: url")
    gif = _anthropic(client, _anthropic_body(_base64_source(media_type="image/gif")))
    assert gif.status_code == 400 and "image/gif" in gif.json()["error"]["message"]
    file_id = _responses(client, _responses_body({"type": "input_image", "file_id": "file-1"}))
    assert file_id.status_code == 400
    assert file_id.json()["error"]["param"] == "input[0].content[0].file_id"
    raw = _ollama(client, "/api/generate", _ollama_generate_body([B64], raw=True))
    assert raw.status_code == 400 and "images" in raw.json()["error"]
    assert _openai(client)["prompt"] > N_IMAGE_TOKENS  # and the server goes on
