"""An image's identity in the prefix cache, its kept encodings, its metrics and route keys.

An image is named by its pixels (`RgbImage.digest`); its positions in a prompt hold ids
drawn from that name (`image_token_ids`), which the prefix index hashes like tokens. The
engine-level oracles (answers with reuse equal answers alone) are in
`tests/engine/test_vision_reuse.py` and the image state machines.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ferrum.api.openai.bodies import ChatCompletionRequest
from ferrum.api.prompting.chat_template import BUILTIN_TEMPLATES, ChatFormatter
from ferrum.api.prompting.encoded_images import EncodedImages
from ferrum.api.prompting.images import splice
from ferrum.engine.contracts import RgbImage
from ferrum.engine.kv.prefix import block_hashes
from ferrum.engine.outputs import FinishedRequest, StepStats
from ferrum.engine.request import FinishReason, ImageSpan, Request, image_token_ids
from ferrum.metrics import Metrics
from tests.factories import FakeVocab, sampling
from tests.tiny_vision import data_uri, image_bytes

ROWS = 6  # positions of one image from the fake encoder


def _image(seed: int, width: int = 4, height: int = 3) -> RgbImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return RgbImage(width, height, pixels.tobytes())


class _Encoder:
    """A projector that counts its runs: a marker token, then ROWS rows from the pixels."""

    def __init__(self) -> None:
        self.runs = 0

    def encode(self, image: RgbImage) -> list:
        self.runs += 1
        rows = np.frombuffer(image.pixels[:ROWS], dtype=np.uint8).astype(np.float32)
        return [[7], np.repeat(rows[:, None], 4, axis=1)]


class _Observer:
    def __init__(self) -> None:
        self.encoded: list[float] = []
        self.reused = 0

    def on_encoded(self, seconds: float) -> None:
        self.encoded.append(seconds)

    def on_encoding_reused(self) -> None:
        self.reused += 1


def test_an_image_is_named_by_its_size_and_pixels():
    a = _image(1)
    assert a.digest == RgbImage(a.width, a.height, bytes(a.pixels)).digest
    changed = bytearray(a.pixels)
    changed[5] ^= 1
    assert RgbImage(a.width, a.height, bytes(changed)).digest != a.digest
    assert RgbImage(a.height, a.width, a.pixels).digest != a.digest  # same bytes, other shape


def test_image_ids_are_negative_int32_and_tell_images_apart():
    ids = image_token_ids(_image(1).digest, 300)
    assert len(ids) == 300 and all(-(2**31) <= t < 0 for t in ids)
    assert image_token_ids(_image(1).digest, 300) == ids
    other = image_token_ids(_image(2).digest, 300)
    assert sum(x == y for x, y in zip(ids, other, strict=True)) <= 1
    assert len(set(ids)) > 290  # each position draws its own 31 bits


def test_splice_puts_each_images_ids_at_its_positions():
    encoder = _Encoder()
    one, two = _image(1), _image(2)
    tokens, spans = splice([1, 2, -1, 3, -2, 4], [one, two], encoder)
    assert [s.start for s in spans] == [3, 11]  # after the marker token 7 of each
    assert tokens[3:9] == image_token_ids(one.digest, ROWS)
    assert tokens[11:17] == image_token_ids(two.digest, ROWS)
    assert [t for t in tokens if t >= 0] == [1, 2, 7, 3, 7, 4]
    again, _ = splice([1, 2, -1, 3, -2, 4], [one, one], encoder)
    assert again[3:9] == again[11:17] == tokens[3:9]


def _request(prompt: list[int], spans: tuple[ImageSpan, ...]) -> Request:
    return Request("r", prompt, sampling(), images=spans)


def test_a_reuse_never_ends_inside_an_image():
    ids = image_token_ids(b"x", 4)
    req = _request([1, 2, *ids, 3, 4], (ImageSpan(2, np.zeros((4, 2))),))
    assert [req.reuse_floor(n) for n in range(9)] == [0, 1, 2, 2, 2, 2, 6, 7, 8]
    req.num_cached_tokens = 5
    assert req.cached_image_tokens == 3
    req.num_cached_tokens = 8
    assert req.cached_image_tokens == 4


def test_image_ids_stand_exactly_at_the_image_positions():
    ids = image_token_ids(b"x", 4)
    rows = np.zeros((4, 2))
    with pytest.raises(ValueError, match="positions must hold"):
        _request([1, 2, 0, 0, 0, 0, 3], (ImageSpan(2, rows),))  # token ids where rows go
    with pytest.raises(ValueError, match="outside its images"):
        _request([1, *ids, 2], ())  # an image's ids without its rows
    with pytest.raises(ValueError, match="positions must hold"):
        _request([1, *ids], (ImageSpan(2, rows),))  # rows past the prompt's end
    assert _request([1, *ids, 2], (ImageSpan(1, rows),)).num_prompt_tokens == 6


def test_an_image_is_encoded_once_while_its_encoding_is_kept():
    encoder, observer = _Encoder(), _Observer()
    kept = EncodedImages(encoder, observer)
    first = kept.encode(_image(1), "")
    again = kept.encode(RgbImage(4, 3, bytes(_image(1).pixels)), "")  # equal pixels, new object
    assert encoder.runs == 1 and len(observer.encoded) == 1 and observer.reused == 1
    assert again[1] is first[1] and not first[1].flags.writeable
    kept.encode(_image(2), "")
    assert encoder.runs == 2 and kept.kept == 2


def test_kept_encodings_stay_within_their_bytes_least_recently_used_out():
    encoder, observer = _Encoder(), _Observer()
    size = ROWS * 4 * 4 + 8  # one image's rows and its marker token
    kept = EncodedImages(encoder, observer, max_bytes=2 * size)
    for seed in (1, 2, 1, 3):  # 1 used again after 2: 2 goes when 3 comes
        kept.encode(_image(seed), "")
    assert kept.kept == 2 and kept.bytes == 2 * size and encoder.runs == 3
    kept.encode(_image(1), "")
    assert encoder.runs == 3
    kept.encode(_image(2), "")
    assert encoder.runs == 4
    small = EncodedImages(encoder, observer, max_bytes=size - 1)  # too big to keep at all
    small.encode(_image(1), "")
    small.encode(_image(1), "")
    assert small.kept == 0 and small.bytes == 0 and encoder.runs == 6


def test_another_scope_encodes_the_image_again_and_its_own_reuses_it():
    """The attack: key B sends the image key A sent a moment ago and times its answer. A
    kept encoding would skip the encoder (faster), telling B that A sent that image; within
    B's scope it must be encoded again. The scope is the prefix cache's (`cache_scope`):
    callers who share one (`--share-prefix-cache`, a shared salt, no keys) share encodings."""
    encoder, observer = _Encoder(), _Observer()
    kept = EncodedImages(encoder, observer)
    a, b = kept.scoped("key:a"), kept.scoped("key:b")
    first = a.encode(_image(1))
    assert encoder.runs == 1
    other = b.encode(_image(1))
    assert encoder.runs == 2 and observer.reused == 0  # B: encoded again, not served
    assert other[1] is not first[1] and np.array_equal(other[1], first[1])
    assert a.encode(_image(1))[1] is first[1] and b.encode(_image(1))[1] is other[1]
    assert encoder.runs == 2 and observer.reused == 2 and kept.kept == 2
    shared = kept.scoped("")  # every key of a shared scope: one encoding
    shared.encode(_image(1))
    kept.scoped("").encode(_image(1))
    assert encoder.runs == 3 and observer.reused == 3


def test_a_scope_flooding_images_evicts_its_own_not_another_scopes():
    """The byte bound is shared; past it the scope holding the most bytes loses its least
    recently used first. Key A sending image after image cannot empty key B's kept image
    (B's next request would be slower: a cost A imposes on B), and the bound still holds."""
    encoder, observer = _Encoder(), _Observer()
    size = ROWS * 4 * 4 + 8
    kept = EncodedImages(encoder, observer, max_bytes=4 * size)
    kept.encode(_image(0), "key:b")
    for seed in range(1, 40):  # A's flood, B's image never touched again
        kept.encode(_image(seed), "key:a")
        assert kept.bytes <= kept.max_bytes
        assert kept.bytes == kept.scope_bytes("key:a") + kept.scope_bytes("key:b")
    assert kept.scope_bytes("key:b") == size and kept.scope_bytes("key:a") == 3 * size
    runs = encoder.runs
    kept.encode(_image(0), "key:b")
    assert encoder.runs == runs  # still kept
    kept.encode(_image(39), "key:a")
    assert encoder.runs == runs  # A's newest kept too: its oldest went
    # A lone scope has the whole budget: a one-key server keeps as much as before.
    alone = EncodedImages(encoder, observer, max_bytes=4 * size)
    for seed in range(4):
        alone.encode(_image(seed), "")
    assert alone.kept == 4 and alone.bytes == 4 * size
    # Several scopes at the bound: each is trimmed at most down to the largest share.
    for seed in range(10, 14):
        alone.encode(_image(seed), "key:c")
    assert alone.scope_bytes("") == alone.scope_bytes("key:c") == 2 * size


def test_image_metrics_count_encodings_and_reused_image_positions():
    metrics = Metrics()
    metrics.images.on_encoded(0.02)
    metrics.images.on_encoding_reused()
    done = FinishedRequest(FinishReason.STOP, 30, 2, 0.1, 0.05, cached_tokens=25,
                           cached_image_tokens=16)  # fmt: skip
    metrics.on_step(StepStats(finished=[done]))
    text = metrics.render().decode()
    for line in (
        "ferrum_images_encoded_total 1.0",
        "ferrum_image_encodings_reused_total 1.0",
        "ferrum_image_tokens_reused_total 16.0",
        "ferrum_image_encode_seconds_count 1.0",
    ):
        assert line in text, line  # fmt: skip


def _keys():
    from ferrum.cluster.keys import PromptKeys

    formatter = ChatFormatter(BUILTIN_TEMPLATES["chatml"], "", "", True)
    return PromptKeys("m", SimpleNamespace(vocab=FakeVocab()), formatter, "", 4096)  # type: ignore[arg-type]


def _body(seed: int) -> ChatCompletionRequest:
    content = [{"type": "text", "text": "a question long enough for several blocks: " * 2},
               {"type": "image_url", "image_url": {"url": data_uri(image_bytes(seed))}},
               {"type": "text", "text": "what is it?"}]  # fmt: skip
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}]}
    )


