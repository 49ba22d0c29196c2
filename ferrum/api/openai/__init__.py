"""The OpenAI dialect: chat and text completions, embeddings and rerank, the model list.

The package:
- `bodies.py`: the request bodies (tools included), validation limits, errors naming the
  parameter, translation to `SamplingParams`; the other dialects translate into these.
- `answers.py`: the answers' shapes, whole and streamed as SSE chunks, n choices merged.
- `embeddings.py`: /v1/embeddings and /v1/rerank.
- `routes.py`: the routes, and `route`, which registers one under /v1 and without it.
- `dialect.py`: OpenAI's error shape, the dialect of every path no other owns.
"""
