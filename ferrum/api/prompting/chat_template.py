"""Chat templates: render messages with the model's Jinja template (sandboxed), then tokenize
so that special tokens are parsed in the template's own text but never inside client strings
(message content, reasoning, tool results, and any string of a tool's definition or of a call
in the history that would tokenize to a special token).

    rendered:  <bos><start_of_turn>user\\n  Hi <end_of_turn>  ...  <start_of_turn>model\\n
               ╰─── template: specials ──╯╰content╯╰──── template: specials ────────────╯
               parse_special=True          False       parse_special=True

The client strings are located by rendering twice, the second time with a placeholder for
each string: the placeholders mark exactly where each one landed, wherever the template put it
(a tools section in the system turn can hold any word of the conversation), as written or
escaped inside JSON (`tojson`). Strings of tool definitions and calls are marked only where
they would tokenize differently with specials parsed: the rest (`"type": "function"`) stay as
they are, for templates that branch on them.

A model without a template (the default Gemma 3 270M base model) gets its family's known
format; `--chat-template` picks a built-in by name or reads a Jinja file. Templates receive
`tools` and tool turns as HF's apply_chat_template gives them; one that ignores them gets them
written into plain messages in its family's tool-call format (tool_calls.py).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Template, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ferrum.api.prompting.builtin_templates import BUILTIN_TEMPLATES, resolve_template
from ferrum.api.prompting.images import IMAGE_MARK
from ferrum.api.prompting.tool_calls import ToolFormat, detect_format
from ferrum.errors import InvalidRequest

__all__ = ["BUILTIN_TEMPLATES", "ChatFormatter", "resolve_template", "split_content"]


def _raise(message: str) -> None:
    raise InvalidRequest(f"chat template: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)
Mark = Callable[[str], str]

# Stands in for one client string while the template lays out the prompt (private-use
# characters, so no tokenizer or template gives them meaning).
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class ChatFormatter:
    """Renders OpenAI chat messages (dicts, as pydantic's model_dump gives them) with a Jinja
    chat template and tokenizes the result.

    Messages may carry `tool_calls` (arguments given to the template as a mapping, as HF
    templates expect), `tool_call_id`, and `reasoning_content` (or `reasoning`). `tools` are
    OpenAI tool dicts. A template that never reads `tools` gets them as instructions in the
    system message, and one that never mentions `tool_calls` gets the history's tool turns
    written as plain text, both in `tool_format`, the format of the template's family."""

    template_text: str
    bos_text: str
    eos_text: str
    add_bos: bool
    tool_format: ToolFormat = field(init=False, repr=False)
    _template: Template = field(init=False, repr=False)
    _reads_tools: bool = field(init=False, repr=False)
    _renders_tool_turns: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        ast = env.parse(self.template_text)
        object.__setattr__(self, "_template", env.from_string(ast))
        object.__setattr__(self, "_reads_tools", "tools" in meta.find_undeclared_variables(ast))
        object.__setattr__(self, "_renders_tool_turns", "tool_calls" in self.template_text)
        object.__setattr__(self, "tool_format", detect_format(self.template_text))

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return self._render(messages, tools, _same, _same)

    def tokenize(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: Tokenize,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.tokenize_parts(messages, tokenize, tools)[0]

    def tokenize_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: Tokenize,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """The prompt's tokens, and the positions where each client string (a content, a
        tool result) starts. Template text and client strings are tokenized apart, so two
        prompts equal up to a client string share every token before it."""
        rendered = self.render(messages, tools)
        tokens: list[int] = []
        starts: list[int] = []
        if self.add_bos and not (self.bos_text and rendered.startswith(self.bos_text)):
            tokens = tokenize("", True, False)  # just the BOS the model expects
        for text, is_content in self._segments(messages, tools, rendered, tokenize):
            if is_content:
                starts.append(len(tokens))
            tokens += tokenize(text, False, not is_content)
        return tokens, starts

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        mark: Mark,
        mark_risky: Mark,
    ) -> str:
        """`mark` stands for every client string; `mark_risky` for those in tool definitions
        and calls (see the module's note)."""
        tools = [_mark_tree(t, mark_risky) for t in tools] if tools else tools
        prepared = [_template_message(m, mark, mark_risky) for m in messages]
        if not self._renders_tool_turns:
            prepared = _tool_turns_as_text(prepared, self.tool_format)
        if tools and not self._reads_tools:
            prepared = _with_instructions(prepared, self.tool_format.instructions(tools))
        try:
            return self._template.render(
                messages=prepared,
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=self.bos_text,
                eos_token=self.eos_text,
            )
        except InvalidRequest:
            raise
        except Exception as exc:  # templates fail on unexpected messages in any way Python can
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc

    def _segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        rendered: str,
        tokenize: Tokenize,
    ) -> list[tuple[str, bool]]:
        """Client strings (contents, reasoning, tool results, risky tool strings) located in
        the rendered prompt: exactly, by rendering again with a placeholder for each; by search
        when the template treats placeholders differently from the strings (e.g. inspects the
        content)."""
        strings: list[str] = []

        def mark(text: str) -> str:
            if not text.strip():
                return text
            strings.append(text)
            return f"\ue000{len(strings) - 1}\ue001"

        def specials(text: str) -> bool:
            return bool(text) and tokenize(text, False, True) != tokenize(text, False, False)

        def mark_risky(text: str) -> str:
            return mark(text) if specials(text) else text

        # One look at all the tool strings first: most requests hold no special token there,
        # and then none is tokenized on its own.
        calls = [m.get("tool_calls") for m in messages]
        risky = specials("\n".join(_strings([tools, calls])))
        try:
            layout = self._render(messages, tools, mark, mark_risky if risky else _same)
        except InvalidRequest:
            layout = None
        exact = _align(rendered, layout, strings) if layout is not None else None
        return exact if exact is not None else split_content(rendered, strings)


