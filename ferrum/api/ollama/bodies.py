"""Ollama's request bodies and their translation into the OpenAI ones (`openai/bodies.py`), which
the shared serving path (`serving.py`) takes from there.

Rules:
- The bodies refuse wrong JSON types and tolerate unknown fields, as `openai/bodies.py` does.
- /api/generate renders the prompt with the model's chat template (`system`, then `prompt` as
  the user turn), as Ollama does; `raw: true` sends the prompt as it is (a text completion,
  whose thinking, if any, stays in `response`).
- `options`: temperature, top_p, top_k, min_p, seed, stop, presence_penalty and
  frequency_penalty keep their names; repeat_penalty is repetition_penalty; num_predict is
  max_tokens (0 or less, as Ollama's -1 and -2: no limit). Every other option is ignored,
  num_ctx included: a model's context is sized when it loads and shared by all its requests,
  so one request cannot change it. Options a request leaves out take the model preset's
  defaults as on the OpenAI routes, not Ollama's (temperature 0.8, top_k 40): one model
  answers alike in both dialects.
- `format`: "json" is a JSON object grammar, a schema object a JSON Schema grammar.
- `tools` are OpenAI's function tools in the same shape. Tool results (`tool_name`) answer
  the latest assistant turn's calls in order: Ollama's messages carry no call ids.
- `images` (base64 strings, as Ollama takes them; a data URI is taken too) on a message of
  /api/chat or on /api/generate become that turn's `image_url` parts, before its text as
  Ollama places them, served as the OpenAI chat's images are (`prompting/images.py`); an
  error names the image as `messages[i].images[k]` or `images[k]` (`image_names`).
- Refused with a 400: suffix, template (ferrum renders the model's Jinja template, not
  Ollama's Go templates), context (/api/generate never returns one: /api/chat carries
  history), logprobs, and format or images with raw.
- An error in a translated body names its parameter as the Ollama client wrote it
  (`options.num_predict`, not `max_tokens`): `renamed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest, invalid_request
from ferrum.api.prompting.images import image_names, renamed_image
from ferrum.errors import InvalidRequest

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)
M = TypeVar("M", bound=BaseModel)

# Sampling options that keep their name in the OpenAI body; the rest is renamed or ignored.
_SAME_OPTIONS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
    "frequency_penalty",
)  # fmt: skip
# OpenAI body parameters as an Ollama client wrote them, for error messages (longest first).
_OLLAMA_PARAMS = {
    **{name: f"options.{name}" for name in _SAME_OPTIONS},
    "max_tokens": "options.num_predict",
    "repetition_penalty": "options.repeat_penalty",
    "response_format.json_schema.schema": "format",
    "response_format": "format",
}


# -- request bodies -------------------------------------------------------------------------


class _Body(BaseModel):
    # As in openai/bodies.py: wrong JSON types are refused, unknown fields tolerated.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class _FunctionCall(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class _ToolCall(_Body):
    function: _FunctionCall


class _Message(_Body):
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_name: str | None = None


class Generation(_Body):
    """What /api/chat and /api/generate share."""

    model: str = ""
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    think: bool | Literal["high", "medium", "low"] | None = None
    logprobs: bool | None = None

    def check(self) -> None:
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported on the Ollama API", param="logprobs")


class ChatBody(Generation):
    messages: list[_Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(Generation):
    prompt: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    context: list[int] | None = None

    def check(self) -> None:
        super().check()
        refused = {
            "suffix": "suffix (fill-in-the-middle) is not supported",
            "template": "template is not supported: ferrum renders the model's own template",
            "context": "context is not supported: send the history to /api/chat",
        }
        for name, why in refused.items():
            if getattr(self, name):
                raise InvalidRequest(why, param=name)
        for name in ("format", "images"):
            if self.raw and getattr(self, name):
                raise InvalidRequest(f"{name} needs the chat template: not with raw", param=name)


class ModelRef(_Body):
    model: str = ""
    name: str = ""  # older clients' name for `model`

    @property
    def ref(self) -> str:
        return self.model or self.name


class PullBody(ModelRef):
    stream: bool = True


class CopyBody(_Body):
    source: str
    destination: str


async def parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


# -- into the OpenAI bodies -----------------------------------------------------------------


def _sampling(body: Generation) -> dict[str, Any]:
    """The OpenAI body fields of `options` and `format`; only those the request gives, so
    that the preset's defaults fill the rest (`with_defaults`)."""
    options = body.options or {}
    fields = {k: options[k] for k in _SAME_OPTIONS if options.get(k) is not None}
    if options.get("repeat_penalty") is not None:
        fields["repetition_penalty"] = options["repeat_penalty"]
    num_predict = options.get("num_predict")
    if num_predict is not None and not (isinstance(num_predict, int) and num_predict <= 0):
        fields["max_tokens"] = num_predict
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": body.format}}
    return {"model": body.model, **fields}


