"""The Ollama API over fake models, driven by Ollama's own Python client: streamed and whole
answers agree, options and formats reach the engine, thinking and tool calls come back in
Ollama's shapes, models load and unload by Ollama's idioms, and every error is `{"error"}`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ollama
import pytest
from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from ferrum.models.gguf_file import read_gguf
from ferrum.models.presets import Preset
from ferrum.models.pull import PullProgress, adopt
from ferrum.models.registry import ModelSpec
from ferrum.models.store import Manifest, ModelStore
from tests.factories import EOS, FakeRunner, fake_app
from tests.schema_check import OllamaBridge
from tests.tiny_models import write_tiny_llama
from tests.unit.test_api_tools import CALL, WEATHER

HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "num_predict": 12}


def scripted(text: str):
    """A fake model that answers every chat prompt with `text`, then EOS."""
    script = list(text.encode()) + [EOS]
    marker = list(b"<|im_start|>assistant\n")

    def next_token(cells: Sequence[int]) -> int:
        cells = list(cells)
        starts = [
            i + len(marker) for i in range(len(cells)) if cells[i : i + len(marker)] == marker
        ]
        return script[min(len(cells) - max(starts, default=0), len(script) - 1)]

    return next_token


@contextmanager
def served(runner: FakeRunner | None = None, **kw) -> Iterator[tuple[ollama.Client, TestClient]]:
    """Ollama's own client talking to the real app over fake models."""
    with TestClient(fake_app(runner, **kw)) as http:
        yield ollama.Client(host="http://testserver", transport=OllamaBridge(http)), http


@pytest.fixture
def two():
    # Ollama's load and unload idioms set keep_alive for everyone: an admin's right.
    models = {"alpha": FakeRunner, "beta": FakeRunner}
    with served(models=models, keys=Keys(open_admin=True)) as pair:
        yield pair


def _loaded(http: TestClient) -> dict[str, int]:
    return {m.spec.name: m.in_flight for m in http.app.state.ferrum.models.loaded()}


# -- chat and generate ----------------------------------------------------------------------


def test_chat_streamed_and_whole_agree():
    with served() as (client, _):
        whole = client.chat("fake", HI, options=GREEDY)
        parts = list(client.chat("fake", HI, options=GREEDY, stream=True))
    assert whole.message.role == "assistant" and len(whole.message.content) == 12
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    final = parts[-1]
    assert final.done_reason == whole.done_reason == "length"
    assert final.eval_count == whole.eval_count == 12
    assert final.prompt_eval_count == whole.prompt_eval_count > 0
    assert whole.model == "fake" and whole.created_at.endswith("Z")


def test_generate_applies_the_chat_template_and_raw_does_not(two):
    client, http = two
    chat = client.chat("alpha", HI, options=GREEDY)
    gen = client.generate("alpha", "hi", options=GREEDY)
    streamed = list(client.generate("alpha", "hi", options=GREEDY, stream=True))
    assert gen.response == chat.message.content == "".join(p.response for p in streamed)
    assert gen.prompt_eval_count == chat.prompt_eval_count
    raw = client.generate("alpha", "hi", raw=True, options=GREEDY)
    text = http.post(
        "/v1/completions",
        json={"model": "alpha", "prompt": "hi", "max_tokens": 12, "temperature": 0},
    ).json()["choices"][0]["text"]
    assert raw.response == text != gen.response
    assert raw.prompt_eval_count == 3  # BOS and two bytes: no template around them


def test_a_system_prompt_reaches_the_template():
    with served() as (client, _):
        plain = client.generate("fake", "hi", options=GREEDY)
        told = client.generate("fake", "hi", system="Be brief.", options=GREEDY)
        chat = client.chat(
            "fake", [{"role": "system", "content": "Be brief."}, *HI], options=GREEDY
        )
    assert told.prompt_eval_count > plain.prompt_eval_count
    assert told.response == chat.message.content


