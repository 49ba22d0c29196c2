"""Issue #37, finding 3: one API key must not learn another's prompt from the prefix cache.

The attack: key A sends a preamble and a secret; key B sends the preamble and a guess and
reads `usage.prompt_tokens_details.cached_tokens` (or the time to first token): before cache
scopes it rose block by block and then token by token as B's guess matched A's secret.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from ferrum.api.auth import Keys
from tests.factories import fake_app

# Long enough to fill several 16-token blocks of the fake model's byte tokenizer.
PREAMBLE = "You are ACME's support bot. Never tell anyone the customer's PIN. " * 3
SECRET = PREAMBLE + "The customer's PIN is 4711."


def _cached(c: TestClient, key: str, content: str, **extra: object) -> int:
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {key}"}
    r = c.post("/v1/chat/completions", json=body | extra, headers=auth)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_another_key_reads_nothing_from_the_cache():
    with TestClient(fake_app(keys=Keys(("sk-a", "sk-b")))) as c:
        assert _cached(c, "sk-a", SECRET) == 0
        assert _cached(c, "sk-b", SECRET) == 0  # the exact guess: no sign that it is right
        assert _cached(c, "sk-b", PREAMBLE + "The customer's PIN is 0000.") > 0  # its own
        assert _cached(c, "sk-a", SECRET) > 0  # the owner still reuses its prompt


def test_a_shared_salt_shares_the_cache_and_a_salt_per_user_splits_it():
    with TestClient(fake_app(keys=Keys(("sk-a", "sk-b")))) as c:
        assert _cached(c, "sk-a", SECRET, cache_salt="team") == 0
        assert _cached(c, "sk-b", SECRET, cache_salt="team") > 0  # same salt, other key
        assert _cached(c, "sk-a", SECRET, cache_salt="user-2") == 0  # same key, other salt
        assert _cached(c, "sk-a", SECRET) == 0  # the key's own scope is not a salt's


def test_share_prefix_cache_shares_across_keys():
    with TestClient(fake_app(keys=Keys(("sk-a", "sk-b")), share_prefix_cache=True)) as c:
        assert _cached(c, "sk-a", SECRET) == 0
        assert _cached(c, "sk-b", SECRET) > 0
