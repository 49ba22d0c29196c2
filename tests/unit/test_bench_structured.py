"""The pure parts of the structured study (ferrum against llama-server on structured output):
the schema corpus, counting and validating replies, request bodies, metrics and the corpus
totals (no server is started here)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ferrum.bench import schema_corpus
from ferrum.bench.client import Dialect, Sample, stream_body, stream_completion
from ferrum.bench.schema_corpus import CorpusTally, generate, invalid_reason, totals_markdown
from ferrum.bench.studies import StudyRun, structured
from ferrum.bench.studies.speculation import SAME_OUTPUT


def _run(tmp_path, quick: bool = False, **options: str) -> StudyRun:
    return StudyRun("x", tmp_path, 2, 2, quick, None, options=options, hygiene=None)


def _reply(content: str, finish: str = "stop") -> dict:
    return {"choices": [{"message": {"content": content}, "finish_reason": finish}]}


# -- the corpus -----------------------------------------------------------------------------


def test_the_corpus_is_the_same_for_a_seed_and_new_for_another():
    a, b, c = generate(30, seed=1), generate(30, seed=1), generate(30, seed=2)
    assert a == b and a != c and len(a) == 30
    assert all(s["type"] == "object" and s["$defs"] == {"point": schema_corpus.POINT} for s in a)


def test_the_corpus_draws_every_shape_and_annotation():
    props = [p for s in generate(300) for p in s["properties"].values()]
    for leaf in schema_corpus.LEAVES:  # each shape appears, under some annotation
        assert any(leaf.items() <= p.items() for p in props), leaf
    for note in schema_corpus.ANNOTATIONS[1:]:
        assert any(note.items() <= p.items() for p in props), note


def test_wide_schemas_differ_by_tag_and_require_half():
    one, two = schema_corpus.wide(1, 60), schema_corpus.wide(2, 60)
    assert len(one["properties"]) == 60 and len(one["required"]) == 30
    assert set(one["properties"]).isdisjoint(two["properties"])


# -- validating and counting ----------------------------------------------------------------


def test_invalid_reason_checks_json_the_schema_and_formats():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
              "required": ["d"]}  # fmt: skip
    assert invalid_reason('{"d": "2024-02-29"}', schema) is None
    assert invalid_reason('{\n  "', schema).startswith("not JSON")  # an answer ended early
    assert "'d' is a required property" in invalid_reason("{}", schema)
    assert "date" in invalid_reason('{"d": "2024-02-30"}', schema)  # format checked
    ref = {"$ref": "#/$defs/point", "$defs": {"point": schema_corpus.POINT}}
    assert invalid_reason('{"x": 1}', ref) is None and invalid_reason('{"x": "1"}', ref)


def test_a_tally_counts_refusals_unfinished_valid_and_invalid_answers():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tally = CorpusTally()
    tally.add(schema, 400, {"error": {"message": "unsupported keyword 'not' at $.p0"}})
    tally.add(schema, 0, "ReadTimeout: timed out")
    tally.add(schema, 200, _reply('{"n": ', "length"))  # cut at max_tokens: not judged
    tally.add(schema, 200, _reply('{"n": 3}'))
    tally.add(schema, 200, _reply('{"n": "3"}'))
    tally.add(schema, 200, _reply('{\n  "'))
    assert tally.counts() == {"schemas": 6, "accepted": 4, "finished": 3, "valid": 1}
    assert tally.refusals == ["400: unsupported keyword 'not' at $.p0",
                              "0: ReadTimeout: timed out"]  # fmt: skip
    assert [i["text"] for i in tally.invalid] == ['{"n": "3"}', '{\n  "']
    assert tally.metrics() == pytest.approx(
        {
            "corpus accepted": 4 / 6,
            "corpus finished": 3 / 4,
            "corpus valid": 1 / 3,
            "corpus invalid": 2.0,
        }
    )


def test_a_tally_with_nothing_accepted_reports_no_share_of_nothing():
    tally = CorpusTally()
    tally.add({}, 400, {"error": {"message": "no"}})
    assert tally.metrics() == {"corpus accepted": 0.0, "corpus invalid": 0.0}


def test_totals_sum_the_kept_rounds_per_arm():
    def rec(arm, r, n, acc, fin, val):
        return {"arm": arm, "round": r, "schemas": n, "accepted": acc, "finished": fin,
                "valid": val}  # fmt: skip

    records = [rec("ferrum", 1, 9, 9, 9, 0), rec("ferrum", 2, 10, 8, 6, 6),
               rec("ferrum", 3, 10, 9, 4, 3), rec("llama", 2, 10, 10, 5, 4),
               rec("llama", 3, 10, 10, 0, 0)]  # fmt: skip
    lines = totals_markdown(records, ["ferrum", "llama", "absent"]).splitlines()
    assert lines[2] == "| ferrum | 20 | 17 | 10 | 9 (90%) | 1 |"  # round 1 left out
    assert lines[3] == "| llama | 20 | 20 | 5 | 4 (80%) | 1 |"
    assert lines[4] == "| absent | 0 | 0 | 0 | 0 | 0 |"


# -- requests -------------------------------------------------------------------------------


def test_request_kinds_differ_only_in_what_they_ask_for():
    free, schema, logprobs = (structured.body(k, 64, 7) for k in structured.KINDS)
    assert free["ignore_eos"] and logprobs["ignore_eos"] and "ignore_eos" not in schema
    assert (logprobs["logprobs"], logprobs["top_logprobs"]) == (True, 5)
    assert free["messages"] == schema["messages"] == logprobs["messages"]
    assert "logprobs" not in free and "response_format" not in free
    assert all(SAME_OUTPUT.items() <= b.items() for b in (free, schema, logprobs))
    with pytest.raises(ValueError, match="free, schema, logprobs"):
        structured.body("grammar", 64, 7)


def test_a_constrained_answer_cannot_end_before_max_tokens():
    schema = structured.body("schema", 16, 1)["response_format"]["json_schema"]["schema"]
    assert schema == structured.long_schema(16)
    # The shortest valid answer holds 16 items: more than 16 tokens with their commas.
    shortest = json.dumps({"animals": [""] * 16})
    assert invalid_reason(shortest, schema) is None
    assert invalid_reason(json.dumps({"animals": [""] * 15}), schema)


def test_corpus_and_stall_bodies():
    body = structured.corpus_body({"type": "object"}, 99)
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["max_tokens"] == 99 and body["temperature"] == 0
    bodies = structured.stall_bodies(3, 40)
    schemas = [b["response_format"]["json_schema"]["schema"] for b in bodies]
    assert len({json.dumps(s) for s in schemas}) == structured.BURST  # no grammar reused
    assert all(len(s["properties"]) == 40 for s in schemas)
    assert {b["max_tokens"] for b in bodies} == {1}


# -- metrics --------------------------------------------------------------------------------


def test_cell_metrics_count_usage_or_chunks_over_the_wall_time():
    a = Sample(prompt="p", max_tokens=8, t_start=0.0, chunk_times=[0.5, 0.6], completion_tokens=8)
    b = Sample(prompt="p", max_tokens=8, t_start=1.0, chunk_times=[1.1, 1.2, 1.3, 1.4])
    got = structured.cell_metrics("schema", 8, [a, b], 2.0)
    assert got == pytest.approx({"c=8 schema tok/s": 6.0, "c=8 schema ttft": 0.3})


def test_schema_over_free_where_both_were_measured():
    got = structured.with_ratios({"c=1 free tok/s": 50.0, "c=1 schema tok/s": 45.0,
                                  "c=8 schema tok/s": 80.0}, (1, 8))  # fmt: skip
    assert got["c=1 schema/free"] == pytest.approx(0.9) and "c=8 schema/free" not in got


def test_every_metric_a_measurement_gives_is_reported(tmp_path):
    s = structured.sizes(_run(tmp_path))
    given: dict[str, float] = {}
    for c in s.clients:
        for kind in s.kinds:
            given |= structured.cell_metrics(kind, c, [Sample("p", 1, 0.0, [0.1])], 1.0)
    tally = CorpusTally()
    tally.add({}, 200, _reply("{}"))
    given |= tally.metrics() | dict.fromkeys(
        ("stall baseline p99", "stall burst p99", "stall burst/baseline", "stall burst"), 1.0
    )
    keys = [m.key for m in structured.metric_list(s)]
    assert set(structured.with_ratios(given, s.clients)) == set(keys)
    assert len(keys) == len(set(keys))


def test_sizes_quick_knobs_and_bad_kinds(tmp_path):
    full, quick = structured.sizes(_run(tmp_path)), structured.sizes(_run(tmp_path, True))
    assert quick.schemas < full.schemas and quick.tokens < full.tokens
    assert full.clients == (1, 8) and full.kinds == structured.KINDS
    knobs = structured.sizes(_run(tmp_path, clients="2", kinds="free,schema", schemas="7"))
    assert (knobs.clients, knobs.kinds, knobs.schemas) == ((2,), ("free", "schema"), 7)
    with pytest.raises(ValueError, match="unknown"):
        structured.sizes(_run(tmp_path, kinds="free,regex"))


def test_an_unknown_arm_is_refused_before_any_server_starts(tmp_path):
    with pytest.raises(ValueError, match="llama-server-default"):
        structured.measure(_run(tmp_path), "vllm", 1)


# -- the streams' reader --------------------------------------------------------------------


def _sse(events: list[dict]) -> httpx.MockTransport:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, text=text))


def test_a_chat_stream_is_timed_per_chunk_with_content():
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},  # no content: no chunk
        {"choices": [{"index": 0, "delta": {"content": '{"a"'}}]},
        {"choices": [{"index": 0, "delta": {"content": ": 1}"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
    ]

    async def go() -> Sample:
        async with httpx.AsyncClient(transport=_sse(events), base_url="http://x") as http:
            return await stream_body(http, "/v1/chat/completions", structured.body("schema", 8, 1))

    sample = asyncio.run(go())
    assert sample.text == '{"a": 1}' and len(sample.chunk_times) == 2
    assert (sample.finish_reason, sample.prompt_tokens, sample.completion_tokens) == ("stop", 9, 2)
    assert sample.max_tokens == 8 and sample.t_start <= sample.chunk_times[0] <= sample.t_end


def test_a_completion_stream_reads_text_and_refuses_an_empty_one():
    events = [{"choices": [{"index": 0, "text": "once"}]}, {"choices": [{"index": 1, "text": "!"}]}]

    async def go(evs: list[dict]) -> Sample:
        async with httpx.AsyncClient(transport=_sse(evs), base_url="http://x") as http:
            return await stream_completion(http, "m", "p", 4, Dialect(), n=2)

    sample = asyncio.run(go(events))
    assert sample.text == "once!" and sample.choices_seen == {0, 1}
    with pytest.raises(RuntimeError, match="stream without text"):
        asyncio.run(go([{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}]))