def test_a_route_key_stops_before_the_first_image():
    """The ingress cannot encode an image: its key holds the blocks before the first image,
    as the replica hashes them, and so never claims one image's blocks for another's."""
    from ferrum.api.prompting.images import image_parts, prompt_with_images
    from ferrum.api.prompting.tool_request import ToolRequest
    from ferrum.api.serving import chat_prompt
    from ferrum.cluster.keys import route_key

    keys, bs = _keys(), 8
    one, two = route_key(keys, _body(1), bs, "s"), route_key(keys, _body(2), bs, "s")
    assert one.hashes and one.hashes == two.hashes
    replicas = []
    for seed in (1, 2):
        body = _body(seed)
        tokens, spans = prompt_with_images(
            "m", _Encoder(), image_parts(body.messages), keys.file.vocab.tokenize,
            lambda marked, body=body: chat_prompt(keys.formatter, keys.file.vocab, "", body,
                                                  ToolRequest.from_body(None, None, None), marked),
        )  # fmt: skip
        replicas.append((list(block_hashes(tokens, bs, "s")), spans[0].start))
    (hashes_1, image_at), (hashes_2, _) = replicas
    assert list(one.hashes) == hashes_1[: image_at // bs] == hashes_2[: image_at // bs]
    assert hashes_1[image_at // bs :] and not set(hashes_1[image_at // bs :]) & set(hashes_2)
