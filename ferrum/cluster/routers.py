"""Ray Serve request routers over the policies in `policy.py`.

A router lives in the process of the handle that calls the replicas (the ingress). Each
reads the request's `RouteKey` from the call's `route` keyword argument, and what replicas
hold from their routing stats (`ReplicaStats`, published by `FerrumReplica.record_routing_stats`
every stats period and carried to routers by Ray's controller).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ferrum.cluster.policy import (
    Candidate,
    PrefixAffinity,
    RouteKey,
    TextPrefixAffinity,
    decode_hashes,
    pinned,
)

PREFIX_KEY = "prefixes"  # routing stats: model name → encoded block hashes


def route_key(request: PendingRequest | None) -> RouteKey:
    key = None if request is None else request.kwargs.get("route")
    return key if isinstance(key, RouteKey) else RouteKey()


class _Router(LocalityMixin, MultiplexMixin, RequestRouter):
    """What both prefix routers share: candidates with their load, what was routed where.

    Without Ray's FIFOMixin: it hands the replica chosen for one request to the oldest
    request waiting, which would send a prompt to the replica chosen for another's prefix.
    """

    _rng: random.Random
    _in_flight: Counter[str]
    _routed_ids: dict[str, str]
    _done_early: OrderedDict[str, None]

    def _setup(self) -> None:
        self._rng = random.Random()
        # This router's own requests per replica. Ray's queue-length cache is kept only with
        # strict max_ongoing_requests, so the router counts for itself.
        self._in_flight = Counter()
        self._routed_ids = {}  # internal request id → replica
        self._done_early = OrderedDict()  # completions seen before their routing callback

    def _candidates(self, replicas: list[RunningReplica]) -> list[Candidate]:
        out = []
        for r in replicas:
            rid = r.replica_id.to_full_id_str()
            reported = self._replica_queue_len_cache.get(r.replica_id) or 0
            out.append(Candidate(rid, max(reported, self._in_flight[rid])))
        return out

    def _ranks(
        self, replicas: list[RunningReplica], ranked: list[list[str]]
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in replicas}
        return [[by_id[x] for x in rank] for rank in ranked if rank]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = replica_id.to_full_id_str()
        self._routed(rid, route_key(pending_request))
        request_id = pending_request.metadata.internal_request_id
        if self._done_early.pop(request_id, 1) is None:
            return  # it already finished: nothing in flight to count
        self._in_flight[rid] += 1
        self._routed_ids[request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed_ids.pop(internal_request_id, None)
        if rid is None:
            self._done_early[internal_request_id] = None
            while len(self._done_early) > 10_000:
                self._done_early.popitem(last=False)
        elif self._in_flight[rid] > 0:
            self._in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._forget(replica_id.to_full_id_str())

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = route_key(pending_request)
        candidates = self._candidates(candidate_replicas)
        ranked = pinned(key, candidates) or self._choose(key, candidate_replicas, candidates)
        return self._ranks(candidate_replicas, ranked)

    def _choose(
        self, key: RouteKey, replicas: list[RunningReplica], candidates: list[Candidate]
    ) -> list[list[str]]:
        raise NotImplementedError

    def _routed(self, replica: str, key: RouteKey) -> None:
        raise NotImplementedError

    def _forget(self, replica: str) -> None:
        self._in_flight.pop(replica, None)


class FerrumPrefixRouter(_Router):
    """Routes on the token blocks replicas report holding (`PrefixAffinity`)."""

    def initialize_state(self, imbalance: int = 4, recent_s: float = 10.0, **_: Any) -> None:
        self._setup()
        self._policy = PrefixAffinity(imbalance=imbalance, recent_s=recent_s, rng=self._rng)
        self._seen_stats: dict[str, object] = {}  # replica → the stats last decoded

    def _choose(
        self, key: RouteKey, replicas: list[RunningReplica], candidates: list[Candidate]
    ) -> list[list[str]]:
        for r in replicas:
            self._observe(r)
        return self._policy.choose(key, candidates)

    def _observe(self, replica: RunningReplica) -> None:
        rid = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        if self._seen_stats.get(rid) is stats:
            return  # the same object as last time: not decoded again
        self._seen_stats[rid] = stats
        prefixes = stats.get(PREFIX_KEY, {})
        self._policy.observe(rid, {m: decode_hashes(data) for m, data in prefixes.items()})

    def _routed(self, replica: str, key: RouteKey) -> None:
        self._policy.routed(replica, key)

    def _forget(self, replica: str) -> None:
        super()._forget(replica)
        self._policy.forget(replica)
        self._seen_stats.pop(replica, None)


class TextPrefixRouter(_Router):
    """Ray Serve LLM's `PrefixCacheAffinityRouter` policy, re-implemented (`policy.py`)."""

    def initialize_state(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        **_: Any,
    ) -> None:
        self._setup()
        self._policy = TextPrefixAffinity(imbalanced_threshold, match_rate_threshold, self._rng)

    def _choose(
        self, key: RouteKey, replicas: list[RunningReplica], candidates: list[Candidate]
    ) -> list[list[str]]:
        return self._policy.choose(key, candidates)

    def _routed(self, replica: str, key: RouteKey) -> None:
        self._policy.routed(replica, key)

    def _forget(self, replica: str) -> None:
        super()._forget(replica)
        self._policy.forget(replica)


class PowerOfTwoRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's default router's choice, except that a pinned request (a Responses API
    continuation) goes to its replica; without FIFOMixin, so that the pin holds."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pin = route_key(pending_request).pin
        for r in candidate_replicas:
            if pin and r.replica_id.to_full_id_str() == pin:
                return [[r]]
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]
            candidate_replicas,
            pending_request,
        )


ROUTERS: dict[str, type[RequestRouter]] = {
    "prefix": FerrumPrefixRouter,
    "text-prefix": TextPrefixRouter,
    "pow2": PowerOfTwoRouter,
}
