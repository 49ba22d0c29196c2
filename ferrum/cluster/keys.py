"""Route keys: what the ingress knows of a request before choosing its replica.

For the generation routes of every dialect (OpenAI chat and completions, Ollama's chat and
generate, Anthropic's messages, the Responses API's first turns) the body is translated into
the OpenAI body the replica will serve (by the path's dialect, `ferrum.api.dialects`), and
its prompt tokens are computed as a replica computes them (`prompting.chat_prompt`, the
model's template, its vocabulary loaded alone): their chained block hashes are the key the
prefix router matches against what replicas hold.
A prompt with images is keyed up to its first image (the ingress has no projector to tell
how many positions an image takes; their ids come from its pixels, `request.image_token_ids`).
The chain starts from the request's cache scope (`ferrum.api.auth.cache_scope`, from the
caller the gate found, the body's `cache_salt` and `--share-prefix-cache`) and its LoRA
adapter set (`Request.cache_scope`: the `--lora` and preset adapters, as the replica picks
them, and their files' digests, `models.adapters.files_scope`), as a replica's prefix index
chains it: a prompt only matches blocks its own scope and
adapters left.
A body that does not parse gets no hashes (the replica it lands on answers the error), and
neither does a prompt whose text is too long for the model's context whatever it tokenizes to
(as `ferrum serve` refuses it before tokenizing): tokenizing megabytes would cost the
ingress's threads seconds for a request the replica refuses anyway.

Each model's vocabulary is loaded on first use and unloaded when idle by a `Registry`, as a
server's models are.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from ferrum.api.dialects import translation
from ferrum.api.openai.bodies import ChatCompletionRequest, CompletionRequest
from ferrum.api.prompting.builtin_templates import resolve_template
from ferrum.api.prompting.chat_prompt import chat_prompt
from ferrum.api.prompting.chat_template import ChatFormatter
from ferrum.api.prompting.images import image_parts, tokenize_with_marks
from ferrum.api.prompting.tool_request import ToolRequest
from ferrum.api.serving import pick_adapters
from ferrum.cluster.policy import RouteKey
from ferrum.engine.kv.prefix import block_hashes
from ferrum.engine.llama.vocab import VocabularyFile
from ferrum.engine.request import adapter_scope
from ferrum.models.adapters import LoraAdapter, files_scope, with_digests
from ferrum.models.registry import ModelSpec, Registry

Body = ChatCompletionRequest | CompletionRequest


@dataclass
class PromptKeys:
    """One model's prompt rendering and tokenizing, as its replicas do it."""

    name: str
    file: VocabularyFile
    formatter: ChatFormatter
    system: str
    ctx_size: int  # the replicas' context for this model (the preset's or the server's)
    adapters: tuple[LoraAdapter, ...] = ()  # its LoRA adapters, ids as the replicas have them

    @property
    def max_text_bytes(self) -> int:
        """The most prompt text the model's context could hold (its longest token each)."""
        return self.ctx_size * self.file.vocab.max_token_bytes()

    @classmethod
    def load(cls, spec: ModelSpec, server_template: str, ctx_size: int) -> PromptKeys:
        file = VocabularyFile(spec.locate())
        try:
            template = spec.preset.chat_template or server_template
            template = resolve_template(template, file.chat_template, file.architecture)
            formatter = ChatFormatter(template, file.bos_text, file.eos_text, file.add_bos)
        except Exception:
            file.close()
            raise
        ctx = int(spec.preset.engine.get("ctx_size", ctx_size))
        adapters = with_digests(spec.adapters)  # the files as the replicas load them
        return cls(spec.name, file, formatter, spec.preset.system, ctx, adapters)

    def tokens(self, body: Body) -> list[int]:
        if isinstance(body, CompletionRequest):
            prompt = body.prompt_input()
            return (
                self.file.vocab.tokenize(prompt, True, True) if isinstance(prompt, str) else prompt
            )
        tools = ToolRequest.from_body(body.tools, body.tool_choice, body.parallel_tool_calls)
        if not image_parts(body.messages):
            return chat_prompt(self.formatter, self.file.vocab, self.system, body, tools)
        # An image's positions are known only once the projector has encoded it (how many)
        # from its pixels (their ids): the key stops before the first image, where the
        # replica's tokens are still these, so it never claims one image's KV for another.
        marked = tokenize_with_marks(self.file.vocab.tokenize)
        tokens = chat_prompt(self.formatter, self.file.vocab, self.system, body, tools, marked)
        return tokens[: next((i for i, t in enumerate(tokens) if t < 0), len(tokens))]


def prompt_text(body: Body) -> str:
    """The prompt's text as Ray Serve LLM's router reads it: the messages' contents in order."""
    if isinstance(body, CompletionRequest):
        prompt = body.prompt_input()
        return prompt if isinstance(prompt, str) else ""
    parts = []
    for m in body.messages:
        content = m.model_dump().get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return "".join(parts)


def parse_body(path: str, raw: bytes) -> tuple[str, Body] | None:
    """The model named and the OpenAI body of a generation request, or None (not one, or
    not valid: the replica answers why)."""
    translate = translation(path)  # the path's dialect translates its body
    if translate is None:
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            return None
        if path.endswith("/responses") and data.get("previous_response_id"):
            return None  # its history lives on one replica: pinned, not keyed
        body: Body = translate(data)
        return str(data.get("model") or ""), body
    except Exception:  # noqa: BLE001 - any bad body: no key, the replica explains
        return None


def route_key(keys: PromptKeys, body: Body, block_size: int, scope: str) -> RouteKey:
    """The prefix router's key of a parsed body: its prompt's block hashes in the request's
    cache `scope` (call it in a worker thread: rendering and tokenizing take CPU time)."""
    if len(prompt_text(body).encode("utf-8", "surrogatepass")) > keys.max_text_bytes:
        return RouteKey(keys.name)  # the replica refuses it before tokenizing: so do we
    try:
        chosen = pick_adapters(keys.name, keys.adapters, body)
        scope += files_scope(keys.adapters, chosen) + adapter_scope(chosen)  # as a replica's
        tokens = keys.tokens(body)
    except Exception:  # noqa: BLE001 - a template that refuses the chat, a bad adapter pick:
        return RouteKey(keys.name)  # the replica says so
    return RouteKey(keys.name, tuple(block_hashes(tokens, block_size, scope)))


def key_registry(
    specs: list[ModelSpec], server_template: str, keep_alive: float, ctx_size: int
) -> Registry[PromptKeys]:
    async def load(spec: ModelSpec) -> PromptKeys:
        return await asyncio.to_thread(PromptKeys.load, spec, server_template, ctx_size)

    async def unload(keys: PromptKeys) -> None:
        await asyncio.to_thread(keys.file.close)  # llama.cpp frees the vocabulary: off the loop

    return Registry(specs, load, unload, keep_alive=keep_alive)
