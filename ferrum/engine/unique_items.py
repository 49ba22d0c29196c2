"""`uniqueItems` enforced while JSON is written: a watch over the output's bytes that refuses
any token completing an array item equal to an earlier one (llguidance has no such keyword,
and no grammar can say "no two strings equal").

The API (`api/prompting/schema_unique.py`) accepts the keyword only where refusing such tokens
can never leave the output without a way on, and hands the engine one rule per array:

    {"path": [step, ...], "values": null}        items are free strings: a duplicate is
                                                 refused at its closing quote, and the string
                                                 can always go on instead
    {"path": [step, ...], "values": [v, ...]}    items come from a fixed set: each byte of an
                                                 item must lead to a value not yet used, and
                                                 no new item starts once all are used

A step names where the array sits: {"key": K}; {"index": true} (any item of an array);
{"at": I} and {"from": I} (a tuple's I-th item, the items after a tuple of I); {"pattern": R}
(a key R matches as JSON Schema's `pattern` does: ECMA-262, unanchored); {"other": [keys],
"patterns": [R]} (any other key: additionalProperties). A key written with an escape counts as
an additional property, as llguidance's grammar reads it.

Where a branch that allows any JSON describes the same array, a free-string array may also
receive numbers and true/false/null: a repeated one is refused where it ends (a number can
always go on instead) or, for a literal, at its first byte.

Items compare as JSON Schema compares them: by decoded value, 1 equal to 1.0, true not 1.
The watch follows the output's structure byte by byte (keys, indices, strings, escapes); it
trusts the grammar for validity and only tracks where each value is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema_rs
import numpy as np

_WHITESPACE = frozenset(b" \t\r\n")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_LITERALS = {b"t": ("b", True), b"f": ("b", False), b"n": ("z",)}


def canon(value: Any) -> tuple[Any, ...]:
    """A value's identity for uniqueness (bool apart from numbers; 1 and 1.0 one number)."""
    if isinstance(value, bool):
        return ("b", value)
    if value is None:
        return ("z",)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    return ("j", json.dumps(value, sort_keys=True))


@dataclass(frozen=True)
class Rule:
    """One array whose items must differ; `values` None means free strings."""

    path: tuple[dict[str, Any], ...]
    values: tuple[Any, ...] | None

    @classmethod
    def from_json(cls, rule: dict[str, Any]) -> Rule:
        """The rule; ValueError where a step's pattern is not a regex."""
        values = rule.get("values")
        path = tuple(rule["path"])
        for step in path:
            for pattern in [step.get("pattern"), *step.get("patterns", ())]:
                if pattern is not None:
                    key_matches(pattern, "")
        return cls(path, None if values is None else tuple(values))

    def matches(self, path: Sequence[str | int]) -> bool:
        return len(path) == len(self.path) and all(
            step_matches(step, at) for step, at in zip(self.path, path, strict=True)
        )


class EscapedKey(str):
    """A key written with an escape (`"\\u0062"`): llguidance's grammar matches property
    names by their spelling, so it takes such a key for an additional property."""


def step_matches(step: dict[str, Any], at: str | int) -> bool:
    if isinstance(at, int):
        return bool(step.get("index")) or step.get("at") == at or step.get("from", at + 1) <= at
    if "key" in step:
        return not isinstance(at, EscapedKey) and bool(step["key"] == at)
    if "pattern" in step:
        return key_matches(step["pattern"], at)
    if "other" in step:
        patterns = step.get("patterns", ())
        return isinstance(at, EscapedKey) or (
            at not in step["other"] and not any(key_matches(p, at) for p in patterns)
        )
    return False


@functools.lru_cache(maxsize=256)
def _pattern(pattern: str) -> Any:
    return jsonschema_rs.validator_for({"pattern": pattern})


def key_matches(pattern: str, key: str) -> bool:
    """Whether a key matches a `patternProperties` pattern as the validators judge it
    (ECMA-262 regex, unanchored: Python's `re` differs, `$` before a newline for one);
    ValueError for a pattern that is not a regex."""
    try:
        validator = _pattern(pattern)
    except jsonschema_rs.ValidationError as exc:
        raise ValueError(f"{pattern!r} is not a regex") from exc
    return bool(validator.is_valid(str(key)))


def spelling(value: Any) -> str:
    """How llguidance writes a fixed value: JSON, numbers as the plain decimal with the
    fewest digits (1e16 as 10000000000000000, 1e-7 as 0.0000001, 1.0 as 1)."""
    if isinstance(value, float):
        return str(np.format_float_positional(value, trim="-"))
    return json.dumps(value)