def renamed(err: InvalidRequest, images: Mapping[str, str] | None = None) -> InvalidRequest:
    """The error with its parameter named as the Ollama client wrote it; `images`: the
    request's image names (`image_names`)."""
    if images and (named := renamed_image(err, images)) is not None:
        return named
    param = err.param or ""
    for openai, ollama in _OLLAMA_PARAMS.items():
        if param == openai or param.startswith(openai + "."):
            name = ollama + param.removeprefix(openai)
            return InvalidRequest(err.message.replace(param, name, 1), param=name)
    return err


def _validated(cls: type[B], fields: dict[str, Any]) -> B:
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise renamed(invalid_request(exc.errors())) from None


def _openai_messages(messages: list[_Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # the ids of the latest assistant turn's calls not yet answered
    n_calls = 0
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": _content(m)}
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            # 9 alphanumeric characters: the only ids Mistral's templates accept.
            pending = [f"call{n_calls + j:05d}" for j in range(len(m.tool_calls))]
            n_calls += len(pending)
            msg["tool_calls"] = [
                {"id": cid, "type": "function", "function": c.function.model_dump()}
                for cid, c in zip(pending, m.tool_calls, strict=True)
            ]
        if m.role == "tool":
            if m.tool_name:
                msg["name"] = m.tool_name
            if pending:
                msg["tool_call_id"] = pending.pop(0)
        out.append(msg)
    return out


def _content(m: _Message) -> str | list[dict[str, Any]]:
    if not m.images:
        return m.content
    parts = [{"type": "image_url", "image_url": {"url": _data_uri(b64)}} for b64 in m.images]
    return [*parts, {"type": "text", "text": m.content}]


def _data_uri(image: str) -> str:
    """Ollama's base64 image as a data URI; its type from the first bytes (PNG's or JPEG's
    signature), though only the decoder's reading of the bytes decides what it is."""
    if image.startswith("data:"):
        return image
    kind = "jpeg" if image.startswith("/9j/") else "png"
    return f"data:image/{kind};base64,{image}"


def image_params(
    body: ChatBody | GenerateBody, served: ChatCompletionRequest | CompletionRequest
) -> dict[str, str]:
    """The request's image names: those of `served` (its translation) → the Ollama client's."""
    if not isinstance(served, ChatCompletionRequest):
        return {}
    if isinstance(body, GenerateBody):
        names = [f"images[{k}]" for k in range(len(body.images or ()))]
    else:
        names = [f"messages[{i}].images[{k}]" for i, m in enumerate(body.messages)
                 for k in range(len(m.images or ()))]  # fmt: skip
    return image_names(served.messages, names)


def chat_request(body: ChatBody) -> ChatCompletionRequest:
    fields = _sampling(body) | {"messages": _openai_messages(body.messages)}
    if body.tools:
        fields["tools"] = body.tools
    return _validated(ChatCompletionRequest, fields)


def generate_request(body: GenerateBody) -> ChatCompletionRequest | CompletionRequest:
    if body.raw:  # Ollama ignores system in raw mode too
        return _validated(CompletionRequest, _sampling(body) | {"prompt": body.prompt})
    messages = [_Message(role="user", content=body.prompt, images=body.images)]
    if body.system:
        messages.insert(0, _Message(role="system", content=body.system))
    return _validated(
        ChatCompletionRequest, _sampling(body) | {"messages": _openai_messages(messages)}
    )
