"""Configuration: frozen dataclasses, every field defaulted and documented.

The CLI (`ferrum.cli`) derives its flags from the `metadata` of these fields, and each flag can
also be set through an environment variable `FERRUM_<FIELD NAME IN CAPITALS>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.cores import physical_cores


def _flag(*names: str, help: str, **kw: object) -> dict[str, object]:
    return {"flags": names, "help": help, **kw}


@dataclass(frozen=True)
class EngineConfig:
    """What each model's engine needs: memory and parallelism (a preset may override
    ctx_size, parallel and batch_size per model)."""

    ctx_size: int = field(
        default=8192,
        metadata=_flag("--ctx-size", "-c", help="total KV cells shared by all sequences"),
    )
    parallel: int = field(
        default=8,
        metadata=_flag("--parallel", "-np", help="most sequences decoding at once"),
    )
    threads: int = field(
        default=0,
        metadata=_flag("--threads", "-t", help="CPU threads (default: physical cores)"),
    )
    batch_size: int = field(
        default=512,
        metadata=_flag("--batch-size", "-b", help="most tokens in one llama_decode (n_batch)"),
    )
    split_prefill: int = field(
        default=256,
        metadata=_flag(
            "--split-prefill",
            help="a step's prefill chunks of at least this many tokens decode in a llama_decode "
            "of their own, apart from its other rows (decodes, guesses, short chunks), so their "
            "attention skips the other sequences' cells; 0: one llama_decode a step",
        ),
    )
    prefill_cap: int = field(
        default=0,
        metadata=_flag(
            "--prefill-cap",
            help="most prompt positions a step computes while streams decode in it, so a burst "
            "of long prompts or images stretches their inter-token gaps less (their first "
            "tokens come later); 0: what --batch-size leaves",
        ),
    )
    decode_every: int = field(
        default=1,
        metadata=_flag(
            "--decode-every",
            help="while a prompt is being computed, streams decode in every N-th step only: "
            "fewer, fuller decodes beside long prompts (the whole burst finishes sooner) for "
            "longer gaps in the streams; 1: every step",
        ),
    )
    n_predict: int = field(
        default=-1,
        metadata=_flag(
            "--n-predict",
            help="max_tokens when neither the request nor the model's preset gives one "
            "(-1: until the context ends)",
        ),
    )
    block_size: int = field(
        default=16, metadata=_flag("--block-size", help="tokens per KV block (accounting unit)")
    )
    no_prefix_cache: bool = field(
        default=False,
        metadata=_flag(
            "--no-prefix-cache",
            help="never reuse KV across requests (resident, RAM or disk)",
        ),
    )
    swa_windows: bool = field(
        default=False,
        metadata=_flag(
            "--swa-windows",
            help="size sliding-window layers' cache (Gemma 3) to their windows, as llama-server "
            "does, instead of the context (llama.cpp's swa_full): less memory, but a prefix is "
            "reused only from a running request or a window checkpoint (kept at copies, where "
            "a chat's client strings start and at each prompt's end), and copies cost attention",
        ),
    )
    kv_streams: bool = field(
        default=False,
        metadata=_flag(
            "--kv-streams",
            help="give each sequence a KV cell stream of its own (llama.cpp's non-unified "
            "cache, as llama-server runs by default): no decode attends over another "
            "request's cells, so many long unrelated prompts finish sooner, but one request "
            "holds at most ctx-size / parallel positions and a shared prefix is copied, "
            "not shared",
        ),
    )
    cache_ram: float = field(
        default=2048,
        metadata=_flag(
            "--cache-ram",
            help="MiB of host RAM per model for the states of prefixes evicted from the KV "
            "pool (restored instead of recomputed; least recently used out; 0: none)",
        ),
    )
    cache_disk: float = field(
        default=8,
        metadata=_flag(
            "--cache-disk",
            help="GiB of disk per model for saved prefix states, kept across restarts "
            "(0: no disk tier)",
        ),
    )
    cache_dir: str = field(
        default="",
        metadata=_flag("--cache-dir", help="folder of the disk tier (default: ~/.cache/ferrum/kv)"),
    )
    spec_type: str = field(
        default="ngram",
        metadata=_flag(
            "--spec-type",
            help="speculation: ngram (guess each request's next tokens from its own earlier "
            "tokens and verify them in the same decode; output unchanged) or none",
        ),
    )
    spec_draft_max: int = field(
        default=8,
        metadata=_flag("--spec-draft-max", help="most tokens guessed for a request per step"),
    )
    spec_ngram_min: int = field(
        default=3,
        metadata=_flag(
            "--spec-ngram-min",
            help="shortest n-gram a guess may follow where a guess costs half a token or more "
            "(several requests decoding); where it costs less (one request), one token",
        ),
    )
    spec_ngram_max: int = field(
        default=12,
        metadata=_flag("--spec-ngram-max", help="longest n-gram tried first"),
    )
    spec_recent: int = field(
        default=8,
        metadata=_flag(
            "--spec-recent",
            help="finished requests of its own cache scope (API key) whose tokens a request may "
            "also guess from, the longer match winning (a retry or regeneration repeats an "
            "earlier answer; 0: its own only)",
        ),
    )
    spec_batch_max: int = field(
        default=16,
        metadata=_flag(
            "--spec-batch-max",
            help="most guessed tokens of all requests in one step (many decoding sequences "
            "share it; past it, extra positions cost more than they save)",
        ),
    )
    gpu_layers: int = field(
        default=0,
        metadata=_flag("--gpu-layers", "-ngl", help="layers offloaded to the GPU (CUDA builds)"),
    )
    pooling: str = field(
        default="",
        metadata=_flag(
            "--pooling",
            help="let chat models embed too, pooled this way (mean, cls, last), in a second "
            "context; embedding models (BERT-like, or a GGUF that states its pooling) always "
            "embed and use their own pooling",
        ),
    )
    engine_turns: str = field(
        default="shared",
        metadata=_flag(
            "--engine-turns",
            help="shared: the engines of the server's models (chat and embedding) decode in "
            "turns, first asked first served, and an embedding decode is cut to a share of a "
            "busy chat step, so one model's flood cannot stall another's streams; off: each "
            "engine decodes whenever it likes (they split the cores)",
        ),
    )
    inject_faults: float = field(
        default=0.0,
        metadata=_flag(
            "--inject-faults",
            help="testing aid, never for production: the probability that a decode of several "
            "sequences reports llama.cpp's 'no KV slot' instead of running, which the split "
            "retry must absorb (counted in ferrum_faults_injected_total)",
        ),
    )
    cache_type_k: str = field(
        default="f16",
        metadata=_flag(
            "--cache-type-k",
            "-ctk",
            help="KV cache type of K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 "
            "(q8_0 halves f16's bytes per token: about twice the sequences in the same memory)",
        ),
    )
    cache_type_v: str = field(
        default="f16",
        metadata=_flag(
            "--cache-type-v",
            "-ctv",
            help="KV cache type of V, as --cache-type-k; a quantized V needs --flash-attn on "
            "or auto",
        ),
    )
    flash_attn: str = field(
        default="auto",
        metadata=_flag(
            "--flash-attn",
            "-fa",
            help="flash attention: on, off or auto (llama.cpp decides for the device; on for "
            "a quantized V cache)",
        ),
    )

    @property
    def saves_states(self) -> bool:
        """Whether prefix states evicted from the context are kept (a RAM or disk tier is on;
        `TierConfig.for_model` rounds the sizes alike)."""
        tiers = int(self.cache_ram * 2**20) > 0 or int(self.cache_disk * 2**30) > 0
        return tiers and not self.no_prefix_cache

    def resolved_threads(self) -> int:
        return self.threads if self.threads > 0 else physical_cores()


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP side needs."""

    host: str = field(default="127.0.0.1", metadata=_flag("--host", help="address to bind"))
    port: int = field(default=8080, metadata=_flag("--port", help="port to bind"))
    chat_template: str = field(
        default="",
        metadata=_flag(
            "--chat-template",
            help="built-in template name (gemma, chatml, llama3) or a Jinja file, for every "
            "model without a preset's; default: each model's own, else its family's",
        ),
    )
    api_key: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--api-key",
            help="a user key (repeat or comma-separate): generates, embeds and reads its own "
            "stored responses; with any key set, every route needs one",
        ),
    )
    admin_key: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--admin-key",
            help="an admin key (repeat or comma-separate): also pulls, copies, deletes, loads "
            "and unloads models, and sets any keep_alive",
        ),
    )
    keys_file: str = field(
        default="",
        metadata=_flag(
            "--keys-file",
            help="a file of keys, one a line as 'user KEY' or 'admin KEY' (kept out of the "
            "process list), added to --api-key and --admin-key",
        ),
    )
    open_admin: bool = field(
        default=False,
        metadata=_flag(
            "--open-admin",
            help="without any key, let every client pull, copy, delete, load and unload models "
            "(refused by default: a server without keys only serves)",
        ),
    )
    share_prefix_cache: bool = field(
        default=False,
        metadata=_flag(
            "--share-prefix-cache",
            help="let every key's requests reuse each other's prompt prefixes (by default each "
            "key, or each cache_salt, reuses only its own: another key could otherwise learn a "
            "prompt from cached_tokens or timing)",
        ),
    )
    max_keep_alive: str = field(
        default="1h",
        metadata=_flag(
            "--max-keep-alive",
            help="the longest keep_alive a user key may ask for (-1 is taken as this); a user "
            "key cannot shorten a model's keep-alive below the server's (admin keys: any)",
        ),
    )
    max_queue: int = field(
        default=256,
        metadata=_flag("--max-queue", help="most requests waiting beyond --parallel (then 429)"),
    )
    request_timeout: float = field(
        default=0.0,
        metadata=_flag("--request-timeout", help="seconds a request may take (0: no limit)"),
    )
    header_timeout: float = field(
        default=10.0,
        metadata=_flag(
            "--header-timeout",
            help="seconds a connection has to send a request's head, from its opening or the "
            "head's first byte; then it is closed (slow or idle clients; 0: no limit). "
            "ferrum serve only: Ray Serve's proxy, in front of ferrum cluster, has no such "
            "bound (docs/cluster.md)",
        ),
    )
    shutdown_grace: float = field(
        default=10.0,
        metadata=_flag(
            "--shutdown-grace", help="seconds in-flight requests get to finish on SIGTERM"
        ),
    )
    public_metrics: bool = field(
        default=False,
        metadata=_flag("--public-metrics", help="serve /metrics without the API key"),
    )
    reasoning_inline: bool = field(
        default=False,
        metadata=_flag(
            "--reasoning-inline",
            help="keep <think>…</think> in content instead of reasoning_content",
        ),
    )
    no_webui: bool = field(
        default=False,
        metadata=_flag(
            "--no-webui",
            help="turn off the browser pages: the chat at / and the engine's live view at "
            "/dashboard (the API routes they use stay)",
        ),
    )
    log_level: str = field(
        default="info", metadata=_flag("--log-level", help="debug, info, warning or error")
    )
    responses_store: str = field(
        default="64MiB",
        metadata=_flag(
            "--responses-store",
            help="memory for stored Responses API responses (previous_response_id, GET), "
            "least recently used out first; 0 or off: none are kept",
        ),
    )


