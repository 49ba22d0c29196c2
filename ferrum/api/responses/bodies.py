"""The Responses API's request body and its translation into a chat completion body
(`openai/bodies.py`), which the shared serving path takes from there.

Rules:
- `input` is a string (one user message) or a list of items: messages (roles user, system,
  developer, assistant; text parts `input_text`, `output_text`, `refusal`), `function_call`,
  `function_call_output` and `reasoning` items. A message's `input_image` parts (`image_url`
  a data URI) become the chat's `image_url` parts, served as its images are
  (`prompting/images.py`; an error names the part, `image_params`); an image by `file_id`,
  files, audio and every other item type (hosted tools' calls, `item_reference`) are refused
  with a 400 naming the item. A stored conversation keeps its images, for its continuations.
- A `function_call` joins the assistant turn before it (or opens one); a `reasoning` item's
  text becomes the next assistant turn's `reasoning_content`; a `function_call_output` must
  answer a call made earlier in the conversation (this input or the stored history).
- `instructions` become the system message, and are not carried into a continuation: as
  OpenAI's, each request states its own.
- `tools` are function tools in the Responses shape (`name` at the top); other tool types
  (web search, file search, computer use, MCP, ...) are refused by name. `text.format` is
  `response_format`; `max_output_tokens` is max_tokens; `reasoning.effort` is accepted and
  does not change the prompt (ferrum cannot tell a template how hard to think).
- Fields a request leaves out take the model preset's defaults, as on chat completions.
- An error in a translated body names the parameter as the client wrote it (`renamed`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferrum.api.openai.bodies import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest, invalid_request
from ferrum.api.prompting.images import image_names, image_parts, renamed_image
from ferrum.errors import InvalidRequest

Messages = list[dict[str, Any]]

# Chat completion parameters as a Responses client wrote them, for error messages.
_RESPONSES_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "messages": "input",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_file", "input_audio")
_ROLES = ("user", "system", "developer", "assistant")


class _Body(BaseModel):
    # As in openai/bodies.py: wrong JSON types are refused, unknown fields tolerated.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str = ""
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] = ""
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    reasoning: Reasoning | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # Echoed only: ferrum keeps no per-user safety record, and its prefix cache finds a
    # prompt's cached start by the tokens alone.
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    # Extensions shared with chat completions: seconds for this request, and how long the
    # model stays loaded after it.
    timeout: Annotated[float, Field(gt=0)] | None = None
    keep_alive: str | float | None = None

    def check(self) -> None:
        if self.background:
            raise InvalidRequest(
                "background responses are not supported: ferrum answers while the request "
                "is open (stream: true streams it)",
                param="background",
            )
        if not self.input and self.previous_response_id is None:
            raise InvalidRequest("input is required", param="input")

    def format_dict(self) -> dict[str, Any] | None:
        """`text.format` as the request gave it, in the published shape, for echoing in the
        response."""
        if self.text is None or self.text.format is None:
            return None
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True)
        if fmt["type"] == "json_schema":
            # The grammar always holds the output to the schema: strict, whatever was asked.
            # Open Responses requires a description, OpenAI's schema a string if present.
            fmt.update(description=self.text.format.description or "", strict=True)
        return fmt


def parse_body(raw: bytes) -> ResponsesRequest:
    try:
        body = ResponsesRequest.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None
    body.check()
    return body


# -- input items into chat messages ---------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """An output's content: a string or a list of text parts."""
    parts = _content(content, where, images=False)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def _content(content: Any, where: str, images: bool = True) -> str | Messages:
    """A message's content: a string, or a list of parts as chat parts (text, and images
    where `images`); the text alone when it holds no image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", param=where)
    parts: Messages = []
    for j, part in enumerate(content):
        param = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS or (kind == "input_image" and not images):
            raise InvalidRequest(
                f"{param}: {kind} is not supported here: ferrum reads text, and images in a "
                "message", param=param,
            )  # fmt: skip
        if kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, param)}})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise InvalidRequest(
                f"{param}: expected a text part ({', '.join(_TEXT_PARTS)}) or input_image, "
                f"got {kind!r}", param=param,
            )  # fmt: skip
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image_url(part: dict[str, Any], param: str) -> str:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise InvalidRequest(
            f"{param}.file_id: images by file_id are not supported (ferrum keeps no files): "
            "send the image as a data URI in image_url", param=f"{param}.file_id",
        )  # fmt: skip
    if not isinstance(url, str):
        raise InvalidRequest(
            f"{param}.image_url: an input_image needs an image_url (a data URI)",
            param=f"{param}.image_url",
        )
    return url


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


class _Conversation:
    """Chat messages built item by item; knows every call id made so far."""

    def __init__(self, history: Messages):
        self.messages: Messages = []
        self.call_ids = {c["id"] for m in history for c in m.get("tool_calls", ())}
        self._reasoning = ""  # a reasoning item's text, for the next assistant turn

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in self.call_ids:
                raise InvalidRequest(
                    f"{where}.call_id: no function_call with call_id {call_id!r} in this "
                    "conversation",
                    param=f"{where}.call_id",
                )
            output = _text(item.get("output"), f"{where}.output")
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = list(item.get("content") or ()) + list(item.get("summary") or ())
            texts = [p.get("text") for p in parts if isinstance(p, dict)]
            self._reasoning += "".join(t for t in texts if isinstance(t, str))
        else:
            raise InvalidRequest(
                f"{where}.type: input item type {kind!r} is not supported (ferrum takes "
                "message, function_call, function_call_output and reasoning items)",
                param=f"{where}.type",
            )

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role"
            )
        content = _content(item.get("content"), f"{where}.content")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            self._take_reasoning(message)
        self.messages.append(message)

    def _call(self, item: dict[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where)
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)},
        }  # fmt: skip
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = {"role": "assistant", "content": ""}
            self._take_reasoning(last)
            self.messages.append(last)
        last.setdefault("tool_calls", []).append(call)
        self.call_ids.add(call_id)

    def _take_reasoning(self, message: dict[str, Any]) -> None:
        if self._reasoning:
            message["reasoning_content"], self._reasoning = self._reasoning, ""


def input_messages(body: ResponsesRequest, history: Messages) -> Messages:
    """The request's input as chat messages; `history` (a stored conversation) is what its
    function_call_output items may answer."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}] if body.input else []
    conversation = _Conversation(history)
    for i, item in enumerate(body.input):
        conversation.add(item, f"input[{i}]")
    return conversation.messages


