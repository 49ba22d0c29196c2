"""Images in chat prompts: data URIs decoded (bounded), encoded by the model's projector, and
spliced into the prompt's tokens, all on the preparation thread.

The chat template sees each image part as `IMAGE_MARK`, a private-use character inside the
message's content; tokenizing cuts the content at each mark and leaves a negative sentinel
there (`tokenize_with_marks`), which `splice` replaces with the image's pieces:

    content:   "what is " ◆ "?"              ◆ = IMAGE_MARK
    tokens:    t t t  -1  t                   -1 = image 0's sentinel
    prompt:    t t t [■ ■ ■ ■ ■ ■] t          ■ = the image's id there (drawn from its pixels,
                                                  `image_token_ids`), its row in ImageSpan.embeds

Bounds, checked before any pixel is decoded: a data URI of at most `MAX_IMAGE_URL_BYTES`,
an image of at most `MAX_IMAGE_PIXELS`, PNG or JPEG only. Remote URLs are not fetched.

Every dialect's images arrive here as the OpenAI body's `image_url` parts (each translation
keeps their order), and each error names its part in its message as well as in `param`: the
Ollama and Anthropic error shapes carry the message alone. `image_names` pairs the OpenAI
body's names with the dialect's, for the dialect to rename an error as its client wrote it.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PIL import Image

from ferrum.engine.contracts import ImageEncoder, RgbImage
from ferrum.engine.request import ImageSpan, image_token_ids
from ferrum.errors import InvalidRequest

IMAGE_MARK = "\ue002"  # private use: no tokenizer or template gives it a meaning
MAX_IMAGE_URL_BYTES = 10 * 1024 * 1024  # one image part's data URI
MAX_IMAGE_PIXELS = 4096 * 4096  # width × height, read from the header before decoding
MAX_IMAGES = 16  # per request
_FORMATS = {"PNG", "JPEG"}
_DATA_URI = re.compile(r"data:([\w.+-]+/[\w.+-]+);base64,", re.IGNORECASE)
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg"}

Tokenize = Callable[[str, bool, bool], list[int]]


def image_parts(messages: Sequence[Any]) -> list[tuple[str, str]]:
    """(param, url) of every image part of OpenAI chat messages, in prompt order."""
    found = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == "image_url":
                    found.append((f"messages[{i}].content[{j}]", part.image_url.url))
    return found


def image_names(messages: Sequence[Any], names: Sequence[str]) -> dict[str, str]:
    """Each image part's param in an OpenAI body (as `image_parts` names it) → `names`, the
    same images' params as a dialect's client wrote them, in the same (prompt) order."""
    return dict(zip((param for param, _ in image_parts(messages)), names, strict=True))


def renamed_image(err: InvalidRequest, names: Mapping[str, str]) -> InvalidRequest | None:
    """`err` naming its image part by `names` (`image_names`); None when it names no image."""
    new = names.get(err.param or "")
    if new is None or err.param is None:
        return None
    return InvalidRequest(err.message.replace(err.param, new, 1), param=new)


def decode_image(url: str, param: str) -> RgbImage:
    """A data URI's PNG or JPEG as RGB pixels; a 400 naming the part otherwise."""
    head = _DATA_URI.match(url)
    if head is None:
        raise InvalidRequest(
            f"{param}: an image must be a base64 data URI (data:image/png;base64,... or "
            "image/jpeg): remote images are not fetched", param=param,
        )  # fmt: skip
    if head.group(1).lower() not in _MEDIA_TYPES:
        raise InvalidRequest(
            f"{param}: {head.group(1)} images are not supported: PNG or JPEG", param=param
        )
    if len(url) > MAX_IMAGE_URL_BYTES:
        raise InvalidRequest(
            f"{param}: image of {len(url)} bytes: at most {MAX_IMAGE_URL_BYTES} per image",
            param=param,
        )
    try:
        data = base64.b64decode(url[head.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{param}: the image is not valid base64", param=param) from None
    return _pixels(data, param)


def _pixels(data: bytes, param: str) -> RgbImage:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=sorted(_FORMATS)) as img:
                width, height = img.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise InvalidRequest(
                        f"{param}: image of {width}x{height} pixels: at most {MAX_IMAGE_PIXELS} "
                        "pixels",
                        param=param,
                    )
                rgb = img.convert("RGB")
    except InvalidRequest:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning):  # fmt: skip
        raise InvalidRequest(f"{param}: not a readable PNG or JPEG image", param=param) from None
    if width < 1 or height < 1:
        raise InvalidRequest(f"{param}: an image needs at least one pixel", param=param)
    return RgbImage(width, height, rgb.tobytes())


def tokenize_with_marks(tokenize: Tokenize) -> Tokenize:
    """`tokenize`, with each IMAGE_MARK left as sentinel -1 - k for the k-th image seen."""
    seen = 0

    def cut(text: str, add_special: bool, parse_special: bool) -> list[int]:
        nonlocal seen
        pieces = text.split(IMAGE_MARK)
        tokens = tokenize(pieces[0], add_special, parse_special)
        for piece in pieces[1:]:
            seen += 1
            tokens.append(-seen)
            if piece:
                tokens += tokenize(piece, False, parse_special)
        return tokens

    return cut


def splice(
    tokens: list[int], images: Sequence[RgbImage], encoder: ImageEncoder
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt with each sentinel replaced by its image's pieces (encoded here), and the
    image spans. A sentinel seen twice or never (a template that repeats or drops content)
    is refused: the image's place in the prompt would be ambiguous."""
    marks = [-t - 1 for t in tokens if t < 0]
    if sorted(marks) != list(range(len(images))):
        raise InvalidRequest(
            "the chat template repeats or drops message content: images cannot be placed",
            param="messages",
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    for t in tokens:
        if t >= 0:
            out.append(t)
            continue
        for piece in encoder.encode(images[-t - 1]):
            if isinstance(piece, list):
                out += piece
            else:  # its positions named by its pixels, for the prefix cache to tell apart
                spans.append(ImageSpan(len(out), piece))
                out += image_token_ids(images[-t - 1].digest, len(piece))
    return out, tuple(spans)


def prompt_with_images(
    model: str,
    encoder: ImageEncoder | None,
    parts: Sequence[tuple[str, str]],
    tokenize: Tokenize,
    render: Callable[[Tokenize], list[int]],
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A chat's prompt with its images (`parts`, from `image_parts`): each decoded, the
    messages rendered and tokenized by `render` with the given tokenizer, the images
    encoded and spliced in. A 400 naming the model when it takes no images."""
    if encoder is None:
        raise InvalidRequest(
            f"{parts[0][0]}: model {model!r} does not take images: it is served without a "
            "vision projector (--mmproj)", param=parts[0][0],
        )  # fmt: skip
    if len(parts) > MAX_IMAGES:
        raise InvalidRequest(f"{len(parts)} images: at most {MAX_IMAGES}", param="messages")
    images = [decode_image(url, param) for param, url in parts]
    return splice(render(tokenize_with_marks(tokenize)), images, encoder)