@dataclass(frozen=True)
class _Frame:
    """An open object or array: where it is, and for a watched array what its items were."""

    path: tuple[str | int, ...]
    is_array: bool
    key: str | None = None  # an object's current key
    expects_key: bool = True
    index: int = 0
    rule: Rule | None = None
    seen: frozenset[tuple[Any, ...]] = frozenset()
    item: bytes = b""  # the watched array's current item, as written so far
    in_item: bool = False

    def child(self) -> tuple[str | int, ...]:
        if self.is_array:
            return (*self.path, self.index)
        return (*self.path, self.key if self.key is not None else "")


@dataclass
class _State:
    stack: list[_Frame] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    key_text: bytes = b""  # the current key's bytes, while one is written

    def copy(self) -> _State:
        return replace(self, stack=list(self.stack))


class UniqueWatch:
    """The rules of one output and where it stands; `admits` tries bytes on a copy, `feed`
    takes them."""

    def __init__(self, rules: Sequence[Rule]):
        self._rules = tuple(rules)
        self._state = _State()

    @property
    def watching(self) -> Rule | None:
        """The rule of the array whose items are being written now, if any."""
        stack = self._state.stack
        return stack[-1].rule if stack and stack[-1].is_array else None

    def admits(self, data: bytes) -> bool:
        state, rules = self._state.copy(), self._rules
        return all(_byte(state, byte, rules) for byte in data)

    def feed(self, data: bytes) -> None:
        """Takes bytes the grammar took (`admits` said yes to them first)."""
        for byte in data:
            _byte(self._state, byte, self._rules)

    def refuse_in(
        self, allowed: np.ndarray, token_bytes: Callable[[int], bytes], kinds: TokenKinds
    ) -> None:
        """Clears the allowed tokens whose bytes this watch refuses, trying only those that
        can matter: in a fixed-set array every allowed one; in a free-string array, inside a
        string those with a quote (only a closing quote ends it), between items every
        allowed one (few there, and another branch's number or literal may begin); under a
        watched array those with a quote, bracket, brace or comma (the way back to it);
        elsewhere those with a bracket (a watched array must open within the token)."""
        rule = self.watching
        if rule is not None and (rule.values is not None or not self._state.in_string):
            candidates = np.flatnonzero(allowed)
        else:
            under = any(f.rule is not None for f in self._state.stack)
            risky = kinds.quotes if rule is not None else (
                kinds.structural if under else kinds.brackets
            )  # fmt: skip
            candidates = risky[allowed[risky]]
        for token in candidates:
            if not self.admits(token_bytes(int(token))):
                allowed[token] = False


@dataclass(frozen=True)
class TokenKinds:
    """Ids of a vocabulary's tokens by the bytes a watch reacts to."""

    quotes: np.ndarray  # with a quote
    brackets: np.ndarray  # with an opening bracket
    structural: np.ndarray  # with any of " [ ] { } ,

    @classmethod
    def of(cls, table: Sequence[bytes]) -> TokenKinds:
        def having(chars: bytes) -> np.ndarray:
            ids = [t for t, b in enumerate(table) if any(c in b for c in chars)]
            return np.array(ids, dtype=np.int64)

        return cls(having(b'"'), having(b"["), having(b'"[]{},'))


def _byte(state: _State, byte: int, rules: tuple[Rule, ...]) -> bool:
    top = state.stack[-1] if state.stack else None
    if state.in_string:
        return _string_byte(state, top, byte)
    if top is not None and top.rule is not None and top.in_item and not _closes_item(byte):
        if byte in _WHITESPACE:
            return _end_item(state)
        return _item_byte(state, top, byte)
    if byte == _QUOTE:
        state.in_string, state.escaped, state.key_text = True, False, b""
        if top is not None and top.rule is not None:
            return _item_byte(state, top, byte)
        return True
    if byte in b"{[":
        path = top.child() if top is not None else ()
        rule = next((r for r in rules if r.matches(path)), None) if byte == ord("[") else None
        state.stack.append(_Frame(path, byte == ord("["), rule=rule))
        return True
    if top is None:
        return True
    if byte in b"]}":
        ok = _end_item(state)
        state.stack.pop()
        return ok
    if byte == ord(":"):
        state.stack[-1] = replace(top, expects_key=False)
    elif byte == ord(","):
        return _next_item(state, top)
    elif top.rule is not None and byte not in _WHITESPACE:
        return _item_byte(state, top, byte)  # a number, true, false or null begins
    return True


def _closes_item(byte: int) -> bool:
    return byte in b",]}"


def _next_item(state: _State, top: _Frame) -> bool:
    if not top.is_array:
        state.stack[-1] = replace(top, expects_key=True, key=None)
        return True
    if not _end_item(state):
        return False
    top = state.stack[-1]
    state.stack[-1] = replace(top, index=top.index + 1)
    if top.rule is not None and top.rule.values is not None:
        return any(canon(v) not in top.seen for v in top.rule.values)  # a value still unused
    return True


