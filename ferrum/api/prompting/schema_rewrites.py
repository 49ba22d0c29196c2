"""JSON Schema keywords llguidance does not implement, rewritten into ones it does wherever the
meaning is kept whole, and the place of one that cannot be (the 400 names it).

A rewrite here must accept exactly the instances the original accepts (the tests check both
schemas against the reference validator on many values); anything else stays and is refused:

    "uniqueItems": false                      nothing to enforce: dropped
    "uniqueItems": true, "maxItems": 0 or 1   no two items to compare: dropped
    "not": {"type": T}  (annotations aside)   "allOf": [{"type": every JSON type but T}]

`not` with "integer" but not "number" stays (a number that is not whole has no grammar
here), as do `uniqueItems` over longer arrays and `not` of anything but types.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from ferrum.api.prompting.schema_limits import walk

_TYPES = ("null", "boolean", "object", "array", "string", "number")
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated",
                "readOnly", "writeOnly"}  # fmt: skip
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')


def rewritten(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with the rewrites above applied (a copy; the original is left as it is)."""
    out = copy.deepcopy(schema)  # schema_limits bounded its size before this runs
    for _, node, _ in walk(out, ""):
        _drop_trivial_unique(node)
        _not_type(node)
    return out


def keyword_path(schema: dict[str, Any], message: str) -> str | None:
    """Where the first keyword llguidance's `message` calls unimplemented stands in `schema`
    (".properties.p1", "" at the root), or None when the message names none or the walk does
    not reach it."""
    found = _UNIMPLEMENTED.search(message)
    if found is None:
        return None
    keyword = found.group(1)
    return next((where for where, node, _ in walk(schema, "") if keyword in node), None)


def _drop_trivial_unique(node: dict[str, Any]) -> None:
    unique, most = node.get("uniqueItems"), node.get("maxItems")
    at_most_one = isinstance(most, int | float) and not isinstance(most, bool) and most <= 1
    if unique is False or (unique is True and at_most_one):
        del node["uniqueItems"]


def _not_type(node: dict[str, Any]) -> None:
    sub = node.get("not")
    if not isinstance(sub, dict) or "type" not in sub or set(sub) - {"type"} - _ANNOTATIONS:
        return
    excluded = {sub["type"]} if isinstance(sub["type"], str) else set(sub["type"])
    if "integer" in excluded and "number" not in excluded:
        return
    kept = [t for t in _TYPES if t not in excluded]
    if not kept:
        return  # `not` of every type: nothing validates; llguidance's refusal stands
    del node["not"]
    node["allOf"] = [*node.get("allOf", []), {"type": kept}]
