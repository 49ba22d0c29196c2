"""A recursive JSON schema with no base case: no finite JSON validates against it, so a model
constrained by it can never finish (it writes until max_tokens and its answer is cut off).

    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}}

llguidance compiles these (its Earley parser expands rules lazily and has no check for a
rule that derives no string), so they are found here, in the schema, before any decode: the
least fixed point of "this subschema has a finite instance", the way a grammar's productive
rules are found. A subschema has one when every part it must contain has one:
its `$ref` target, each `allOf` entry, some `anyOf` / `oneOf` entry, and for at least one of
its types: nothing for a scalar type (or no `type` at all, which admits any), each required
property of an object, the first `minItems` items of an array. Whatever the analysis cannot
read (a remote `$ref`, an anchor, `patternProperties`) counts as having an instance, so a
schema is refused only when it has none for sure.

Cost: one pass per subschema plus one per edge (schema_limits bounds both before this runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

from ferrum.api.prompting.schema_limits import SCHEMA_LISTS, SCHEMA_MAPS

_MAPS = SCHEMA_MAPS | {"patternProperties"}
_VALUES = {"items", "additionalProperties", "additionalItems"}
_LISTS = SCHEMA_LISTS | {"items"}  # draft-04's tuple `items`

Good = Callable[[Any], bool]


def unbounded_ref(schema: dict[str, Any], param: str) -> str | None:
    """Where the schema recurses without a base case (a `$ref` on the cycle, by path and
    target), or None when some finite JSON validates (or the analysis cannot tell)."""
    nodes = list(_walk(schema, param))
    if any(("$id" in n or isinstance(n.get("id"), str)) for _, n in nodes[1:]):
        return None  # a nested base URI changes what "#" means: not followed here
    walked = {id(n) for _, n in nodes}
    targets: dict[int, Any] = {}
    for _, node in nodes:
        if isinstance(node.get("$ref"), str):
            target = _resolve(schema, node["$ref"])
            # A target the walk did not reach (inside `not`, say) is not followed.
            targets[id(node)] = (
                target if not isinstance(target, dict) or id(target) in walked else True
            )
    dependents: dict[int, list[dict[str, Any]]] = {}
    for _, node in nodes:
        for child in _children(node):
            dependents.setdefault(id(child), []).append(node)
        target = targets.get(id(node))
        if isinstance(target, dict):
            dependents.setdefault(id(target), []).append(node)
    finite: set[int] = set()

    def good(sub: Any) -> bool:
        return sub if isinstance(sub, bool) else not isinstance(sub, dict) or id(sub) in finite

    queue = deque(n for _, n in nodes)
    while queue:
        node = queue.popleft()
        if id(node) not in finite and _has_instance(node, good, targets.get(id(node), True)):
            finite.add(id(node))
            queue.extend(dependents.get(id(node), ()))
    if id(schema) in finite:
        return None
    stuck = [(w, n) for w, n in nodes if id(n) not in finite and not good(targets.get(id(n), True))]
    # Name a $ref on the cycle itself (its target leads back to it), not one that enters it.
    for where, node in stuck:
        if _leads_to(targets[id(node)], node, targets, finite):
            return f"{where} ($ref {node['$ref']!r})"
    return None  # none for another reason (a `false` required): llguidance names those


def _leads_to(start: Any, goal: dict[str, Any], targets: dict[int, Any], finite: set[int]) -> bool:
    """Whether `goal` is reached from `start` through subschemas and $refs with no instance."""
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node is goal:
            return True
        if not isinstance(node, dict) or id(node) in seen or id(node) in finite:
            continue
        seen.add(id(node))
        stack.extend(_children(node))
        stack.append(targets.get(id(node)))
    return False


def _has_instance(node: dict[str, Any], good: Good, target: Any) -> bool:
    if not good(target):
        return False
    if not all(good(s) for s in _list(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        alternatives = _list(node, key)
        if alternatives and not any(good(s) for s in alternatives):
            return False
    if "enum" in node or "const" in node:
        return True  # values of their own (checking them against the rest is llguidance's)
    types = node.get("type")
    if not isinstance(types, str | list):
        return True  # any type: a scalar will do
    for t in [types] if isinstance(types, str) else types:
        if t == "object" and _object_has_instance(node, good):
            return True
        if t == "array" and _array_has_instance(node, good):
            return True
        if t not in ("object", "array"):
            return True
    return False


def _object_has_instance(node: dict[str, Any], good: Good) -> bool:
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    for name in required if isinstance(required, list) else []:
        sub = properties.get(name, node.get("additionalProperties", True))
        if not good(sub):
            return False
    return True


def _array_has_instance(node: dict[str, Any], good: Good) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) else 0
    prefix = node.get("prefixItems")
    tuple_items = isinstance(node.get("items"), list)
    if not isinstance(prefix, list):
        prefix = node["items"] if tuple_items else []
    if not all(good(s) for s in prefix[:least]):
        return False
    if least <= len(prefix):
        return True
    rest = node.get("additionalItems", True) if tuple_items else node.get("items", True)
    return good(rest)


def _list(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _children(node: dict[str, Any]) -> Iterator[Any]:
    for key, value in node.items():
        if key in _MAPS and isinstance(value, dict):
            yield from value.values()
        elif key in _LISTS and isinstance(value, list):
            yield from value
        elif key in _VALUES:
            yield value


def _walk(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema (objects only) with its path, parents first; iterative."""
    stack: list[tuple[Any, str]] = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node
        found: list[tuple[Any, str]] = []
        for key, value in node.items():
            if key in _MAPS and isinstance(value, dict):
                found += [(s, f"{where}.{key}.{n}") for n, s in value.items()]
            elif key in _LISTS and isinstance(value, list):
                found += [(s, f"{where}.{key}[{i}]") for i, s in enumerate(value)]
            elif key in _VALUES:
                found.append((value, f"{where}.{key}"))
        stack.extend(reversed(found))


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The subschema a local JSON-pointer `$ref` names; True (no constraint) for any other."""
    node = local_target(schema, ref)
    return True if node is None else node


def local_target(schema: dict[str, Any], ref: str) -> Any:
    """The node a local JSON pointer ("#", "#/$defs/a") names in `schema`, or None (another
    document's, or a pointer that leads nowhere)."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None
    node: Any = schema
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
