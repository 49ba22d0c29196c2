"""OpenAI request bodies as pydantic models, and their translation into engine parameters.

Unknown fields are tolerated (clients send many); fields we cannot honour yet are rejected
with a 400 naming them rather than silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ferrum.engine.request import SamplingParams
from ferrum.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 8
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 256

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
]
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]


_FIELD = re.compile(r"[a-z_][a-z0-9_]*|[0-9]+")  # a field name, or a map key that is a number
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # union members' names


def invalid_request(errors: Sequence[Any]) -> InvalidRequest:
    """pydantic's validation errors as one OpenAI 400 naming the first bad parameter."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return InvalidRequest("the request body is not valid JSON")
    param = _param(first.get("loc", ())) or None
    msg = first.get("msg", "invalid request")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


def _param(loc: Sequence[int | str]) -> str:
    """An error location as the request parameter, `tools[0].function.name`: the `body`
    prefix and union member tags (`literal['none','auto']`, `NamedToolChoice`) left out."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD.fullmatch(part) and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
    return param


class LoraChoice(BaseModel):
    """One of llama-server's `lora` entries: an adapter id (flag order) and its scale."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    id: int
    scale: float = 1.0


class _Body(BaseModel):
    # Strict: a JSON value of the wrong type is refused rather than coerced (true is not 1, 2.5
    # is not 2), so requests mean what the OpenAPI schema says.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str  # a data URI (`prompting/images.py`)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    # Tool turns: an assistant's calls, and the id a tool result answers.
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, for templates that show it (both names are in use).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    # `json` shadows a BaseModel method, hence the alias.
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDef(_Body):
    # OpenAI allows letters, digits, "_" and "-"; dots are common in MCP tool names.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type object; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type object")
        return v


class Tool(_Body):
    type: Literal["function"] = "function"  # the only kind a local model can call
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingBody(_Body):
    model: str = ""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    logit_bias: LogitBias | None = None
    ignore_eos: bool = False
    timeout: Annotated[float, Field(gt=0)] | None = None  # extension: seconds for this request
    # Extension (Ollama's): how long the model stays loaded after this request.
    keep_alive: str | float | None = None
    # Extensions (vLLM's names): tokens that end the output, and a floor on its length.
    stop_token_ids: StopTokenIds | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    # Extension: n-gram speculation for this request (None: the server's --spec-type). The
    # output is the same either way; false saves the guessing where it cannot pay.
    speculate: bool | None = None
    # Extension (vLLM's name): the request reuses, and leaves for reuse, only prompt prefixes
    # of requests with the same salt (`ferrum.api.auth.cache_scope`).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Extensions, structured output (api/prompting/grammar.py): llama-server's `json_schema`
    # and `grammar` (GBNF), vLLM's `guided_*` and `structured_outputs`.
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Extension (llama-server's): LoRA adapters by id and scale (`ferrum.models.adapters`).
    lora: Annotated[list[LoraChoice], Field(max_length=64)] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def reject_unsupported(self) -> None:
        pass

    def constraint_fields(self) -> list[tuple[str, str, Any]]:
        """(parameter, kind, source) of each structured-output extension field given; the
        kinds are `ferrum.engine.constraint.KINDS`."""
        fields: list[tuple[str, str, Any]] = [
            ("json_schema", "json_schema", self.json_schema),
            ("grammar", "grammar", self.grammar),
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        so = self.structured_outputs
        if so is not None:
            fields += [
                ("structured_outputs.json", "json_schema", so.json_),
                ("structured_outputs.regex", "regex", so.regex),
                ("structured_outputs.choice", "choice", so.choice),
                ("structured_outputs.grammar", "grammar", so.grammar),
            ]
        return [f for f in fields if f[2] is not None]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the sampled token's and k alternatives."""
        return None

    def _logit_bias(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            # A plain decimal id only: str.isdigit() also passes "²" and other digits that
            # int() refuses, and int() refuses more than 4,300 digits.
            digits = key.strip()
            plain = digits.isascii() and digits.isdigit() and len(digits) <= 10
            token = int(digits) if plain else -1
            if not 0 <= token < n_vocab:
                raise InvalidRequest(
                    f"logit_bias keys must be token ids in [0, {n_vocab}); got {key!r}",
                    param="logit_bias",
                )
            pairs.append((token, bias))
        return tuple(pairs)

    def sampling_params(
        self, max_tokens: int, n_vocab: int, grammar: str | None = None
    ) -> SamplingParams:
        stop_ids = tuple(self.stop_token_ids or ())
        if any(t >= n_vocab for t in stop_ids):
            raise InvalidRequest(
                f"stop_token_ids must be token ids below {n_vocab}", param="stop_token_ids"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            stop_token_ids=stop_ids,
            min_tokens=min(self.min_tokens, max_tokens),
            logit_bias=self._logit_bias(n_vocab),
            logprobs=self.num_logprobs(),
            grammar=grammar,
            speculate=self.speculate,
        )


StructuredRequest = _SamplingBody  # what api/prompting/grammar.py reads


class ChatCompletionRequest(_SamplingBody):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


class CompletionRequest(_SamplingBody):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str):
            return prompt[0]
        return [int(t) for t in prompt]

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of is not supported", param="best_of")


class TokenizeRequest(_Body):
    model: str = ""
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeRequest(_Body):
    model: str = ""
    tokens: list[Annotated[int, Field(ge=0)]]
