"""`uniqueItems: true` taken out of a schema and turned into rules the engine enforces while
the JSON is written (`engine/unique_items.py`), where that can never leave an output stuck:

    items {"type": "string"} (minLength aside, nothing that bounds the string)
        a duplicate is refused at its closing quote; the string can always go on instead
    items from a fixed set: enum, const, {"type": "boolean"}, {"type": "null"}, narrowed
    by nothing else
        an item may only head for a value not yet used, and no new item starts once every
        value is used (minItems above the number of values, here or at the same place: no
        instance, refused)
    enum or const arrays beside the keyword
        rewritten exactly: the arrays with a repeat leave the enum; no rule

Anywhere else the keyword is refused by place (`Unenforceable`): items of any other kind, an
array inside a recursive $ref, a $ref that is not a local pointer, and an array place another
array schema may also describe (anyOf branches, patterns, tuples), where a rule could hold
back an array that does not need it. A branch that allows any JSON (`{}`, no type) is not
counted as such a schema: where one stands beside the keyword, its arrays are held to
distinct items too (narrower than the schema, never invalid).

A rule names the array's place in the instance: keys through `properties`, items through
`items`/`prefixItems` (a tuple's by index), keys a pattern matches through
`patternProperties`, the other keys through `additionalProperties`; `$ref`, `allOf`, `anyOf`
and `oneOf` keep the place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs

from ferrum.api.prompting.schema_limits import walk
from ferrum.api.prompting.schema_recursion import local_target
from ferrum.engine.constraint import Unenforceable
from ferrum.engine.unique_items import canon, key_matches, spelling, step_matches

# Walk steps allowed: $refs can fan out (one definition used from many places), so a schema
# whose places multiply past this is refused rather than walked for long.
_MAX_VISITS = 20_000
# Keywords that bound a string: with them a refused duplicate might have no way to go on.
_BOUNDING = {
    "maxLength", "pattern", "format", "enum", "const", "allOf", "anyOf", "oneOf", "not", "$ref",
    "if", "then", "else", "contentEncoding", "contentMediaType",
}  # fmt: skip
# JSON Schema's validation and applicator keywords (2020-12 and draft-04's): what a fixed set's
# item schema may not hold beyond type, enum and const.
_VALIDATION = {
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "contentEncoding",
    "contentMediaType", "contentSchema", "items", "prefixItems", "additionalItems", "contains",
    "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "required",
    "properties", "patternProperties", "additionalProperties", "dependentRequired",
    "dependentSchemas", "dependencies", "propertyNames", "maxProperties", "minProperties",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
    "unevaluatedItems", "unevaluatedProperties",
}  # fmt: skip
_NOT_ENFORCED = (
    'uniqueItems is enforced only over free strings ({"type": "string"} without maxLength, '
    "pattern or format) and over a fixed set of values (enum, const, boolean, null)"
)


_Path = tuple[dict[str, Any], ...]


def unique_rules(schema: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`schema` without the `uniqueItems: true` it reaches (in place) and their rules, in the
    form `engine/unique_items.Rule.from_json` reads; Unenforceable naming a place where the
    keyword cannot be enforced."""
    if "uniqueItems" not in json.dumps(schema):
        return schema, []
    seen = _Walk(schema)
    seen.visit(schema, "", (), ())
    if seen.rules and seen.unfollowed:
        ref = seen.unfollowed[0]
        raise Unenforceable(
            f"uniqueItems: the $ref {ref.node['$ref']!r} is not a local pointer the check can "
            "follow, so where its arrays stand is unknown",
            ref.where,
        )
    for rule in seen.rules:
        clash = next((a for a in seen.arrays if a.node is not rule.node and a.overlaps(rule)), None)
        if clash is not None:
            raise Unenforceable(
                f"uniqueItems: another array schema ({clash.where or 'the root'}) may describe "
                "the same place, and a rule for one would hold back the other",
                rule.where,
            )
    for rule in seen.rules:
        least = max((b.node["minItems"] for b in seen.bounds if b.overlaps(rule)), default=0)
        if rule.values is not None and least > len(rule.values):
            raise Unenforceable(
                f"uniqueItems with minItems {least} (here or at the same place): only "
                f"{len(rule.values)} distinct values exist",
                rule.where,
            )
    for rule in seen.rules:
        rule.node.pop("uniqueItems", None)
    return schema, [{"path": list(r.path), "values": r.values} for r in seen.rules]


