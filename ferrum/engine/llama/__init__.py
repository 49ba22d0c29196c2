"""llama.cpp behind the engine's protocols: the only package of ferrum that imports `llama_cpp`.

    runner.py            `LlamaRunner`, the engine's `Runner`: model, context, batch, KV ops
    sampler.py           one request's sampling chain, grammar and logprobs
    vocab.py             the model's `Vocabulary` for any thread; `VocabularyFile`
    embedding_runner.py  `EmbeddingRunner`, the embedding engine's `BatchEmbedder`
    kernel_timing.py     ms per `llama_decode`, the bench's kernels study's child process

Nothing else in `ferrum.engine` imports this package (a contract in pyproject.toml): the
core sees llama.cpp only through `contracts.py` and `embedding.BatchEmbedder`, so the
tests' fakes stand in for it. The composition root (`server.py`) picks these.
"""
