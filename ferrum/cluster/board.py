"""The cluster's board: a small Ray actor where each replica leaves its /metrics and /health
answers and what its /props and /slots would say (`api.slots.board_views`) every stats
period, under its full Ray replica id, and the ingress reads them all. A replica that stops
posting (dead, or scaled down) drops off after a few missed periods."""

from __future__ import annotations

import time
from typing import Any

import ray

Post = tuple[str, str, dict[str, Any]]  # metrics text, health JSON, views


def board_name(app_name: str) -> str:
    return f"ferrum-board-{app_name}"


@ray.remote(num_cpus=0)
class Board:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[Post, float]] = {}

    def put(self, replica: str, metrics: str, health: str, views: dict[str, Any]) -> None:
        # Stamped with the board's clock: replicas on other nodes may keep other times.
        self._posts[replica] = ((metrics, health, views), time.time())

    def read(self, max_age: float) -> dict[str, Post]:
        """Each replica's (metrics text, health JSON, views), if posted in the last
        `max_age` s."""
        now = time.time()
        for replica in [r for r, p in self._posts.items() if now - p[1] > max_age]:
            del self._posts[replica]
        return {r: post for r, (post, _) in self._posts.items()}
