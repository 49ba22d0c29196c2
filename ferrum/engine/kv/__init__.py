"""The KV cache, as the engine sees it: llama.cpp owns the cells, this package says whose they are.

    ledger.py      blocks, page tables, ref counts, sequence ids: the accounting, its rules
    residency.py   where a request's KV comes from (fresh, copy, takeover, restore), parking,
                   eviction
    prefix.py      the prefix index: every owner of a prompt's prefix, by cache scope
    tiers/         saved prefixes below the pool, in RAM and on disk

No module here imports llama.cpp: KV operations go through `contracts.KvOps`.
"""