@dataclass
class _Place:
    where: str  # in the schema, for messages
    path: tuple[dict[str, Any], ...]  # in the instance
    node: dict[str, Any]
    values: list[Any] | None = None

    def overlaps(self, other: _Place) -> bool:
        return len(self.path) == len(other.path) and all(
            _steps_meet(a, b) for a, b in zip(self.path, other.path, strict=True)
        )


def _steps_meet(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether one key or index could stand at both steps (patterns against patterns: yes)."""
    indexed = [s for s in (a, b) if {"index", "at", "from"} & set(s)]
    if indexed:
        if len(indexed) < 2:
            return False
        if "at" in a and "at" in b:
            return bool(a["at"] == b["at"])
        if "at" in b:
            a, b = b, a
        return "at" not in a or step_matches(b, a["at"])
    if "key" in a and "key" in b:
        return bool(a["key"] == b["key"])
    if "key" in b:
        a, b = b, a
    if "key" in a:
        return step_matches(b, a["key"])
    return True


@dataclass
class _Walk:
    root: dict[str, Any]
    rules: list[_Place] = field(default_factory=list)
    arrays: list[_Place] = field(default_factory=list)
    bounds: list[_Place] = field(default_factory=list)  # nodes with a minItems
    unfollowed: list[_Place] = field(default_factory=list)  # $refs to other documents
    visits: int = 0

    def visit(self, node: Any, where: str, path: _Path, refs: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        self.visits += 1
        if self.visits > _MAX_VISITS:
            raise Unenforceable("uniqueItems: the schema's $refs lead to too many places", where)
        if node.get("uniqueItems") is True and ("enum" in node or "const" in node):
            _fixed_arrays(node, where)  # the grammar writes one of them whole: no rule
        elif node.get("uniqueItems") is True:
            self.rules.append(_Place(where, path, node, self._values(node, where)))
        if _is_array(node):
            self.arrays.append(_Place(where, path, node))
        if isinstance(node.get("minItems"), int | float):
            self.bounds.append(_Place(where, path, node))
        self._children(node, where, path, refs)
        if isinstance(node.get("$ref"), str):
            self._follow(node["$ref"], where, path, refs)

    def _children(
        self, node: dict[str, Any], where: str, path: _Path, refs: tuple[str, ...]
    ) -> None:
        props = node.get("properties")
        patterns = node.get("patternProperties")
        for key, sub in (props if isinstance(props, dict) else {}).items():
            self.visit(sub, f"{where}.properties.{key}", (*path, {"key": key}), refs)
        for pattern, sub in (patterns if isinstance(patterns, dict) else {}).items():
            try:
                key_matches(pattern, "")
            except ValueError as exc:
                raise Unenforceable(f"uniqueItems: {exc} the validators read", where) from exc
            self.visit(
                sub, f"{where}.patternProperties.{pattern}", (*path, {"pattern": pattern}), refs
            )
        other = {"other": sorted(props or {}), "patterns": sorted(patterns or {})}
        self.visit(
            node.get("additionalProperties"), f"{where}.additionalProperties", (*path, other), refs
        )
        for key, sub, step in _item_schemas(node):
            self.visit(sub, f"{where}.{key}", (*path, step), refs)
        for key in ("allOf", "anyOf", "oneOf"):
            subs = node.get(key)
            for i, sub in enumerate(subs if isinstance(subs, list) else []):
                self.visit(sub, f"{where}.{key}[{i}]", path, refs)

    def _follow(self, ref: str, where: str, path: _Path, refs: tuple[str, ...]) -> None:
        target = local_target(self.root, ref)
        if target is None:
            self.unfollowed.append(_Place(where, path, {"$ref": ref}))
            return
        if ref in refs:
            if self._reaches_unique(target):
                raise Unenforceable("uniqueItems inside a recursive $ref", where)
            return
        self.visit(target, f"{where}.$ref", path, (*refs, ref))

    def _reaches_unique(self, node: Any) -> bool:
        """Whether a `uniqueItems: true` stands in `node` or anywhere its $refs lead."""
        seen: set[str] = set()
        todo = [node]
        while todo:
            for _, sub, _ in walk(todo.pop(), ""):
                if sub.get("uniqueItems") is True:
                    return True
                ref = sub.get("$ref")
                if not isinstance(ref, str) or ref in seen:
                    continue
                seen.add(ref)
                target = local_target(self.root, ref)
                if target is not None:
                    todo.append(target)
        return False

    def _values(self, node: dict[str, Any], where: str) -> list[Any] | None:
        """The rule's fixed set of values, None for free strings; Unenforceable otherwise."""
        items = node.get("items")
        if isinstance(items, dict) and isinstance(items.get("$ref"), str) and len(items) == 1:
            items = local_target(self.root, items["$ref"])
        if "prefixItems" in node or not isinstance(items, dict):
            raise Unenforceable(_NOT_ENFORCED, where)
        if items.get("type") == "string" and not set(items) & _BOUNDING:
            return None
        values = _fixed_set(items)
        if values is None:
            raise Unenforceable(_NOT_ENFORCED, where)
        return values


def _fixed_arrays(node: dict[str, Any], where: str) -> None:
    """`uniqueItems` beside `enum`/`const`, in place: the arrays with a repeat leave the
    enum, and the keyword goes (what is left already has distinct items); no value left, or
    a `const` array with a repeat, has no instance and is refused."""

    def distinct(v: Any) -> bool:
        return not isinstance(v, list) or len({canon(x) for x in v}) == len(v)

    if "const" in node and not distinct(node["const"]):
        raise Unenforceable("uniqueItems beside a const array with a repeat: no instance", where)
    if isinstance(node.get("enum"), list):
        node["enum"] = [v for v in node["enum"] if distinct(v)]
        if not node["enum"]:
            raise Unenforceable("uniqueItems: every enum array has a repeat: no instance", where)
    del node["uniqueItems"]


def _item_schemas(node: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """(keyword and index, subschema, the instance step it applies at) for each schema of an
    array's items: a tuple's place by its index, the rest from the first index after it."""
    out: list[tuple[str, Any, dict[str, Any]]] = []
    tuples = [k for k in ("prefixItems", "items") if isinstance(node.get(k), list)]
    fixed = len(node[tuples[0]]) if tuples else 0
    for key in tuples:
        out += [(f"{key}[{i}]", sub, {"at": i}) for i, sub in enumerate(node[key])]
    for key in ("items", "additionalItems"):
        if isinstance(node.get(key), dict | bool):
            out.append((key, node[key], {"from": fixed} if fixed else {"index": True}))
    return out


def _is_array(node: dict[str, Any]) -> bool:
    """Whether the node may describe an array (by type, array keywords, or a fixed array)."""
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    enum = node.get("enum")
    fixed = [node["const"]] if "const" in node else enum if isinstance(enum, list) else []
    return (
        "array" in kinds
        or any(k in node for k in ("items", "prefixItems", "contains"))
        or any(isinstance(v, list) for v in fixed)
    )


def _fixed_set(items: dict[str, Any]) -> list[Any] | None:
    """The distinct scalar values items of this schema can take, or None when not a fixed
    set the watch can follow: only `enum`, `const` and `type` may narrow it (llguidance
    enforces `format`, `pattern` and the rest by its own reading, which a value list made
    here could miss), and every value must be written back as itself (llguidance writes
    numbers as f64 decimals: 1e23 would come back as the integer 10**23)."""
    if set(items) & _VALIDATION - {"type", "enum", "const"}:
        return None
    if "enum" in items and isinstance(items["enum"], list):
        candidates = list(items["enum"])
    elif "const" in items:
        candidates = [items["const"]]
    elif items.get("type") == "boolean":
        candidates = [True, False]
    elif items.get("type") == "null":
        candidates = [None]
    else:
        return None
    if any(isinstance(v, dict | list) or not _written_back(v) for v in candidates):
        return None
    validator = jsonschema_rs.validator_for(items)
    kept: dict[tuple[Any, ...], Any] = {}
    for value in candidates:
        if validator.is_valid(value):
            kept.setdefault(canon(value), value)
    return list(kept.values())


def _written_back(value: Any) -> bool:
    """Whether llguidance's spelling of a value reads back as the same value and type."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return False
    back = json.loads(spelling(value))
    return canon(back) == canon(value) and type(back) in (type(value), int, float)
