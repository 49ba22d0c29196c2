"""How much prompt a step takes: the prefill cap beside running streams, and images that a
projector decodes whole (Gemma 3's attend both ways, so no step may end inside one)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrum.engine.request import FinishReason, ImageSpan, Request
from ferrum.engine.scheduler import Scheduler
from tests.factories import sampling
from tests.unit.test_scheduler import _advance, _req, _sched


def _image_req(rid: str, before: int, rows: int, after: int, max_tokens: int = 8) -> Request:
    """`before` text tokens, an image of `rows` positions, `after` text tokens."""
    prompt = list(range(1, before + 1)) + [-1] * rows + list(range(1, after + 1))
    span = ImageSpan(before, np.zeros((rows, 4), dtype=np.float32))
    return Request(rid, prompt, sampling(max_tokens=max_tokens), images=(span,))


def _chunks(out) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.length) for c in out.chunks]


def _stream(s: Scheduler) -> None:
    """A request that decodes from the next step on."""
    s.add(_req("stream", 2))
    _advance(s.schedule())


def test_the_cap_bounds_a_steps_prompt_positions_only_while_streams_decode():
    s = _sched(64, 16, 4, 64, prefill_cap=8)
    s.add(_req("long", 40))
    assert _chunks(s.schedule()) == [("long", 0, 40)]  # nothing decodes: the whole budget
    s = _sched(64, 16, 4, 64, prefill_cap=8)
    _stream(s)
    s.add(_req("long", 40))
    for start in range(0, 40, 8):
        out = s.schedule()
        assert _chunks(out) == [("stream", out.chunks[0].start, 1), ("long", start, 8)]
        _advance(out)


def test_a_chunk_ends_before_an_image_that_goes_whole_not_inside_it():
    s = _sched(64, 16, 1, 20, whole_images=True)
    s.add(_image_req("a", 12, 16, 11))
    out = s.schedule()
    assert _chunks(out) == [("a", 0, 12)]
    _advance(out)
    assert _chunks(s.schedule()) == [("a", 12, 20)]  # the image whole, then text


def test_an_image_larger_than_the_cap_goes_whole_as_the_steps_first_prompt_chunk():
    s = _sched(64, 16, 4, 64, prefill_cap=4, whole_images=True)
    _stream(s)
    s.add(_image_req("a", 0, 16, 3))
    s.add(_req("b", 10))
    out = s.schedule()
    assert _chunks(out)[1:] == [("a", 0, 16)]  # b gets nothing: the cap is spent
    _advance(out)
    assert _chunks(s.schedule())[1:] == [("a", 16, 3), ("b", 0, 1)]


def test_image_room_leaves_a_decode_for_every_other_slot():
    assert _sched(64, 16, 4, 64).image_room() is None
    assert _sched(64, 16, 4, 64, whole_images=True).image_room() == 61


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(11, 40),  # image_room() ≥ 8 rows
    cap=st.integers(0, 12),
    prompts=st.lists(
        st.tuples(st.integers(0, 10), st.integers(1, 8), st.integers(0, 10)),
        min_size=1,
        max_size=5,
    ),
)
def test_images_are_never_cut_and_every_request_finishes(budget, cap, prompts):
    s = _sched(256, 16, 4, budget, prefill_cap=cap, whole_images=True)
    _stream(s)
    requests = [_image_req(f"r{i}", *p) for i, p in enumerate(prompts)]
    for r in requests:
        s.add(r)
    for _ in range(500):
        if all(r.finish_reason is not None for r in requests):
            return
        out = s.schedule()
        assert out.num_tokens <= budget
        prompt_chunks = [c.length for c in out.chunks if c.length > 1]  # the rest decode
        for c in out.chunks:
            for span in c.request.images:
                assert not span.start < c.start + c.length < span.end  # ends inside
        if cap and sum(prompt_chunks) > cap:  # only an image alone may pass the cap
            assert len(prompt_chunks) == 1
        _advance(out)
        for r in s.running[1:]:  # the stream runs on
            if r.num_output_tokens >= 8:
                s.finish(r, FinishReason.LENGTH)
    raise AssertionError("a request never finished")