def _same(text: str) -> str:
    return text


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson (what GGUF templates are written against); Jinja's own HTML-escapes < > &.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # An image stands as its mark where it was, for tokenizing to find (images.py).
    return "".join(
        IMAGE_MARK if p.get("type") == "image_url" else p.get("text", "")
        for p in content
        if isinstance(p, Mapping)
    )


def _template_message(message: Mapping[str, Any], mark: Mark, mark_risky: Mark) -> dict[str, Any]:
    # Absent, not None: templates test `'tool_calls' in message` or `message.name is defined`.
    out = {k: v for k, v in message.items() if v is not None and v != []}
    out["content"] = mark(_text(message.get("content")))
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out["reasoning_content"] = mark(reasoning)
    if message.get("tool_calls"):
        out["tool_calls"] = [_template_call(c, mark_risky) for c in message["tool_calls"]]
    return out


def _template_call(call: Mapping[str, Any], mark_risky: Mark) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    function = _mark_tree(function, mark_risky)
    return {**call, "type": call.get("type", "function"), "function": function}


def _mark_tree(value: Any, mark: Mark) -> Any:
    """`value` (a tool's definition, a call) with every string in it, keys included, passed
    through `mark`."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, Mapping):
        return {_mark_tree(k, mark): _mark_tree(v, mark) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_tree(v, mark) for v in value]
    return value


def _strings(value: Any) -> list[str]:
    """Every string in `value`, keys included."""
    found: list[str] = []

    def keep(text: str) -> str:
        found.append(text)
        return text

    _mark_tree(value, keep)
    return found


def _in_json(s: str) -> str:
    """`s` as `tojson` writes it inside a JSON string."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _forms(s: str) -> tuple[str, ...]:
    """How a template may have written client string `s`: as is, trimmed, or escaped inside a
    JSON string."""
    return (s, s.strip(), s.lstrip(), s.rstrip(), _in_json(s))


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _tool_turns_as_text(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Tool turns for a template that knows nothing of tools: calls are written into the
    assistant's content, results (consecutive ones together) become a user turn."""
    out: list[dict[str, Any]] = []
    previous_role = ""
    for m in messages:
        if m["role"] == "tool":
            result = fmt.render_result(m["content"])
            if previous_role == "tool":
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                (c["function"].get("name", ""), _arguments_text(c["function"].get("arguments")))
                for c in m["tool_calls"]
            ]
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            content = f"{m['content']}\n{fmt.render_calls(calls)}".lstrip("\n")
            out.append({**rest, "content": content})
        else:
            out.append(m)
        previous_role = m["role"]
    return out


def _with_instructions(messages: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
    """The tool instructions joined to the leading system message, or as one."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]["content"]
        joined = f"{first}\n\n{instructions}" if first else instructions
        return [{**messages[0], "content": joined}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _align(rendered: str, layout: str, strings: list[str]) -> list[tuple[str, bool]] | None:
    """Segments of `rendered` read off `layout` (the same render with placeholders), or None
    when the two differ beyond the strings themselves (trimming is allowed for)."""
    parts = _PLACEHOLDER.split(layout)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for j in range(0, len(parts) - 1, 2):
        literal, index, after = parts[j], int(parts[j + 1]), parts[j + 2]
        if index >= len(strings) or not rendered.startswith(literal, pos):
            return None
        pos += len(literal)
        s = strings[index]
        for variant in _forms(s):
            if rendered.startswith(variant, pos) and rendered.startswith(after, pos + len(variant)):
                break
        else:
            return None
        segments += [(literal, False), (variant, True)]
        pos += len(variant)
    if rendered[pos:] != parts[-1]:
        return None
    segments.append((parts[-1], False))
    return [seg for seg in segments if seg[0]]


def split_content(rendered: str, contents: Sequence[str]) -> list[tuple[str, bool]]:
    """Splits the rendered prompt into (text, is_user_content) segments, in order.

    Each message's content is looked up after the previous one; templates may trim it or
    write it inside JSON, so the trimmed form, as is or escaped, is looked for. Content the
    template rewrote beyond that is not found and stays template text (tokenized with
    specials parsed): only custom templates that rewrite content do that, and the built-in
    ones never do.
    """
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for content in contents:
        trimmed = content.strip()
        if not trimmed:
            continue
        forms = (trimmed, _in_json(trimmed))
        found = [(at, form) for form in forms if (at := rendered.find(form, cursor)) >= 0]
        if not found:
            continue
        at, needle = min(found)
        if at > cursor:
            segments.append((rendered[cursor:at], False))
        segments.append((needle, True))
        cursor = at + len(needle)
    if cursor < len(rendered):
        segments.append((rendered[cursor:], False))
    return segments