@dataclass(frozen=True)
class ModelsConfig:
    """Which models a server serves and how long it keeps them loaded."""

    model: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--model",
            "-m",
            help="serve only these: a GGUF path, a built-in or store model name, or NAME=REF "
            "(repeat); default: every built-in and store model, smollm2-135m-instruct first",
        ),
    )
    models_dir: str = field(
        default="",
        metadata=_flag("--models-dir", help="the model store (default: ~/.cache/ferrum/models)"),
    )
    presets: str = field(
        default="",
        metadata=_flag("--presets", help="TOML file of per-model settings (see docs/models.md)"),
    )
    keep_alive: str = field(
        default="5m",
        metadata=_flag(
            "--keep-alive",
            help="how long an idle model stays loaded (300, 5m, 1h; 0: unload at once; "
            "-1: forever)",
        ),
    )
    max_models: int = field(
        default=0, metadata=_flag("--max-models", help="most models loaded at once (0: no limit)")
    )
    memory_budget: str = field(
        default="",
        metadata=_flag(
            "--memory-budget",
            help="most memory the loaded models may take, weights + KV (e.g. 8GiB; "
            "default: no limit; 'auto': free GPU memory on a CUDA build, else free RAM)",
        ),
    )
    lora: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--lora",
            help="a LoRA adapter GGUF served on a model, requested as model BASE:NAME or by "
            "llama-server's lora field (ids in flag order): NAME=PATH on the one model "
            "served, BASE:NAME=PATH on model BASE, or PATH (named after the file); "
            "--lora-scaled PATH SCALE sets the scale a request naming it gets (default 1)",
        ),
    )
    lora_dirs: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--lora-dir",
            help="a folder whose adapter files an admin may load while serving "
            "(POST /v1/load_lora_adapter); besides these only the model store and the --lora "
            "files may be loaded, never another path a request names",
        ),
    )
    models_max_bytes: str = field(
        default="0",
        metadata=_flag(
            "--models-max-bytes",
            help="most disk the model store may take, its files and the pulls under way "
            "(e.g. 50GiB; 0: no quota beyond the free disk); a pull or copy past it is a 400",
        ),
    )
    mmproj: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--mmproj",
            help="a vision projector GGUF (llama.cpp's mmproj) for a model, so its requests "
            "may carry images: PATH on the one model served, or NAME=PATH (repeat)",
        ),
    )
    alias: str = field(
        default="",
        metadata=_flag(
            "--alias",
            "-a",
            help="the name of the one model given with --model PATH, as llama-server's --alias "
            "(default: the file's stem); refused with several models or a NAME=REF",
        ),
    )
