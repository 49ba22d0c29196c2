"""Fair shares of the decode slots (`max_running`) among tenants (`SamplingParams.tenant`).

A tenant is a key's tenant, or on a server without keys one HTTP request: all n choices of a
request count against the same tenant, so one `n=8` request is one user, not eight.

    share = max(1, max_running // tenants running or waiting)

Admission (`pick`): the next request tried is the oldest waiting request of the tenant that
holds the fewest running slots; FIFO among ties and within a tenant. A tenant alone is
therefore admitted in plain FIFO order and may hold every slot.

Preemption (`victims`): while a waiting tenant holds fewer slots than its share and no slot is
free, the tenant holding the most above its share gives up its newest running request (never
going below its share itself). Anti-thrashing rule: a request is taken only once it has
generated `min_tokens` tokens since its latest admission, so a request preempted for
fairness is never preempted again right after it resumes, and one still prefilling is not
interrupted (its prompt would be wasted work).

First token first (`fast_lane`): a slot alone does not make a short chat quick while one
tenant's many sequences fill the batch, because its first token comes out of a step that also
decodes all of them. So when the request admitted next is a fresh one (no token yet, never
admitted) of a tenant below its share, it is admitted ahead of the step's decodes and the
tenants above their share sit that step out; a tenant that sat out the step before never sits
out the next one, so it keeps at least every other step whatever arrives.

Pure: it reads the scheduler's queues and says what to do; the scheduler does it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ferrum.engine.request import Request


def tenant_of(req: Request) -> str:
    return req.params.tenant


@dataclass(frozen=True)
class FairShare:
    min_tokens: int = 4  # tokens generated since its latest admission before it may be taken

    def pick(self, candidates: Sequence[Request], running: Sequence[Request]) -> Request:
        """Which of `candidates` (waiting requests, oldest first) to admit next."""
        held = Counter(tenant_of(r) for r in running)
        # min keeps the first of equals: FIFO among ties and within a tenant.
        return min(candidates, key=lambda r: held[tenant_of(r)])

    def fast_lane(
        self,
        waiting: Sequence[Request],
        running: Sequence[Request],
        max_running: int,
        sat_out_before: frozenset[str],
    ) -> tuple[Request, frozenset[str]] | None:
        """The fresh request to admit before this step's decodes and the tenants whose work
        sits the step out; None when no tenant is above its share or the next is no newcomer."""
        if not waiting or len(running) >= max_running:
            return None
        req = self.pick(waiting, running)
        if req.admitted or req.num_output_tokens:
            return None
        held = Counter(tenant_of(r) for r in running)
        share = max(1, max_running // len(held.keys() | {tenant_of(r) for r in waiting}))
        mine = tenant_of(req)
        if held[mine] >= share:
            return None
        over = frozenset(t for t, n in held.items() if n > share) - sat_out_before - {mine}
        return (req, over) if over else None

    def victims(
        self, waiting: Sequence[Request], running: Sequence[Request], max_running: int
    ) -> list[Request]:
        """Running requests to preempt so that every waiting tenant below its share gets a
        slot; the slots already free are claimed first."""
        if not waiting:
            return []
        held = Counter(tenant_of(r) for r in running)
        queued = Counter(tenant_of(r) for r in waiting)  # in waiting order: oldest tenant first
        share = max(1, max_running // len(held.keys() | queued.keys()))
        takeable: dict[str, list[Request]] = {}  # per tenant, newest last
        for r in running:
            if r.num_output_tokens - r.output_at_admission >= self.min_tokens:
                takeable.setdefault(tenant_of(r), []).append(r)
        free = max_running - len(running)
        out: list[Request] = []
        while True:
            starved = [t for t, n in queued.items() if n > 0 and held[t] < share]
            if not starved:
                return out
            tenant = min(starved, key=lambda t: held[t])
            if free > 0:
                free -= 1
            else:
                donors = [t for t in held if held[t] > share and takeable.get(t)]
                if not donors:
                    return out
                donor = max(donors, key=lambda t: held[t])
                out.append(takeable[donor].pop())
                held[donor] -= 1
            held[tenant] += 1
            queued[tenant] -= 1