def _string_byte(state: _State, top: _Frame | None, byte: int) -> bool:
    ends = byte == _QUOTE and not state.escaped
    state.escaped = byte == _BACKSLASH and not state.escaped
    if top is not None and top.rule is not None:
        if ends:
            state.in_string = False
        return _item_byte(state, top, byte)
    if ends:
        state.in_string = False
        if top is not None and not top.is_array and top.expects_key:
            key = json.loads(b'"' + state.key_text + b'"')
            spelled = EscapedKey(key) if b"\\" in state.key_text else key
            state.stack[-1] = replace(top, key=spelled)
    elif top is not None and not top.is_array and top.expects_key:
        state.key_text += bytes((byte,))
    return True


def _item_byte(state: _State, top: _Frame, byte: int) -> bool:
    """One more byte of a watched array's item; checks it where the item's kind allows."""
    rule = top.rule
    assert rule is not None
    item = top.item + bytes((byte,))
    state.stack[-1] = top = replace(top, item=item, in_item=True)
    if item[:1] == b'"' and len(item) > 1 and not state.in_string:  # the string closed
        return _end_item(state)
    if rule.values is None:
        # Free strings. Another branch may write true, false or null here: a repeat of one is
        # refused at its first byte, since once begun it cannot become anything else.
        literal = _LITERALS.get(item[:1])
        return literal is None or literal not in top.seen
    return _could_be(item, rule.values, top.seen)


def _end_item(state: _State) -> bool:
    """The current item of the top array is complete (if one was begun): refused when it
    equals an earlier item; else remembered."""
    top = state.stack[-1]
    if top.rule is None or not top.in_item:
        return True
    key = canon(json.loads(top.item))
    state.stack[-1] = replace(top, item=b"", in_item=False, seen=top.seen | {key})
    if top.rule.values is not None and not any(canon(v) == key for v in top.rule.values):
        return False
    return key not in top.seen


def _could_be(item: bytes, values: tuple[Any, ...], seen: frozenset[tuple[Any, ...]]) -> bool:
    """Whether a fixed-set item written so far can still become a value not yet used."""
    unused = [v for v in values if canon(v) not in seen]
    if item[:1] != b'"':
        text = item.decode("ascii", "replace")
        return any(not isinstance(v, str) and spelling(v).startswith(text) for v in unused)
    whole, pending = _split_pending(item[1:])
    try:
        written = str(json.loads(b'"' + whole + b'"'))
    except ValueError:
        return True  # not JSON the grammar would write: left to the grammar
    return any(
        isinstance(v, str) and v.startswith(written) and _next_char_fits(v[len(written) :], pending)
        for v in unused
    )


def _split_pending(body: bytes) -> tuple[bytes, bytes]:
    """A JSON string's content written so far: the part that decodes whole, and the bytes of
    an escape or a UTF-8 character the token boundary cut (empty when none)."""
    cut = body.rfind(b"\\")
    if cut >= 0 and not _escape_complete(body[cut:]) and not _escaped_backslash(body, cut):
        return body[:cut], body[cut:]
    for trim in range(1, 4):  # a UTF-8 character is at most 4 bytes: 1 to 3 may hang over
        lead = body[-trim:][:1]
        if not lead or lead[0] < 0x80:
            break
        if lead[0] >= 0xC0:  # the lead byte of the last character
            need = 2 if lead[0] < 0xE0 else 3 if lead[0] < 0xF0 else 4
            return (body[:-trim], body[-trim:]) if need > trim else (body, b"")
    return body, b""


def _next_char_fits(rest: str, pending: bytes) -> bool:
    """Whether the pending bytes can begin the next character of `rest`."""
    if not pending:
        return True
    if not rest:
        return False
    ch = rest[0]
    if not pending.startswith(b"\\"):
        return ch.encode()[: len(pending)] == pending
    # llguidance escapes only a quote, a backslash and control characters (\n, \u001f, \u007f)
    control = ord(ch) < 0x20 or ord(ch) == 0x7F
    if pending == b"\\":
        return ch in '"\\/' or control
    return control and f"u{ord(ch):04x}".startswith(pending[1:].decode("ascii", "replace").lower())


def _escape_complete(tail: bytes) -> bool:
    return len(tail) >= 2 and (tail[1:2] != b"u" or len(tail) >= 6)


def _escaped_backslash(body: bytes, cut: int) -> bool:
    """Whether the backslash at `cut` is itself escaped (the second of a pair)."""
    run = len(body[: cut + 1]) - len(body[: cut + 1].rstrip(b"\\"))
    return run % 2 == 0
