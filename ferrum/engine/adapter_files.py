"""LoRA adapters loaded and unloaded while the engine serves, on the engine thread.

An adapter is unloaded in two steps: the API first stops new requests from picking it (its
model's list marks it removed), then asks the engine to release it. The engine frees it
only when no request it holds (running or waiting) decodes with it: those requests finish
with the adapter they started with. Ids are never given again (`llama/adapters.py`), so the
prefix KV parked under a freed adapter's id can never be matched by another adapter's
requests; it ages out of the cache like any unused prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

from ferrum.engine.contracts import AdapterFiles
from ferrum.engine.request import AdapterSet, Request
from ferrum.errors import InvalidRequest


class AdapterLifetimes:
    def __init__(self, files: AdapterFiles | None):
        self._files = files
        self.releasing: set[int] = set()  # unloaded, still used by a request it holds
        self.freed: set[int] = set()

    def load(self, path: str) -> int:
        if self._files is None:
            raise InvalidRequest("this model's runner cannot load LoRA adapters")
        return self._files.load(path)

    def release(self, adapter_id: int, live: Iterable[Request]) -> list[int]:
        """Marks the adapter for freeing; the ids freed now (`collect`)."""
        if adapter_id not in self.freed:
            self.releasing.add(adapter_id)
        return self.collect(live)

    def collect(self, live: Iterable[Request]) -> list[int]:
        """Frees the released adapters no request in `live` decodes with; their ids."""
        if not self.releasing:
            return []
        used = {i for r in live for i, _ in r.adapters}
        done = sorted(self.releasing - used)
        for i in done:
            if self._files is not None:
                self._files.unload(i)
            self.releasing.discard(i)
            self.freed.add(i)
        return done

    def check(self, adapters: AdapterSet) -> None:
        """400 for a set naming an adapter already freed: a request that picked it just
        before it was unloaded and reached the engine after its last user finished."""
        gone = [i for i, _ in adapters if i in self.freed]
        if gone:
            raise InvalidRequest(f"LoRA adapter id {gone[0]} was unloaded", param="lora")
