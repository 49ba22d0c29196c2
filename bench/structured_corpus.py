"""Issue #41's validity check on the real default model: the generated schema corpus of
tests/unit/test_structured_output.py sent as `response_format: json_schema` to a real
`ferrum serve` (greedy, max_tokens 256, 4 at a time). Prints schemas accepted, answers
finished (finish_reason stop) and how many of those validate (jsonschema); every finished
answer that does not validate is printed with its schema: each one is a bug.

    PYTHONPATH=$PWD .venv/bin/python bench/structured_corpus.py [count]
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import jsonschema

from ferrum.bench.process import ferrum_command, free_port
from tests.unit.test_structured_output import _schemas

PROMPT = "Fill in this JSON form with plausible values."


async def _one(client: httpx.AsyncClient, gate: asyncio.Semaphore, schema: Any) -> Any:
    fmt = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}
    body = {
        "model": "",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": 256,
        "response_format": fmt,
    }
    async with gate:
        r = await client.post("/v1/chat/completions", json=body)
    return r.status_code, r.json()


async def _run(url: str, schemas: list[dict[str, Any]]) -> dict[str, int]:
    gate = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        answers = await asyncio.gather(*(_one(client, gate, s) for s in schemas))
    counts = {"schemas": len(schemas), "accepted": 0, "finished": 0, "valid": 0}
    for schema, (status, answer) in zip(schemas, answers, strict=True):
        if status != 200:
            print("refused:", answer["error"]["message"][:120])
            continue
        counts["accepted"] += 1
        choice = answer["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        counts["finished"] += 1
        text = choice["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), schema)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print("INVALID:", json.dumps(schema), repr(text), str(exc)[:200], sep="\n  ")
    return counts


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    port = free_port()
    flags = ("--parallel", "4", "--cache-disk", "0")
    quiet = subprocess.DEVNULL
    server = subprocess.Popen(ferrum_command(port, *flags), stdout=quiet, stderr=quiet)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        print(json.dumps(asyncio.run(_run(url, _schemas(count)))))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