def test_options_reach_the_engine():
    runner = FakeRunner()
    options = {
        "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 42,
        "num_predict": 5, "stop": ["zz"], "repeat_penalty": 1.2, "presence_penalty": 0.3,
        "frequency_penalty": 0.4, "num_ctx": 99999, "mirostat": 2,
    }  # fmt: skip
    with served(runner) as (client, _):
        r = client.generate("fake", "hi", options=options)
    params = runner.closed_samplers[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.05)
    assert (params.seed, params.max_tokens, params.stop) == (42, 5, ("zz",))
    assert params.repetition_penalty == 1.2
    assert (params.presence_penalty, params.frequency_penalty) == (0.3, 0.4)
    assert r.eval_count == len(r.response.encode()) == 5 and r.done_reason == "length"


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_of_zero_or_less_is_no_limit(num_predict):
    answer = "x" * 40
    with served(FakeRunner(next_token=scripted(answer))) as (client, _):
        r = client.chat("fake", HI, options={"num_predict": num_predict})
    assert r.message.content == answer and r.done_reason == "stop" and r.eval_count == 41


def test_timings_are_consistent():
    with served() as (client, _):
        r = client.generate("fake", "abc", raw=True, options=GREEDY)
    assert r.prompt_eval_count == 4 and r.eval_count == len(r.response) == 12
    assert r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration > 0
    parts = r.load_duration + r.prompt_eval_duration + r.eval_duration
    assert parts <= r.total_duration


# -- formats, thinking, tools ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    ["json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}],
)
def test_format_builds_a_grammar_and_the_answer_parses(fmt):
    # The fake does not enforce grammars: it is scripted to write JSON, and the test checks
    # that a grammar reached the engine.
    runner = FakeRunner(next_token=scripted('{"a": 1}'))
    with served(runner) as (client, _):
        r = client.chat("fake", HI, format=fmt)
        g = client.generate("fake", "hi", format=fmt)
    assert json.loads(r.message.content) == json.loads(g.response) == {"a": 1}
    grammars = [s.params.grammar for s in runner.closed_samplers]
    assert all(grammars) and len(set(grammars)) == 1


def test_a_schema_and_json_build_different_grammars():
    runner = FakeRunner(next_token=scripted("{}"))
    with served(runner) as (client, _):
        client.chat("fake", HI, format="json")
        client.chat("fake", HI, format={"type": "object", "properties": {"b": {"type": "string"}}})
    assert len({s.params.grammar for s in runner.closed_samplers}) == 2


def test_thinking_comes_back_apart_unless_think_is_false():
    runner = FakeRunner(next_token=scripted("<think>hmm</think>Paris"))
    with served(runner) as (client, _):
        whole = client.chat("fake", HI, think=True)
        parts = list(client.chat("fake", HI, think=True, stream=True))
        quiet = client.chat("fake", HI, think=False)
        gen = client.generate("fake", "hi")
    assert (whole.message.thinking, whole.message.content) == ("hmm", "Paris")
    assert "".join(p.message.thinking or "" for p in parts) == "hmm"
    assert "".join(p.message.content for p in parts) == "Paris"
    assert quiet.message.thinking is None and quiet.message.content == "Paris"
    assert (gen.thinking, gen.response) == ("hmm", "Paris")


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
def test_tool_calls_come_back_with_object_arguments(prefix):
    with served(FakeRunner(next_token=scripted(prefix + CALL))) as (client, _):
        whole = client.chat("fake", HI, tools=[WEATHER])
        parts = list(client.chat("fake", HI, tools=[WEATHER], stream=True))
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert whole.message.content == prefix.strip() and whole.done_reason == "stop"
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert streamed == [call]
    assert "".join(p.message.content for p in parts) == prefix.strip()


def test_a_tool_result_goes_back_into_the_prompt():
    seen: list[list[int]] = []
    answer = scripted("It is sunny.")

    def next_token(cells: Sequence[int]) -> int:
        seen.append(list(cells))
        return answer(cells)

    history = [
        *HI,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]  # fmt: skip
    with served(FakeRunner(next_token=next_token)) as (client, _):
        r = client.chat("fake", history, tools=[WEATHER])
    prompt = bytes(t for t in seen[0] if t < 256).decode()
    assert r.message.content == "It is sunny."
    assert '"city": "Paris"' in prompt and "sunny, 21 C" in prompt


