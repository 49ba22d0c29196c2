"""Tests for ferrum.engine.text: streamed output must equal the all-at-once answer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.engine.text import (
    Delta,
    IncrementalDecoder,
    StopMatcher,
    TextPipeline,
    ThinkSplitter,
)
from tests.profiles import examples

FAST = settings(max_examples=examples(200), deadline=None)

# Small alphabets so that stop strings and tags actually occur in random text.
PIECES = ["a", "b", "c", " ", "\n", "é", "€", "😀", "<", ">", "/", "think", "<think>", "</think>"]
STOP_PIECES = ["a", "b", "c", "é", "😀", "<", "/", "think>", "\n"]


# ---------------------------------------------------------------- helpers


def split_at(seq: Sequence, cuts: list[int]) -> list:
    """Split ``seq`` at the given positions (clamped, sorted, possibly repeated)."""
    points = sorted({min(max(c, 0), len(seq)) for c in cuts})
    bounds = [0, *points, len(seq)]
    return [seq[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def ref_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The first stop string to complete wins; on a tie, the earliest start."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def ref_think(text: str, start_in_reasoning: bool = False) -> tuple[str, str]:
    if not start_in_reasoning:
        stripped = text.lstrip()
        if not stripped.startswith("<think>"):
            return "", text
        text = stripped[len("<think>") :]
    end = text.find("</think>")
    if end < 0:
        return text, ""
    return text[:end], text[end + len("</think>") :].lstrip()


def run_stop(stops: Sequence[str], chunks: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        safe, stopped = matcher.feed(chunk)
        out.append(safe)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def run_think(chunks: list[str], **kwargs: bool) -> tuple[str, str]:
    splitter = ThinkSplitter(**kwargs)
    reasoning: list[str] = []
    content: list[str] = []
    for chunk in [*chunks, None]:
        r, c = splitter.feed(chunk) if chunk is not None else splitter.flush()
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


def run_pipeline(pipe: TextPipeline, tokens: list[int]) -> tuple[str, str, bool]:
    deltas = [pipe.feed_token(t) for t in tokens]
    deltas.append(pipe.finish())
    stopped = any(d.stopped for d in deltas)
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), stopped


texts = st.lists(st.sampled_from(PIECES), max_size=25).map("".join)
stop_lists = st.lists(
    st.lists(st.sampled_from(STOP_PIECES), min_size=1, max_size=3).map("".join), max_size=3
)
cut_lists = st.lists(st.integers(0, 120), max_size=12)


# ---------------------------------------------------------------- IncrementalDecoder


def test_decoder_multibyte_split_across_feeds() -> None:
    dec = IncrementalDecoder()
    data = "é😀".encode()
    assert [dec.feed(data[i : i + 1]) for i in range(len(data))] == ["", "é", "", "", "", "😀"]
    assert dec.flush() == ""


def test_decoder_flush_emits_replacement_for_dangling_bytes() -> None:
    dec = IncrementalDecoder()
    assert dec.feed(b"ok\xf0\x9f") == "ok"
    assert dec.flush() == "\ufffd"


@FAST
@given(text=st.text(max_size=40), cuts=cut_lists)
def test_decoder_any_byte_split_roundtrips(text: str, cuts: list[int]) -> None:
    dec = IncrementalDecoder()
    chunks = split_at(text.encode(), cuts)
    assert "".join(dec.feed(c) for c in chunks) + dec.flush() == text


@FAST
@given(data=st.binary(max_size=40), cuts=cut_lists)
def test_decoder_invalid_bytes_match_one_shot_decode(data: bytes, cuts: list[int]) -> None:
    dec = IncrementalDecoder()
    out = "".join(dec.feed(c) for c in split_at(data, cuts)) + dec.flush()
    assert out == data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- StopMatcher


def test_stop_no_stops_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("hello") == ("hello", False)
    assert matcher.flush() == ""


def test_stop_holds_only_a_possible_prefix() -> None:
    matcher = StopMatcher(["</s>", "END"])
    assert matcher.feed("Hello </") == ("Hello ", False)
    assert matcher.feed("x") == ("</x", False)
    assert matcher.feed(" E") == (" ", False)
    assert matcher.flush() == "E"


def test_stop_split_over_many_feeds() -> None:
    matcher = StopMatcher(["STOP"])
    outs = [matcher.feed(c) for c in ["ab", "S", "T", "O", "Pafter"]]
    assert outs == [("ab", False), ("", False), ("", False), ("", False), ("", True)]
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_discards_text_after_match() -> None:
    assert StopMatcher(["\n\n"]).feed("one\n\ntwo") == ("one", True)


def test_stop_first_completed_wins() -> None:
    # "c" completes before "abcd", so streaming never has to wait past a stop.
    matcher = StopMatcher(["abcd", "c"])
    assert matcher.feed("abcd") == ("ab", True)
    assert matcher.matched == "c"  # the one reported as the response's stop_sequence
    # Same end: the one starting earlier wins, so less text leaks.
    assert StopMatcher(["cd", "bcd"]).feed("abcd") == ("a", True)


def test_stop_rejects_empty_stop_string() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


@FAST
@given(text=texts, stops=stop_lists, cuts=cut_lists)
def test_stop_streaming_equals_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    assert run_stop(stops, split_at(text, cuts)) == ref_stop(text, stops)


@FAST
@given(text=texts, stops=stop_lists, cuts=cut_lists)
def test_stop_holds_back_no_more_than_needed(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopMatcher(stops)
    emitted = ""
    fed = ""
    for chunk in split_at(text, cuts):
        safe, stopped = matcher.feed(chunk)
        emitted += safe
        fed += chunk
        if stopped:
            return
        assert fed.startswith(emitted)
        # Held back: exactly the longest suffix that could still grow into a stop string.
        needed = max((k for s in stops for k in range(1, len(s)) if fed.endswith(s[:k])), default=0)
        assert len(fed) - len(emitted) == needed


# ---------------------------------------------------------------- ThinkSplitter


def test_think_basic_split() -> None:
    assert run_think(["<think>plan</think>\n\nanswer"]) == ("plan", "answer")


def test_think_tags_split_across_feeds() -> None:
    splitter = ThinkSplitter()
    assert splitter.feed("\n<th") == ("", "")
    assert splitter.feed("ink>abc</th") == ("abc", "")
    assert splitter.feed("ink>") == ("", "")
    assert splitter.feed(" \n") == ("", "")
    assert splitter.feed(" hi </think>") == ("", "hi </think>")
    assert splitter.flush() == ("", "")


def test_think_later_open_tag_is_content() -> None:
    assert run_think(["Hi <think>x</think>"]) == ("", "Hi <think>x</think>")


def test_think_partial_open_tag_released_when_it_diverges() -> None:
    splitter = ThinkSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("s") == ("", "<this")


def test_think_unclosed_reasoning_flushes_partial_close_tag() -> None:
    assert run_think(["<think>abc</th"]) == ("abc</th", "")


def test_think_start_in_reasoning() -> None:
    assert run_think(["plan</think>answer"], start_in_reasoning=True) == ("plan", "answer")


def test_think_disabled_passes_everything() -> None:
    assert run_think(["<think>a</think> b"], enabled=False) == ("", "<think>a</think> b")


def test_think_custom_tags() -> None:
    got = run_think(["[t]x[/", "t] y"], open_tag="[t]", close_tag="[/t]")
    assert got == ("x", "y")


def test_think_whitespace_only_output_is_content() -> None:
    assert run_think([" ", "\n"]) == ("", " \n")


@FAST
@given(text=texts, cuts=cut_lists, start_in_reasoning=st.booleans())
def test_think_streaming_equals_reference(
    text: str, cuts: list[int], start_in_reasoning: bool
) -> None:
    got = run_think(split_at(text, cuts), start_in_reasoning=start_in_reasoning)
    assert got == ref_think(text, start_in_reasoning)


@FAST
@given(text=texts, cuts=cut_lists)
def test_think_disabled_is_identity(text: str, cuts: list[int]) -> None:
    assert run_think(split_at(text, cuts), enabled=False) == ("", text)


# ---------------------------------------------------------------- TextPipeline


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


def byte_token_bytes(token_id: int) -> bytes:
    return bytes([token_id])


def test_pipeline_multibyte_and_think() -> None:
    pipe = TextPipeline(byte_token_bytes, stop=[], split_think=True)
    content, reasoning, stopped = run_pipeline(pipe, byte_tokens("<think>é?</think>\n😀!"))
    assert (content, reasoning, stopped) == ("😀!", "é?", False)


def test_pipeline_stop_inside_reasoning_stops() -> None:
    pipe = TextPipeline(byte_token_bytes, stop=["DONE"], split_think=True)
    deltas = [pipe.feed_token(t) for t in byte_tokens("<think>ab DONE cd</think>x")]
    assert deltas[-1] == Delta(stopped=True)
    assert pipe.stopped
    assert "".join(d.reasoning for d in deltas) == "ab "
    assert "".join(d.content for d in deltas) == ""
    assert pipe.finish() == Delta(stopped=True)


def test_pipeline_stop_before_partial_character_drops_its_bytes() -> None:
    pipe = TextPipeline(byte_token_bytes, stop=["!"], split_think=False)
    deltas = [pipe.feed_token(t) for t in byte_tokens("hi!") + [0xF0, 0x9F]]
    assert pipe.finish() == Delta(stopped=True)
    assert "".join(d.content for d in deltas) == "hi"


def test_pipeline_special_tokens_are_silent() -> None:
    vocab = {1: b"", 2: b"Hel", 3: b"lo"}
    pipe = TextPipeline(vocab.__getitem__, stop=[], split_think=False)
    assert [pipe.feed_token(t) for t in [1, 2, 1, 3]] == [
        Delta(),
        Delta(content="Hel"),
        Delta(),
        Delta(content="lo"),
    ]
    assert pipe.finish() == Delta()


def test_pipeline_finish_flushes_dangling_bytes() -> None:
    pipe = TextPipeline(byte_token_bytes, stop=[], split_think=False)
    assert pipe.feed_token(0xC3) == Delta()
    assert pipe.finish() == Delta(content="\ufffd")


def test_pipeline_start_in_reasoning() -> None:
    pipe = TextPipeline(byte_token_bytes, stop=[], split_think=True, start_in_reasoning=True)
    content, reasoning, _ = run_pipeline(pipe, byte_tokens("why</think> because"))
    assert (reasoning, content) == ("why", "because")


def pipeline_reference(text: str, stops: list[str], split_think: bool) -> tuple[str, str, bool]:
    kept, stopped = ref_stop(text, stops)
    reasoning, content = ref_think(kept) if split_think else ("", kept)
    return content, reasoning, stopped


@FAST
@given(text=texts, stops=stop_lists, split_think=st.booleans())
def test_pipeline_byte_tokens_equal_reference(
    text: str, stops: list[str], split_think: bool
) -> None:
    pipe = TextPipeline(byte_token_bytes, stop=stops, split_think=split_think)
    got = run_pipeline(pipe, byte_tokens(text))
    assert got == pipeline_reference(text, stops, split_think)


@FAST
@given(
    text=texts,
    stops=stop_lists,
    split_think=st.booleans(),
    cuts=cut_lists,
    specials=st.lists(st.integers(0, 30), max_size=4),
)
def test_pipeline_any_tokenization_equals_reference(
    text: str, stops: list[str], split_think: bool, cuts: list[int], specials: list[int]
) -> None:
    # Token i carries the i-th chunk of the UTF-8 bytes; token -1 is a special token.
    chunks = split_at(text.encode(), cuts)
    tokens = list(range(len(chunks)))
    for pos in sorted(specials, reverse=True):
        tokens.insert(min(pos, len(tokens)), -1)
    vocab = {-1: b"", **dict(enumerate(chunks))}
    pipe = TextPipeline(vocab.__getitem__, stop=stops, split_think=split_think)
    got = run_pipeline(pipe, tokens)
    assert got == pipeline_reference(text, stops, split_think)
