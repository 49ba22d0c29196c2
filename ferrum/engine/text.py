"""Turn a stream of generated token ids into the text deltas sent to the client.

The engine calls :class:`TextPipeline` once per generated token. The pipeline
decodes bytes to text without splitting UTF-8 characters, cuts the output at
stop strings without ever leaking part of one, and separates ``<think>``
reasoning from the answer. Every stage is incremental: it only looks at what it
holds back plus the new text, so the cost per token does not grow with the
length of the output.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Delta",
    "IncrementalDecoder",
    "StopMatcher",
    "TextPipeline",
    "ThinkSplitter",
]


class IncrementalDecoder:
    """UTF-8 bytes to str, safe when a token ends in the middle of a character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """Decode ``data``; an unfinished character is kept until its next bytes arrive."""
        return self._decoder.decode(data)

    @property
    def mid_character(self) -> bool:
        """True while it holds the first bytes of a character."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        """End of generation: dangling partial bytes come out as U+FFFD."""
        return self._decoder.decode(b"", final=True)


class _TailIndex:
    """Finds the longest suffix of a text that is a proper prefix of some pattern.

    Prefixes are grouped by their last character so that the usual case, a text
    whose last character ends no prefix, costs one dict lookup.
    """

    def __init__(self, patterns: Iterable[str]) -> None:
        by_last: dict[str, set[str]] = {}
        for pattern in patterns:
            for k in range(1, len(pattern)):
                by_last.setdefault(pattern[k - 1], set()).add(pattern[:k])
        self._by_last = {
            last: sorted(prefixes, key=len, reverse=True) for last, prefixes in by_last.items()
        }

    def held_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a pattern."""
        if not text:
            return 0
        for prefix in self._by_last.get(text[-1], ()):
            if text.endswith(prefix):
                return len(prefix)
        return 0


class StopMatcher:
    """Cuts the text stream before the first stop string, never emitting part of one.

    Rule: the stop string that *completes* first wins (earliest end position;
    on a tie, the one that starts earliest). This is what a server that stops
    generating as soon as a stop string appears does, and it is the only rule
    that gives the same result however the text is split into chunks without
    generating past a completed stop string. Example: stops ``["c", "abcd"]``
    on ``"abcd"`` stop at ``"c"`` and emit ``"ab"``.

    Only the longest suffix of the pending text that is a proper prefix of some
    stop string is held back; everything before it is emitted at once.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop))
        self._tails = _TailIndex(self._stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        # A match cannot lie wholly in already emitted text (it would have been
        # found then), and one that straddles it must start inside the held
        # tail, so scanning held + new text is enough.
        buf = self._held + text
        first = self._first_completed(buf)
        if first is not None:
            cut, self.matched = first
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        keep = len(buf) - self._tails.held_len(buf)
        self._held = buf[keep:]
        return buf[:keep], False

    def flush(self) -> str:
        """Held-back text, for when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_completed(self, buf: str) -> tuple[int, str] | None:
        """Start index and text of the stop string that completes first in ``buf``, if any."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])


class _ThinkState(enum.Enum):
    START = enum.auto()  # undecided: only whitespace or a prefix of the open tag so far
    REASONING = enum.auto()
    AFTER_CLOSE = enum.auto()  # just past the close tag, dropping leading whitespace
    CONTENT = enum.auto()


class ThinkSplitter:
    """Separates ``<think>…</think>`` reasoning from the answer in a text stream.

    Only an open tag at the very start of the output (after optional
    whitespace, which is dropped) opens reasoning; later ones are content. The
    first close tag ends reasoning, and whitespace right after it is dropped.
    Tags are never emitted; partial tags are held back only while they could
    still become a tag. ``start_in_reasoning`` is for chat templates that already
    put the open tag in the prompt. With ``enabled=False`` everything is content.
    """

    def __init__(
        self,
        enabled: bool = True,
        start_in_reasoning: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("think tags must be non-empty")
        self._open = open_tag
        self._close = close_tag
        self._close_tails = _TailIndex([close_tag])
        self._lead: list[str] = []  # whitespace before a possible open tag
        self._pending = ""
        if not enabled:
            self._state = _ThinkState.CONTENT
        elif start_in_reasoning:
            self._state = _ThinkState.REASONING
        else:
            self._state = _ThinkState.START

    def feed(self, text: str) -> tuple[str, str]:
        """Return (reasoning delta, content delta)."""
        if self._state is _ThinkState.CONTENT:
            return "", text
        reasoning: list[str] = []
        content: list[str] = []
        # Each step consumes what belongs to the current state and returns the
        # rest, which only happens after a state change, so this terminates.
        while text:
            if self._state is _ThinkState.START:
                text = self._feed_start(text, content)
            elif self._state is _ThinkState.REASONING:
                text = self._feed_reasoning(text, reasoning)
            elif self._state is _ThinkState.AFTER_CLOSE:
                text = self._feed_after_close(text, content)
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of generation: held-back text goes where it was heading."""
        pending = "".join(self._lead) + self._pending
        self._lead.clear()
        self._pending = ""
        state, self._state = self._state, _ThinkState.CONTENT
        if state is _ThinkState.REASONING:
            return pending, ""
        # In START the pending text never became an open tag, so it is content.
        return "", pending

    def _feed_start(self, text: str, content: list[str]) -> str:
        if self._pending:
            body = self._pending + text
        else:
            # Leading whitespace goes to a list, not into a growing string, so an
            # output of nothing but newlines stays linear.
            body = text.lstrip()
            self._lead.append(text[: len(text) - len(body)])
        if len(body) < len(self._open) and self._open.startswith(body):
            self._pending = body
            return ""
        self._pending = ""
        lead = "".join(self._lead)
        self._lead.clear()
        if body.startswith(self._open):
            self._state = _ThinkState.REASONING
            return body[len(self._open) :]
        self._state = _ThinkState.CONTENT
        content.append(lead + body)
        return ""

    def _feed_reasoning(self, text: str, reasoning: list[str]) -> str:
        buf = self._pending + text
        end = buf.find(self._close)
        if end >= 0:
            reasoning.append(buf[:end])
            self._pending = ""
            self._state = _ThinkState.AFTER_CLOSE
            return buf[end + len(self._close) :]
        keep = len(buf) - self._close_tails.held_len(buf)
        reasoning.append(buf[:keep])
        self._pending = buf[keep:]
        return ""

    def _feed_after_close(self, text: str, content: list[str]) -> str:
        body = text.lstrip()
        if body:
            self._state = _ThinkState.CONTENT
            content.append(body)
        return ""