# -- models ---------------------------------------------------------------------------------


def test_ps_lists_what_is_loaded_and_keep_alive_zero_unloads(two):
    client, http = two
    assert [m.name for m in client.ps().models] == ["alpha"]  # the default loads at start
    r = client.generate("beta", keep_alive=-1)  # no prompt: Ollama's load idiom
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    ps = {m.name: m for m in client.ps().models}
    assert set(ps) == {"alpha", "beta"} and ps["beta"].expires_at.year > 2200
    assert ps["alpha"].size_vram == 0 and ps["alpha"].context_length == 1024
    r = client.chat("beta", [], keep_alive=0)  # no messages, keep_alive 0: unload
    assert (r.done_reason, r.message.content) == ("unload", "")
    assert [m.name for m in client.ps().models] == ["alpha"]
    assert _loaded(http) == {"alpha": 0}


def test_ps_survives_an_expiry_past_any_date(two):
    """The API bounds keep_alive; the registry does not, and ps must not fail on it."""
    client, http = two
    registry = http.app.state.ferrum.models
    lease = http.portal.call(registry.acquire, "alpha", 1e300)
    http.portal.call(lease.release)
    (alpha,) = [m for m in client.ps().models if m.name == "alpha"]
    assert alpha.expires_at is not None and alpha.expires_at.year > 2100


def test_keep_alive_reaches_the_registry(two):
    client, http = two
    client.chat("beta", HI, options=GREEDY, keep_alive="10m")
    (beta,) = [m for m in client.ps().models if m.name == "beta"]
    remaining = beta.expires_at.timestamp() - time.time()
    assert 500 < remaining <= 600


def test_an_unknown_model_is_a_404(two):
    client, _ = two
    for call in (
        lambda: client.chat("nope", HI),
        lambda: client.generate("nope", "hi"),
        lambda: client.show("nope"),
        lambda: client.chat("nope", HI, stream=True).__next__(),
    ):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 404 and "'nope' not found" in err.value.error


def test_list_and_show(two):
    client, _ = two
    models = client.list().models
    assert [m.model for m in models] == ["alpha", "beta"]
    assert models[0].details.format == "gguf" and models[0].modified_at is not None
    shown = client.show("alpha")
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    assert shown.details.format == "gguf"


def test_version_and_the_root_probe(two):
    _, http = two
    version = http.get("/api/version").json()["version"]
    assert len(version.split(".")) == 3 and all(p.isdigit() for p in version.split("."))
    assert http.get("/").status_code == http.head("/").status_code == 200
    assert "ferrum" in http.get("/").text


# -- refusals and errors --------------------------------------------------------------------


def _refused(fn, status: int = 400) -> str:
    with pytest.raises(ollama.ResponseError) as err:
        fn()
    assert err.value.status_code == status
    return err.value.error


