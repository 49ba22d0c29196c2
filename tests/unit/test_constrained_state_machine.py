"""The speculating engine state machine with structured output in its traffic (issue #41).

Every rule of `SpeculatingEngineMachine` (prefix reuse, n choices, tenants and preemption,
hang-ups, decode faults, guesses right and wrong), with some requests constrained by a JSON
schema (one with uniqueItems, its watch beside the grammar), a regex, a choice or a Lark
grammar (llguidance grammars from `to_grammar`, enforced by the fake runner with a real
matcher, the masks of a step's refusals filled together on llguidance's pool as the llama
runner fills them). The fake model proposes letters; its
guesses are the unconstrained model's, so inside a string or a letter class they are taken and
elsewhere refused and rolled back.

Oracles, for each constrained request that finished:
- it equals what the same request produces alone (a fresh matcher over its prompt, step by
  step, each mask computed on its own): no grammar state is lost, shared or advanced by a
  guess that was not taken, across preemption, recompute and prefix reuse, and no row of a
  fill together reaches another sequence;
- one that ended by end-of-generation matches its constraint (jsonschema for schemas,
  re.fullmatch for regexes, membership for choices).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import jsonschema
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from ferrum.api.prompting.schema_unique import unique_rules
from ferrum.engine.constraint import to_grammar, with_unique
from ferrum.engine.outputs import RequestOutput
from tests.factories import EOS, FakeVocab, _constrained
from tests.unit.test_engine_state_machine import (
    SpeculatingEngineMachine,
    _Client,
    machine_settings,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WORDS = {"type": "array", "items": {"type": "string", "pattern": "^[a-k]+$"}, "maxItems": 3}
# uniqueItems, enforced beside the grammar (engine/unique_items.py): three of four values.
PICKS = {"type": "array", "items": {"enum": ["ab", "a", "b", "ba"]}, "uniqueItems": True,
         "minItems": 3}  # fmt: skip
CHOICES = ["alpha", "beta", "gamma delta"]


def _json_fits(schema: dict[str, Any]) -> Callable[[str], bool]:
    def fits(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    return fits


# (kind, source, does a finished text fit): letters the model proposes are taken where the
# constraint allows them (strings, letter classes), refused and masked elsewhere.
CONSTRAINTS: list[tuple[str, Any, Callable[[str], bool]]] = [
    ("json_schema", PERSON, _json_fits(PERSON)),
    ("json_schema", WORDS, _json_fits(WORDS)),
    ("json_schema", PICKS, _json_fits(PICKS)),
    ("regex", "[a-p]{3,20}", lambda t: re.fullmatch("[a-p]{3,20}", t) is not None),
    ("regex", "([a-z]+ )*[a-z]+", lambda t: re.fullmatch("([a-z]+ )*[a-z]+", t) is not None),
    ("choice", CHOICES, lambda t: t in CHOICES),
    (
        "grammar",
        'start: WORD ("," WORD)*\nWORD: /[a-h]+/',
        lambda t: re.fullmatch("[a-h]+(,[a-h]+)*", t) is not None,
    ),
]


def _grammar(kind: str, source: Any) -> str:
    if kind != "json_schema":
        return to_grammar(kind, source)
    plain, rules = unique_rules(copy.deepcopy(source))
    return with_unique(to_grammar(kind, plain), rules)


GRAMMARS = [_grammar(kind, source) for kind, source, _ in CONSTRAINTS]
FITS = dict(zip(GRAMMARS, (fits for _, _, fits in CONSTRAINTS), strict=True))


def alone(
    prompt: list[int], grammar: str, max_tokens: int, next_token: Callable[[Sequence[int]], int]
) -> list[int]:
    """The request's tokens when it runs by itself: the fake runner's constrained pick at each
    position, from a fresh matcher, up to end-of-generation or max_tokens."""
    constraint = FakeVocab().constraints().constraint(grammar)
    history, out = list(prompt), []
    while len(out) < max_tokens:
        token = _constrained(constraint, next_token(history), history)
        out.append(token)
        history.append(token)
        if token == EOS:
            break
    return out


class ConstrainedEngineMachine(SpeculatingEngineMachine):
    def draw_grammar(self, data: st.DataObject) -> str | None:
        if not data.draw(st.booleans(), label="constrained"):
            return None
        return data.draw(st.sampled_from(GRAMMARS), label="grammar")

    @invariant()
    def finished_output_is_what_the_prompt_alone_gives(self) -> None:
        for rid, outs in self.outputs.items():
            if not outs[-1].finished or outs[-1].finish_reason in ("abort", "error"):
                continue
            client = self.clients[rid]
            if client.grammar is None:
                self._check_free(client, outs)
            else:
                self._check_constrained(client, outs)

    def _check_free(self, c: _Client, outs: list[RequestOutput]) -> None:
        tokens = [t for o in outs for t in o.token_ids]
        assert outs[-1].finish_reason == "length"  # the fake model never stops by itself
        assert tokens == self.expected_for(c.prompt, c.max_tokens, tokens), c.request_id
        if not c.hung_up:
            assert c.tokens == tokens and c.finish_reason == "length", c.request_id

    def _check_constrained(self, c: _Client, outs: list[RequestOutput]) -> None:
        assert c.grammar is not None
        tokens = [t for o in outs for t in o.token_ids]
        reason = outs[-1].finish_reason
        assert tokens == alone(c.prompt, c.grammar, c.max_tokens, self.runner.next_token), (
            c.request_id,
            bytes(t for t in tokens if t < 256),
        )
        assert reason == ("stop" if tokens[-1:] == [EOS] else "length"), (c.request_id, reason)
        if reason == "stop":
            text = bytes(tokens[:-1]).decode()
            assert FITS[c.grammar](text), (c.request_id, text)
        if not c.hung_up:
            assert c.tokens == tokens and c.finish_reason == reason, c.request_id


ConstrainedEngineMachine.TestCase.settings = machine_settings(100)
TestConstrainedEngineStateMachine = pytest.mark.slow(ConstrainedEngineMachine.TestCase)


def test_the_constraints_are_met_alone_and_end_both_ways():
    """The oracle's own check: each constraint, alone over a few prompts, finishes by
    end-of-generation with a text that fits (and letter-class ones also run to length)."""
    next_token = SpeculatingEngineMachine().runner.next_token
    reasons = set()
    for grammar in GRAMMARS:
        for prompt in ([1, 97], [1, 98, 99], [1, 32, 97, 98]):
            tokens = alone(prompt, grammar, 40, next_token)
            if tokens[-1] == EOS:
                assert FITS[grammar](bytes(tokens[:-1]).decode()), grammar
                reasons.add("stop")
            else:
                reasons.add("length")
    assert reasons == {"stop", "length"}