@dataclass(slots=True)
class Delta:
    """What one step adds to the response; ``stopped`` means a stop string matched."""

    content: str = ""
    reasoning: str = ""
    stopped: bool = False
    # The token's own decoded text, before stop strings and think tags: what logprobs show.
    raw: str = field(default="", compare=False)


class TextPipeline:
    """Token ids in, content/reasoning deltas out, for one request.

    Order: bytes -> :class:`IncrementalDecoder` -> :class:`StopMatcher` ->
    :class:`ThinkSplitter`. Stop strings are matched on the full decoded text,
    reasoning and think tags included (as other OpenAI-compatible servers do),
    so a stop string inside the reasoning also stops generation. When a stop
    string matches, the text before it is split and the splitter is flushed;
    bytes still inside the decoder lie after the match and are dropped. Once
    stopped, ``feed_token`` and ``finish`` return empty deltas with
    ``stopped=True``; after ``finish`` they return empty deltas.

    ``released_chars`` counts the decoded characters that passed the stop
    matcher: the part of the tokens' raw text that is final.
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stop: Sequence[str],
        split_think: bool,
        *,
        start_in_reasoning: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._decoder = IncrementalDecoder()
        self._stop = StopMatcher(stop)
        self._think = ThinkSplitter(enabled=split_think, start_in_reasoning=start_in_reasoning)
        self.stopped = False
        self._finished = False
        self.released_chars = 0

    @property
    def mid_character(self) -> bool:
        return self._decoder.mid_character

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop.matched

    def feed_token(self, token_id: int) -> Delta:
        """Delta for one generated token (often empty while text is held back)."""
        if self.stopped or self._finished:
            return Delta(stopped=self.stopped)
        data = self._token_bytes(token_id)
        if not data:
            return Delta()
        raw = self._decoder.feed(data)
        delta = self._push(raw)
        delta.raw = raw
        return delta

    def finish(self) -> Delta:
        """End of generation for a reason other than a stop string: flush every stage."""
        if self.stopped or self._finished:
            return Delta(stopped=self.stopped)
        self._finished = True
        # Dangling bytes become U+FFFD, which could still complete a stop string.
        raw = self._decoder.flush()
        delta = self._push(raw)
        delta.raw = raw
        if delta.stopped:
            return delta
        held = self._stop.flush()
        self.released_chars += len(held)
        reasoning, content = self._think.feed(held)
        tail_reasoning, tail_content = self._think.flush()
        content += tail_content
        reasoning += tail_reasoning
        return Delta(delta.content + content, delta.reasoning + reasoning, False, raw)

    def _push(self, text: str) -> Delta:
        if not text:
            return Delta()
        safe, stopped = self._stop.feed(text)
        self.released_chars += len(safe)
        reasoning, content = self._think.feed(safe)
        if stopped:
            self.stopped = True
            tail_reasoning, tail_content = self._think.flush()
            reasoning += tail_reasoning
            content += tail_content
        return Delta(content=content, reasoning=reasoning, stopped=stopped)