def test_images_for_a_model_that_does_not_see_and_unsupported_fields_are_refused():
    png = "iVBORw0KGgo="
    with served() as (client, http):
        chat = _refused(lambda: client.chat("fake", [{**HI[0], "images": [png]}]))
        assert chat.startswith("messages[0].images[0]: model 'fake' does not take images")
        generate = _refused(lambda: client.generate("fake", "hi", images=[png]))
        assert generate.startswith("images[0]: model 'fake' does not take images")
        assert "suffix" in _refused(lambda: client.generate("fake", "def f(", suffix=")"))
        assert "template" in _refused(lambda: client.generate("fake", "hi", template="{{ x }}"))
        assert "raw" in _refused(lambda: client.generate("fake", "hi", raw=True, format="json"))
        bad = _refused(lambda: client.chat("fake", HI, options={"temperature": 3}))
        assert bad.startswith("options.temperature")
        assert _refused(lambda: client.chat("fake", HI, options={"num_predict": "5"}))
        r = http.post("/api/chat", content=b"{not json")
        assert r.status_code == 400 and set(r.json()) == {"error"}
        r = http.post("/api/chat", json={"model": "fake", "messages": [{"content": "x"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]


def test_a_chat_model_asked_to_embed_is_an_ollama_shaped_400(two):
    client, _ = two
    assert "does not serve embeddings" in _refused(lambda: client.embed("alpha", "hi"), 400)
    assert "does not serve embeddings" in _refused(lambda: client.embeddings("alpha", "hi"), 400)


def test_other_api_paths_are_ollama_shaped_404s(two):
    _, http = two
    r = http.post("/api/create", json={"model": "x"})
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_store_routes_are_refused_without_a_store():
    with served(models={"alpha": FakeRunner}, keys=Keys(open_admin=True)) as (client, _):
        assert "store" in _refused(lambda: client.delete("alpha"))
        assert "store" in _refused(lambda: client.copy("alpha", "gamma"))


def test_a_format_that_is_no_schema_is_refused_before_any_stream():
    with served() as (client, http):
        bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
        error = _refused(lambda: next(client.chat("fake", HI, format=bad, stream=True)))
        assert error.startswith("format.properties.a.type is not a valid JSON schema")
        assert _loaded(http) == {"fake": 0}


# -- hang-ups -------------------------------------------------------------------------------


def test_the_deadline_ends_a_stream_with_an_error_line():
    slow = {"num_predict": 500}  # 5 s at 10 ms a step
    with served(FakeRunner(step_delay_s=0.01), request_timeout=0.2) as (client, http):
        with pytest.raises(ollama.ResponseError) as err:
            list(client.chat("fake", HI, options=slow, stream=True))
        assert "took longer than 0.2 s" in err.value.error
        assert "took longer" in _refused(lambda: client.generate("fake", "hi", options=slow), 408)
        assert _loaded(http) == {"fake": 0}


def test_a_client_gone_mid_stream_releases_the_lease_and_aborts():
    runner = FakeRunner(step_delay_s=0.005)  # never writes EOS: runs until aborted
    with TestClient(fake_app(runner)) as http:
        body = json.dumps({"model": "fake", "messages": HI, "options": {"num_predict": 500}})
        sent = http.portal.call(_hang_up_after_first_line, http.app, body.encode())
        state = http.app.state.ferrum
        assert json.loads(sent)["done"] is False
        assert [m.in_flight for m in state.models.loaded()] == [0]
        assert runner.samplers == {}  # the engine request was aborted, its sampler freed
        assert runner.closed_samplers[-1].params.max_tokens == 500


async def _hang_up_after_first_line(app, body: bytes) -> bytes:
    """Drives the ASGI app by hand: the client disconnects once the first line is sent."""
    first = asyncio.Event()
    sent: list[bytes] = []
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await first.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            first.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/api/chat", "raw_path": b"/api/chat", "query_string": b"",
        "headers": [(b"content-type", b"application/json")], "server": ("testserver", 80),
        "client": ("test", 1), "root_path": "",
    }  # fmt: skip
    await app(scope, receive, send)
    for _ in range(100):  # the engine thread frees the aborted request's sampler
        if not app.state.ferrum.models.loaded()[0].model.engine.core.has_work:
            break
        await asyncio.sleep(0.01)
    return sent[0].split(b"\n")[0]


# -- the store: delete, copy ----------------------------------------------------------------


@pytest.fixture
def stored(tmp_path):
    """A store holding a tiny GGUF ("tiny", adopted in place), served beside a model outside
    the store ("alpha"), a built-in one ("smol") and a file given to --model ("loose")."""
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    facts = read_gguf(path)
    store = ModelStore(tmp_path / "store")
    store.add(
        Manifest(
            "tiny", f"file:{path}", (str(path),), path.stat().st_size,
            hashlib.sha256(path.read_bytes()).hexdigest(), facts.architecture,
            facts.context_length, facts.has_chat_template, facts.quant, 1.7e9,
        )
    )  # fmt: skip
    specs = [
        ModelSpec("alpha", lambda: ""),
        ModelSpec("tiny", lambda: str(path), f"file:{path}", 1.7e9),
        ModelSpec("smol", lambda: "", "builtin:smol"),
        ModelSpec("loose", lambda: str(path), f"file:{path}"),
    ]
    runners = defaultdict(lambda: FakeRunner, alpha=FakeRunner)  # and models added later
    keys = Keys(open_admin=True)  # the store's routes need an admin
    with served(models=runners, store=store, registry={"specs": specs}, keys=keys) as (client, _):
        yield client, store, path


def test_tags_and_show_read_the_manifest_or_the_file(stored):
    client, store, path = stored
    tags = {m.model: m for m in client.list().models}
    tiny, loose = tags["tiny"], tags["loose"]
    (manifest,) = store.list()
    assert (tiny.size, tiny.digest, tiny.details.family) == (
        path.stat().st_size,
        manifest.sha256,
        "llama",
    )
    assert tiny.modified_at.timestamp() == 1.7e9
    assert (loose.size, loose.details.family, loose.digest) == (tiny.size, "llama", "")
    shown = client.show("tiny")
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == manifest.context_length
    assert shown.capabilities == ["completion", "tools"]  # the GGUF has a chat template


def test_copy_adds_a_served_model(stored):
    client, store, _ = stored
    assert client.copy("tiny", "copied").status == "success"
    assert sorted(m.name for m in store.list()) == ["copied", "tiny"]
    tags = {m.model: m for m in client.list().models}
    assert tags["copied"].digest == tags["tiny"].digest
    assert client.chat("copied", HI, options=GREEDY).model == "copied"
    assert "not found" in _refused(lambda: client.copy("nope", "x"), 404)


def test_delete_takes_a_stored_model_out(stored):
    client, store, path = stored
    client.generate("tiny")  # loaded: it is unloaded first
    assert "tiny" in [m.name for m in client.ps().models]
    assert client.delete("tiny").status == "success"
    assert store.list() == [] and path.is_file()  # an adopted file is never deleted
    assert "tiny" not in [m.model for m in client.list().models]
    assert "tiny" not in [m.name for m in client.ps().models]
    assert "not found" in _refused(lambda: client.delete("tiny"), 404)


def test_only_the_store_s_own_models_can_be_deleted_or_copied(stored):
    client, _, _ = stored
    assert "built-in" in _refused(lambda: client.delete("smol"))
    assert "not in the model store" in _refused(lambda: client.delete("alpha"))
    assert "not in the model store" in _refused(lambda: client.copy("loose", "x"))


def test_a_copy_cannot_take_a_built_in_or_served_name(stored):
    client, store, _ = stored
    # a built-in (served here or not), a model outside the store, a --model file, any case
    for dest in ("gemma3-270m", "smol", "alpha", "loose", "Loose:latest"):
        error = _refused(lambda dest=dest: client.copy("tiny", dest))
        assert f"{dest!r}" in error and "cannot be copied over" in error
    assert [m.name for m in store.list()] == ["tiny"]
    tags = {m.model: m for m in client.list().models}
    assert tags["smol"].digest == tags["alpha"].digest == ""  # still not the store's


# -- the store: pull ------------------------------------------------------------------------


def test_a_pull_streams_progress_then_serves_the_model(stored, monkeypatch):
    client, store, path = stored
    seen: dict = {}

    def fake_pull(store_, ref, *, progress, name, cancel, resume):  # the hub: tests/models
        seen.update(ref=ref, name=name, resume=resume)
        progress(PullProgress("pulling manifest"))
        for done in (0, 512, 1024):
            progress(PullProgress("pulling model.gguf", done, 1024, "model.gguf"))
        progress(PullProgress("success"))
        return adopt(store_, path, name)

    monkeypatch.setattr("ferrum.api.ollama.models.pull", fake_pull)
    lines = [dict(p) for p in client.pull("hf.co/org/repo:Q8_0", stream=True)]
    assert seen == {"ref": "hf.co/org/repo:Q8_0", "name": "hf.co/org/repo:Q8_0", "resume": False}
    assert lines[0] == {
        "status": "pulling manifest",
        "completed": None,
        "total": None,
        "digest": None,
    }
    assert [(p["completed"], p["total"]) for p in lines[1:4]] == [
        (0, 1024),
        (512, 1024),
        (1024, 1024),
    ]
    assert lines[1]["status"] == "pulling model.gguf"
    assert [p["status"] for p in lines].count("success") == 1 and lines[-1]["status"] == "success"
    # The name pulled is the name served: the client's next request finds it.
    assert client.chat("hf.co/org/repo:Q8_0", HI, options=GREEDY).done
    assert "hf.co/org/repo:Q8_0" in [m.name for m in store.list()]
    assert client.pull("hf.co/org/repo:Q8_0").status == "success"  # whole: one object


def test_a_failed_pull_ends_with_an_error(stored, monkeypatch):
    client, _, _ = stored
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ollama.ResponseError) as err:
        list(client.pull("org/repo", stream=True))
    assert "cannot reach" in err.value.error
    assert "cannot reach" in _refused(lambda: client.pull("org/repo"), 502)


def test_a_copy_whose_destination_cannot_be_a_file_name_is_a_400_naming_it(stored):
    client, store, _ = stored
    for destination in ("x" * 300, "/" * 100, "a\nb"):
        assert "destination" in _refused(lambda d=destination: client.copy("tiny", d))
    assert [m.name for m in store.list()] == ["tiny"]


def test_a_pull_of_a_name_the_hub_cannot_hold_is_refused_before_the_hub(stored, monkeypatch):
    client, _, _ = stored
    called = []
    monkeypatch.setattr("ferrum.api.ollama.models.pull", lambda *a, **kw: called.append(a))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    too_long = f"hf.co/org/{'r' * 97}:Q4_K_M"
    for stream in (True, False):
        assert "96 characters" in _refused(lambda s=stream: list(client.pull(too_long, stream=s)))
    # A name the hub could hold but the store cannot (over 200 characters) is refused too.
    store_too_long = f"hf.co/{'o' * 96}/{'r' * 96}:Q4_K_M"
    assert "too long" in _refused(lambda: client.pull(store_too_long))
    assert called == []


def test_a_pull_cannot_take_a_built_in_or_served_name(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    specs = [
        ModelSpec("smol", lambda: "", "builtin:smol", preset=Preset(aliases=("org/smol",))),
        ModelSpec("org/loose", lambda: str(path), f"file:{path}"),
    ]
    monkeypatch.setattr("ferrum.api.ollama.models.pull", _no_pull)
    store = ModelStore(tmp_path / "store")
    kw = {"registry": {"specs": specs}, "store": store, "keys": Keys(open_admin=True)}
    with served(models={"smol": FakeRunner, "org/loose": FakeRunner}, **kw) as (client, http):
        for name in ("org/smol", "org/loose", "ORG/LOOSE:latest"):
            error = _refused(lambda name=name: client.pull(name))
            assert f"{name!r}" in error and "cannot be pulled over" in error
        assert store.list() == []
        assert [s.source for s in http.app.state.ferrum.models.specs()][1] == f"file:{path}"


def _no_pull(*args, **kwargs):
    raise AssertionError("the pull should have been refused before it started")


def test_a_pull_of_a_local_file_is_refused(stored):
    client, _, path = stored
    assert "ferrum pull" in _refused(lambda: client.pull(str(path)))
    assert "ferrum pull" in _refused(lambda: client.pull("/etc/passwd"))


def test_the_typed_client_reads_every_answer_strictly_and_refuses_one_off_its_types():
    """`ollama_typed` (used by the bridge above on every answer) is a real check: a count sent
    as a string, which the lenient client would coerce, fails in strict mode."""
    from pydantic import ValidationError

    from tests.schema_check import ollama_typed

    with served() as (client, http):
        client.chat("fake", HI, options=GREEDY)  # the bridge checked it
        good = http.post("/api/generate", json={"model": "fake", "prompt": "hi", "stream": False})
    body = good.json()
    ollama_typed("/api/generate", 200, "application/json", good.content)
    body["eval_count"] = str(body["eval_count"])
    with pytest.raises(ValidationError):
        ollama_typed("/api/generate", 200, "application/json", json.dumps(body).encode())
