"""Tool calls in model output: each chat-template family's call format, parsed from whole or
streamed text, and the grammar that forces a call when `tool_choice` demands one.

What a model writes for one call (`CALL` is `{"name": ..., "arguments": {...}}`):

    hermes   <tool_call>\\nCALL\\n</tool_call>        one block per call (Hermes, Qwen 2.5/3,
                                                     ferrum's chatml)
    llama3   {"name": ..., "parameters": {...}}     Llama 3.1+ JSON calls: at the very start of
                                                     the output or after <|python_tag|>; several
                                                     are separated by newlines or ";"
    mistral  [TOOL_CALLS][CALL, CALL]               a JSON list; [TOOL_CALLS] is a control token
                                                     the detokenizer may drop, so a bare leading
                                                     [{"name" list is a call list too
    gemma    ```tool_call\\nCALL\\n```               ferrum's own convention: Gemma 3 has no
                                                     official tool format, and a fenced block is
                                                     what a model trained on Markdown writes most
                                                     reliably; results come back in ```tool_output
                                                     fences

Streaming rule (like the stop-string hold-back): text that might still become the start of a
marker is held back, a call's body is buffered until it closes (or the output ends), and only
then the whole `ToolCall` is emitted. Markers are searched only outside JSON strings, so an
argument that contains ``` or </tool_call> does not end the call. Text that fails to parse as
a call is given back verbatim as content. Whitespace between content and a call is dropped;
after a call it is kept only as the separator before more content.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

_SEPARATORS = " \t\r\n;,"  # between bare JSON calls (llama3 writes "; " or newlines)


@dataclass(frozen=True)
class ToolCall:
    index: int  # position among this output's calls (the OpenAI stream's tool_calls[].index)
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax: how to find calls (parser) and how to write them
    (prompts for templates that ignore `tools`, grammars)."""

    name: str
    open_markers: tuple[str, ...]
    close_marker: str | None = None  # None: after the marker come JSON values up to the end
    bare_starts: tuple[tuple[str, ...], ...] = ()  # token paths that open calls at output start
    args_key: str = "arguments"
    call_open: str = ""
    call_close: str = ""
    call_sep: str = "\n"
    list_open: str = ""
    list_close: str = ""
    result_open: str = ""
    result_close: str = ""
    short_ids: bool = False  # Mistral's templates insist on 9-character alphanumeric ids

    def stream_parser(self) -> ToolStreamParser:
        return ToolStreamParser(self)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; the same as streaming it in any chunks."""
        parser = self.stream_parser()
        first, last = parser.feed(text), parser.finish()
        return first.content + last.content, first.calls + last.calls

    def new_id(self) -> str:
        if self.short_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Writes (name, arguments JSON) calls the way this family's model would."""
        items = [
            f'{self.call_open}{{"name": {json.dumps(name, ensure_ascii=False)}, '
            f'"{self.args_key}": {arguments}}}{self.call_close}'
            for name, arguments in calls
        ]
        return self.list_open + self.call_sep.join(items) + self.list_close

    def render_result(self, content: str) -> str:
        return f"{self.result_open}{content}{self.result_close}"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt section teaching this format, for templates that ignore `tools`."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.render_calls([("function_name", '{"argument": "value"}')])
        return (
            f"You can call these functions, given as JSON schemas:\n{listing}\n\n"
            f"To call one, answer with exactly this form (one per call):\n{example}\n"
            f"Function results come back as:\n{self.render_result('...')}"
        )


HERMES = ToolFormat(
    name="hermes",
    open_markers=("<tool_call>",),
    close_marker="</tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    result_open="<tool_response>\n",
    result_close="\n</tool_response>",
)
LLAMA3 = ToolFormat(
    name="llama3",
    open_markers=("<|python_tag|>",),
    bare_starts=(("{", '"name"'), ("{", '"type"')),
    args_key="parameters",
)
MISTRAL = ToolFormat(
    name="mistral",
    open_markers=("[TOOL_CALLS]",),
    bare_starts=(("[", "{", '"name"'),),
    call_sep=", ",
    list_open="[",
    list_close="]",
    result_open="[TOOL_RESULTS]",
    result_close="[/TOOL_RESULTS]",
    short_ids=True,
)
GEMMA = ToolFormat(
    name="gemma",
    open_markers=("```tool_call",),
    close_marker="```",
    call_open="```tool_call\n",
    call_close="\n```",
    result_open="```tool_output\n",
    result_close="\n```",
)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GEMMA)}


def detect_format(template_text: str) -> ToolFormat:
    """The tool-call format a chat template teaches, from the markers it writes; Hermes when
    it shows none (the most widely trained convention)."""
    t = template_text
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "ipython" in t):
        return LLAMA3
    if "```tool_call" in t or "<start_of_turn>" in t:
        return GEMMA
    return HERMES


