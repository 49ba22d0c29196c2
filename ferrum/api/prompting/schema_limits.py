"""What a JSON schema may cost to compile, checked before the converter runs.

llama.cpp's JSON-schema converter writes a bounded repetition as that many copies of its rule:
`{"type": "array", "minItems": 1000000}` (about 70 bytes) became an 18 MB grammar, hundreds
of MB once parsed, and seconds of held GIL that stalled every other request. These limits
keep any one schema's grammar to a few hundred KB and its conversion to tens of milliseconds
of Python, each checked in one walk over the schema (no conversion), each refusal a 400 that
names the keyword, where it is, and the limit. Measured on this project's converter
(llama-cpp-python 0.3.x), compact grammar bytes per repetition: minItems ~18, maxItems ~21,
maxLength ~8, minLength ~5, a pattern's `{0,n}` ~7-10.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from ferrum.errors import InvalidRequest

# One repetition count (minItems, maxItems, minLength, maxLength, a pattern's {m,n}): 1,000
# copies is a 5-21 KB grammar (measured), and no real schema needs a longer fixed-count run
# (a free-length array or string is a `*` rule, of any length, and costs nothing).
MAX_REPEAT = 1_000
# All of a schema's counts together: 60 strings of maxLength 256 (15,360, a pydantic form)
# pass; 20,000 is at most ~420 KB of grammar. Without it, one 8 KB pattern of `a{1000}`
# written 1,000 times would be a million copies in spite of MAX_REPEAT.
MAX_REPEAT_TOTAL = 20_000
# Nesting of subschemas (objects in objects, items of items, anyOf in anyOf). OpenAI's
# structured outputs allow 10; real tool schemas rarely pass 6. Rule names grow with the
# depth (`a-item-item-…`), so deep nesting grows the grammar quadratically (arrays 200 deep:
# 300 KB from a 6 KB schema).
MAX_DEPTH = 32
# Subschemas in all: 2,000 required properties convert in 23-39 ms (a 128 KB grammar);
# 5,000 in ~85 ms.
MAX_SUBSCHEMAS = 2_000
# Optional properties of one object: the converter writes one rule per suffix of them, so
# its time grows with their cube: 60 ~6 ms, 100 ~9 ms, 150 ~22 ms, 200 ~65 ms, 500 ~430 ms,
# 1,000 passes Python's recursion limit.
MAX_OPTIONAL_PROPERTIES = 128
# Choices in one enum, anyOf or oneOf. Each is a grammar stack, and llama.cpp copies a
# grammar per request on the engine thread in time that grows with their square when they
# stand at the start (enum of 500: 11 ms, 1,000: 39 ms, 2,000: 225 ms, 5,000: 750 ms, a stall
# of every other request); later they cost at each masked token.
MAX_ALTERNATIVES = 500
# The schema itself, as compact JSON: bounds what the counts above do not (long consts,
# names and enum values, many enums): a 100 KB const converts in ~1 ms and parses in ~6 ms.
# OpenAI allows 120,000 characters of names and enum values.
MAX_SCHEMA_BYTES = 128 * 1024

# Keywords whose values are maps of name → schema, and those whose values are schemas.
SCHEMA_MAPS = {"properties", "$defs", "definitions"}
SCHEMA_VALUES = {"items", "additionalProperties"}
SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}

_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
_CHOICES = ("enum", "anyOf", "oneOf")
# A regex quantifier {m}, {m,}, {,n} or {m,n} not escaped (the converter's own reading).
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def walk(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Every subschema with its path and depth (the root is 0), parents first; boolean
    schemas have no keywords and are left out. Iterative: a schema nested thousands deep is
    refused by its depth, not by a RecursionError."""
    stack: list[tuple[Any, str, int]] = [(schema, path, 0)]
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node, depth
        children: list[tuple[Any, str, int]] = []
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                children += [(s, f"{where}.{key}.{n}", depth + 1) for n, s in value.items()]
            elif key in SCHEMA_VALUES:
                children.append((value, f"{where}.{key}", depth + 1))
            elif key in SCHEMA_LISTS and isinstance(value, list):
                children += [(s, f"{where}.{key}[{i}]", depth + 1) for i, s in enumerate(value)]
        stack.extend(reversed(children))