# -- into the chat completion body ----------------------------------------------------------


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}].type: {kind!r} tools are not supported: ferrum runs function "
                "tools, whose calls the client executes",
                param=f"tools[{i}].type",
            )
        keys = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in keys if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be none, auto, required or {type: function, name}",
        param="tool_choice",
    )


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.json_schema is None:
        raise InvalidRequest("text.format: type json_schema needs a schema", param="text.format")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.json_schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def image_params(body: ResponsesRequest, served: ChatCompletionRequest) -> dict[str, str]:
    """The request's image names: those of `served` (its `chat_request`) → the client's. A
    stored conversation's images come first, named by the `previous_response_id` that holds
    them."""
    items = body.input if isinstance(body.input, list) else []
    names = [
        f"input[{i}].content[{j}]"
        for i, item in enumerate(items)
        if item.get("type", "message") == "message" and isinstance(item.get("content"), list)
        for j, part in enumerate(item["content"])
        if isinstance(part, dict) and part.get("type") == "input_image"
    ]  # fmt: skip
    stored = len(image_parts(served.messages)) - len(names)
    return image_names(served.messages, ["previous_response_id"] * stored + names)


def renamed(err: InvalidRequest, images: Mapping[str, str] | None = None) -> InvalidRequest:
    """The error with its parameter named as the Responses client wrote it; `images`: the
    request's image names (`image_params`)."""
    if images and (named := renamed_image(err, images)) is not None:
        return named
    param = err.param or ""
    if param.startswith("tools[") and ".function." in param:  # tools[0].function.name
        name = param.replace(".function.", ".", 1)
        return InvalidRequest(err.message.replace(param, name, 1), param=name)
    for chat, ours in _RESPONSES_PARAMS.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            name = ours + param.removeprefix(chat)
            return InvalidRequest(err.message.replace(param, name, 1), param=name)
    return err


def chat_request(body: ResponsesRequest, messages: Messages) -> ChatCompletionRequest:
    """The chat completion body that serves this response: `messages` is the whole
    conversation (instructions, history, input); unset sampling fields stay unset so that
    the preset's defaults fill them."""
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.instructions:
        fields["messages"] = [{"role": "system", "content": body.instructions}, *messages]
    for name in ("temperature", "top_p", "parallel_tool_calls", "timeout", "keep_alive"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    if body.tools:
        fields["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = _response_format(body.text.format)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(invalid_request(exc.errors())) from None


def size_of(value: Any) -> int:
    """Bytes a stored value takes, as JSON: what the store is bounded by."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
