"""Issue #37: one API key must not learn by timing that another sent an image.

The attack: key A sends an image; key B sends the same image and times its answer. A kept
encoding skips the projector, so B's answer came faster exactly when A had sent that image.
Encodings are kept per cache scope (`EncodedImages`), the prefix cache's: B's image is
encoded again, A's own is not, and a server that shares its prefix cache across keys on
purpose (`--share-prefix-cache`) shares encodings too. Counted by the image metrics on a real
server build (the tiny llama with the tiny projector, "eye")."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ferrum.config import EngineConfig, ModelsConfig, ServerConfig
from ferrum.server import build_server
from tests.tiny_vision import data_uri, image_bytes


@pytest.fixture(scope="module", params=[False, True], ids=["scoped", "shared"])
def keyed(request, tiny_llama, mmproj, tmp_path_factory):
    """A server in process with two user keys; `request.param`: --share-prefix-cache."""
    engine_cfg = EngineConfig(ctx_size=512, parallel=2, batch_size=64, threads=2,
                              cache_ram=0, cache_disk=0)  # fmt: skip
    models = ModelsConfig(model=(f"eye={tiny_llama}",),
                          models_dir=str(tmp_path_factory.mktemp("store")),
                          mmproj=(f"eye={mmproj}",))  # fmt: skip
    server = ServerConfig(port=9999, api_key=("sk-a", "sk-b"), public_metrics=True,
                          share_prefix_cache=request.param)  # fmt: skip
    with TestClient(build_server(engine_cfg, server, models)[0]) as c:
        yield c, request.param


def _encoded(client: TestClient) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "ferrum_images_encoded_total" and sample.labels["model"] == "eye":
                return float(sample.value)
    return 0.0


def _chat(client: TestClient, key: str, seed: int) -> None:
    image = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(seed, (40, 30)))}}
    body = {
        "model": "eye",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}],
    }
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


def test_another_keys_image_is_encoded_again_unless_the_cache_is_shared(keyed):
    client, shared = keyed
    before = _encoded(client)
    _chat(client, "sk-a", 11)
    assert _encoded(client) - before == 1
    _chat(client, "sk-a", 11)  # the same key: its kept encoding
    assert _encoded(client) - before == 1
    _chat(client, "sk-b", 11)  # another key: encoded again, no faster than a new image
    assert _encoded(client) - before == (1 if shared else 2)
    _chat(client, "sk-b", 11)
    assert _encoded(client) - before == (1 if shared else 2)