def check_limits(schema: Any, param: str) -> None:
    """InvalidRequest naming the first limit the schema passes (see the constants)."""
    check_size(schema, param)
    check_counts(schema, param)


def check_size(schema: Any, param: str) -> None:
    """InvalidRequest when the schema is over MAX_SCHEMA_BYTES."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are allowed",
            param=param,
        )


def check_counts(schema: Any, param: str) -> None:
    """InvalidRequest naming the first count, depth or size of choices over its limit."""
    total = 0
    for count, (where, node, depth) in enumerate(walk(schema, param), start=1):
        if depth > MAX_DEPTH:
            raise InvalidRequest(
                f"{where}: the schema nests {depth} levels deep; at most {MAX_DEPTH} are allowed",
                param=param,
            )
        if count > MAX_SUBSCHEMAS:
            raise InvalidRequest(
                f"{where}: the schema has more than {MAX_SUBSCHEMAS} subschemas", param=param
            )
        total += _repeats(node, where, param)
        if total > MAX_REPEAT_TOTAL:
            raise InvalidRequest(
                f"{where}: the schema's repetition counts (minItems, maxItems, minLength, "
                f"maxLength, pattern {{m,n}}) add up to more than {MAX_REPEAT_TOTAL}",
                param=param,
            )
        _check_optional(node, where, param)
        for key in _CHOICES:
            choices = node.get(key)
            if isinstance(choices, list) and len(choices) > MAX_ALTERNATIVES:
                raise InvalidRequest(
                    f"{where}.{key} has {len(choices)} choices; at most {MAX_ALTERNATIVES} are "
                    "allowed",
                    param=param,
                )


def _repeats(node: dict[str, Any], where: str, param: str) -> int:
    """The copies the node's counts make; InvalidRequest when one count is over MAX_REPEAT."""
    counts = {key: node[key] for key in _COUNTS if _is_number(node.get(key))}
    for key, value in counts.items():
        if value > MAX_REPEAT:
            raise InvalidRequest(
                f"{where}.{key} is {value}; at most {MAX_REPEAT} repetitions are allowed "
                "(each is a copy in the grammar; leave it out for any length)",
                param=param,
            )
    pattern = node.get("pattern")
    quantifiers = _QUANTIFIER.finditer(pattern) if isinstance(pattern, str) else iter(())
    in_pattern = 0
    for m in quantifiers:
        copies = max(_digits(m.group(1)), _digits(m.group(2)))
        if copies > MAX_REPEAT:
            raise InvalidRequest(
                f"{where}.pattern: the quantifier {m.group(0)} repeats more than {MAX_REPEAT} "
                "times, the most allowed",
                param=param,
            )
        in_pattern += copies
    # minItems and maxItems together make max(min, max) copies, not their sum.
    items = max(counts.get("minItems", 0), counts.get("maxItems", 0))
    chars = max(counts.get("minLength", 0), counts.get("maxLength", 0))
    return int(items + chars + in_pattern)


def _check_optional(node: dict[str, Any], where: str, param: str) -> None:
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return
    required = node.get("required")
    named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    optional = set(properties) - named
    if len(optional) > MAX_OPTIONAL_PROPERTIES:
        raise InvalidRequest(
            f"{where}.properties: {len(optional)} optional properties; at most "
            f"{MAX_OPTIONAL_PROPERTIES} are allowed in one object (list the others in "
            "`required`, or nest them)",
            param=param,
        )


def _is_number(value: Any) -> bool:
    # NaN (Python's json reads it) is no count: the metaschema check refuses it next.
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _digits(text: str | None) -> int:
    """A quantifier's bound; past nine digits only "too many" matters (and int() of
    thousands of digits raises)."""
    if not text:
        return 0
    return int(text) if len(text) <= 9 else MAX_REPEAT + 1
