"""A corpus of JSON Schemas written for ferrum, and the count of what servers make of it.

`generate(count, seed)` draws object schemas of one to three properties from the shapes
clients send (refs, `anyOf`/`oneOf`/`allOf`, bounds, patterns, formats known and unknown,
`patternProperties`, keywords a constraint engine may not enforce) dressed in annotations
(`title`, `$comment`, draft-04 `id`, `_comment`, `javaType` ...), as issue #41's real-world
schemas are. `wide(tag, props)` is one large schema of its own per tag. `CorpusTally` counts
a server's replies: schemas accepted, answers finished (`finish_reason` stop) and finished
answers that validate (jsonschema, formats checked); every refusal and every finished answer
that does not validate is kept with its schema. Pure: no server, no I/O.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

LEAVES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "int32"},  # unknown to most validators: an annotation
    {"type": "integer", "minimum": -5, "maximum": 50},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", 3]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    {"type": "object", "additionalProperties": {"type": "boolean"}},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"type": "string"}, {"type": "null"}]},
    {"allOf": [{"type": "integer"}, {"minimum": 2}]},
    {"not": {"type": "null"}},
    {"$ref": "#/$defs/point"},
]
ANNOTATIONS: list[dict[str, Any]] = [
    {},
    {"title": "A field"},
    {"description": "what it holds"},
    {"$comment": "for the maintainers"},
    {"example": 1},
    {"examples": ["x"]},
    {"_comment": "a private note"},
    {"javaType": "com.example.Foo", "self": {"href": "x"}},
    {"id": "draft-04-style", "name": "field"},
]
COUNTS = ("schemas", "accepted", "finished", "valid")  # CorpusTally's counts
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def generate(count: int, seed: int = 41) -> list[dict[str, Any]]:
    """`count` object schemas, the same ones for the same seed."""
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        props = {}
        for i in range(rnd.randint(1, 3)):
            props[f"p{i}"] = rnd.choice(LEAVES) | rnd.choice(ANNOTATIONS)
        schema: dict[str, Any] = {"type": "object", "properties": props}
        schema |= rnd.choice(ANNOTATIONS)
        schema["required"] = [p for p in props if rnd.random() < 0.7]
        if rnd.random() < 0.5:
            schema["additionalProperties"] = False
        schema["$defs"] = {"point": POINT}
        out.append(schema)
    return out


def wide(tag: int, props: int = 60) -> dict[str, Any]:
    """An object schema of `props` properties of its own for every tag (no grammar built for
    one can serve another), half of them required."""
    names = [f"field_{tag}_{i}" for i in range(props)]
    kinds = ("string", "integer", "boolean")
    properties = {n: {"type": kinds[i % 3]} for i, n in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names[: props // 2]}


def invalid_reason(text: str, schema: dict[str, Any]) -> str | None:
    """Why `text` is no instance of `schema` (not JSON, or the first validation error with
    formats checked), or None when it is one."""
    import jsonschema  # the bench extra's; the reference validator, not the server's own

    try:
        instance = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(instance)
    except jsonschema.ValidationError as exc:
        return f"{exc.message} at {exc.json_path}"
    return None


@dataclass
class CorpusTally:
    """One server's replies to a corpus (one round)."""

    schemas: int = 0
    accepted: int = 0
    finished: int = 0
    valid: int = 0
    refusals: list[str] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)  # schema, text, why

    def add(self, schema: dict[str, Any], status: int, reply: Any) -> None:
        """One reply: `status` 0 for a request that got no answer (`reply` the reason)."""
        self.schemas += 1
        if status != 200:
            error = reply.get("error") if isinstance(reply, dict) else None
            message = error.get("message") if isinstance(error, dict) else error or reply
            self.refusals.append(f"{status}: {str(message)[:300]}")
            return
        self.accepted += 1
        choice = reply["choices"][0]
        if choice.get("finish_reason") != "stop":
            return
        self.finished += 1
        text = choice["message"].get("content") or ""
        why = invalid_reason(text, schema)
        if why is None:
            self.valid += 1
        else:
            self.invalid.append({"schema": schema, "text": text, "why": why})

    def metrics(self) -> dict[str, float]:
        """Shares: accepted of all, finished of accepted, valid of finished (each only where
        its denominator is not 0); and the count of finished answers that do not validate."""
        out = {"corpus invalid": float(self.finished - self.valid)}
        for key, part, whole in (("accepted", self.accepted, self.schemas),
                                 ("finished", self.finished, self.accepted),
                                 ("valid", self.valid, self.finished)):  # fmt: skip
            if whole:
                out[f"corpus {key}"] = part / whole
        return out

    def counts(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in COUNTS}


def totals_markdown(tallies: list[dict[str, Any]], arms: list[str]) -> str:
    """The corpus counts of every arm summed over the kept rounds (round 1 left out), from
    the per-round records (`arm`, `round` and the counts): one Markdown table."""
    lines = ["| arm | schemas | accepted | finished | valid of finished | invalid |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        kept = [t for t in tallies if t["arm"] == arm and t["round"] > 1]
        n = {k: sum(t[k] for t in kept) for k in COUNTS}
        share = f"{n['valid']} ({n['valid'] / n['finished']:.0%})" if n["finished"] else "0"
        lines.append(f"| {arm} | {n['schemas']} | {n['accepted']} | {n['finished']} | "
                     f"{share} | {n['finished'] - n['valid']} |")  # fmt: skip
    return "\n".join(lines) + "\n"
