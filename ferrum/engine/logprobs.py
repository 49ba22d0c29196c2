"""Logprob entries whose texts add up exactly to the output text.

Each sampled token carries the characters its bytes completed (a token that ends inside a
UTF-8 character carries "", the next one the whole character). Entries are held back until
their text is past the stop matcher, so a stream never shows logprobs for text that a stop
string later cuts away:

    token texts:  | "Hel" | "lo" | " wor" | "ld" |
    released:     [--------------------)             ← stop matcher output so far
    sent:         | "Hel" | "lo" |                   ← " wor" waits: it is not all released

At a stop string the entry that straddles the cut keeps only its released characters and the
entries after it are dropped; end-of-generation tokens never get an entry (they add no text).
"""

from __future__ import annotations

from collections import deque

from ferrum.engine.contracts import TokenLogprobs
from ferrum.engine.outputs import LogprobEntry


class LogprobTracker:
    def __init__(self) -> None:
        self._pending: deque[LogprobEntry] = deque()
        self._sent_chars = 0

    def add(self, info: TokenLogprobs, text: str) -> None:
        self._pending.append(LogprobEntry(info.token, text, info.logprob, info.top))

    def extend_last(self, text: str) -> None:
        """Characters that appeared only at the end (dangling bytes flushed as U+FFFD)."""
        if text and self._pending:
            last = self._pending.pop()
            self._pending.append(LogprobEntry(last.token, last.text + text, last.logprob, last.top))

    def release(self, released_chars: int, mid_character: bool = False) -> list[LogprobEntry]:
        """Entries whose whole text lies within the first `released_chars` characters.

        While the decoder holds part of a character, the last entry stays: if generation
        ends there, the flushed U+FFFD belongs to it (`extend_last`)."""
        out = []
        pending = self._pending
        while pending and self._sent_chars + len(pending[0].text) <= released_chars:
            if mid_character and len(pending) == 1:
                break
            entry = pending.popleft()
            self._sent_chars += len(entry.text)
            out.append(entry)
        return out

    def finish(self, released_chars: int) -> list[LogprobEntry]:
        """The rest: a straddling entry is cut to the released text, later ones dropped."""
        out = self.release(released_chars)
        if self._pending:
            entry = self._pending.popleft()
            keep = released_chars - self._sent_chars
            if keep > 0:
                out.append(LogprobEntry(entry.token, entry.text[:keep], entry.logprob, entry.top))
                self._sent_chars += keep
            self._pending.clear()
        return out