def _calls_from_json(text: str, fmt: ToolFormat, first_index: int) -> list[ToolCall] | None:
    """The calls a JSON object or list spells, or None when it is not valid calls."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls: list[ToolCall] = []
    for item in items:
        if isinstance(item, dict) and "name" not in item and isinstance(item.get("function"), dict):
            item = item["function"]  # {"type": "function", "function": {...}}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif not isinstance(args, str):
            return None
        calls.append(ToolCall(first_index + len(calls), fmt.new_id(), item["name"], args))
    return calls or None


def _bare_start(text: str, paths: tuple[tuple[str, ...], ...]) -> tuple[str, int]:
    """Whether text opens with one of the token paths (whitespace between tokens allowed):
    ("yes", offset of the first token), ("maybe", 0) while too short to tell, or ("no", 0)."""
    verdict = "no"
    for path in paths:
        pos = 0
        for token in path:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            rest = text[pos : pos + len(token)]
            if rest != token:
                if len(rest) < len(token) and token.startswith(rest):
                    verdict = "maybe"
                break
            pos += len(token)
        else:
            return "yes", len(text) - len(text.lstrip())
    return verdict, 0


def _holdback(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of a marker."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class _JsonScan:
    """Walks text once across feeds, tracking JSON strings and nesting, so that brackets and
    markers inside string values are never taken for structure."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_str = False
        self.escaped = False

    def _take(self, c: str) -> None:
        if self.in_str:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_str = False
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1

    def value_end(self, text: str) -> int:
        """End of the object or list that opens text[0], or -1 while it is incomplete."""
        while self.pos < len(text):
            self._take(text[self.pos])
            self.pos += 1
            if self.depth == 0 and not self.in_str:
                return self.pos
        return -1

    def marker_at(self, text: str, marker: str) -> int:
        """Where marker first appears outside any JSON string or bracket, or -1 for now."""
        while self.pos + len(marker) <= len(text):
            if self.depth <= 0 and not self.in_str and text.startswith(marker, self.pos):
                return self.pos
            self._take(text[self.pos])
            self.pos += 1
        return -1


class ToolStreamParser:
    """Splits a text stream into content and completed tool calls (see the module docstring).

    State: content mode (looking for a marker) or inside a call region; `_buf` is the text not
    yet given out, and `_opener` the marker text that opened the region, which goes back to
    the content when the region holds no valid call."""

    def __init__(self, fmt: ToolFormat) -> None:
        self._fmt = fmt
        self._buf = ""
        self._in_call = False
        self._opener = ""
        self._scan: _JsonScan | None = None
        self._at_start = bool(fmt.bare_starts)
        self._after_call = False
        self._region_calls = 0
        self._n_calls = 0
        self._said = False  # whether any content has been given out

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> StreamDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        while True:
            if not self._in_call:
                progressed = self._content_step(out, final)
            elif self._fmt.close_marker is not None:
                progressed = self._closed_step(out, final)
            else:
                progressed = self._open_step(out, final)
            if not progressed:
                return out

    def _say(self, out: StreamDelta, text: str) -> None:
        out.content += text
        self._said = self._said or bool(text)

    def _emit_calls(self, out: StreamDelta, calls: list[ToolCall]) -> None:
        out.calls.extend(calls)
        self._n_calls += len(calls)
        self._after_call = True

    def _enter_region(self, opener: str, rest: str) -> None:
        self._in_call, self._opener, self._buf = True, opener, rest
        self._scan, self._region_calls, self._at_start = None, 0, False

    def _content_step(self, out: StreamDelta, final: bool) -> bool:
        if self._after_call:
            # Whitespace after a call separates it from later content, unless nothing follows
            # or the content has not begun yet.
            if not self._buf.strip():
                self._buf = "" if final else self._buf
                return False
            self._after_call = False
            if not self._said:
                self._buf = self._buf.lstrip()
        buf = self._buf
        if self._at_start:
            verdict, offset = _bare_start(buf, self._fmt.bare_starts)
            if verdict == "maybe" and not final:
                return False
            self._at_start = False
            if verdict == "yes":
                self._enter_region(buf[:offset], buf[offset:])
                return True
        found = [(buf.find(m), m) for m in self._fmt.open_markers if m in buf]
        if found:
            at, marker = min(found)
            before = buf[:at].rstrip()
            self._say(out, before)
            self._enter_region(buf[len(before) : at] + marker, buf[at + len(marker) :])
            return True
        if final:
            self._say(out, buf)
            self._buf = ""
            return False
        # Trailing whitespace waits too: it is dropped if a call follows.
        cut = len(buf) - _holdback(buf, self._fmt.open_markers)
        while cut > 0 and buf[cut - 1].isspace():
            cut -= 1
        self._say(out, buf[:cut])
        self._buf = buf[cut:]
        return False

    def _closed_step(self, out: StreamDelta, final: bool) -> bool:
        close = self._fmt.close_marker or ""
        scan = self._scan = self._scan or _JsonScan()
        at = scan.marker_at(self._buf, close)
        if at < 0 and not final:
            return False
        body, rest = (self._buf, "") if at < 0 else (self._buf[:at], self._buf[at + len(close) :])
        calls = _calls_from_json(body, self._fmt, self._n_calls)
        self._in_call, self._buf = False, rest
        if calls is None:
            self._say(out, self._opener + body + (close if at >= 0 else ""))
        else:
            self._emit_calls(out, calls)
        return True

    def _open_step(self, out: StreamDelta, final: bool) -> bool:
        buf = self._buf
        if self._scan is None:
            skip = len(buf) - len(buf.lstrip(_SEPARATORS))
            if skip == len(buf) and not final:
                return False
            self._opener, buf = self._opener + buf[:skip], buf[skip:]
            self._buf = buf
            if not buf or buf[0] not in "{[":
                return self._leave_region(out, "")
            self._scan = _JsonScan()
        end = self._scan.value_end(buf)
        if end < 0:
            return final and self._leave_region(out, "")
        calls = _calls_from_json(buf[:end], self._fmt, self._n_calls)
        if calls is None:
            return self._leave_region(out, buf[:end], rest=buf[end:])
        self._emit_calls(out, calls)
        self._region_calls += len(calls)
        self._opener, self._buf, self._scan = "", buf[end:], None
        return True

    def _leave_region(self, out: StreamDelta, invalid: str, rest: str | None = None) -> bool:
        """Ends a bare-JSON region: text that is not a call goes back to content mode, with
        the region's marker when the region produced no call."""
        if self._region_calls == 0:
            self._say(out, self._opener)
        self._say(out, invalid)
        self._in_call, self._scan, self._opener = False, None, ""
        if rest is not None:
            self._buf = rest
        return True
