"""Chat templates: render messages with the model's Jinja template (sandboxed), then tokenize
so that special tokens are parsed in the template's own text but never inside user content.

    rendered:  <bos><start_of_turn>user\\n  Hi <end_of_turn>  ...  <start_of_turn>model\\n
               ╰─── template: specials ──╯╰content╯╰──── template: specials ────────────╯
               parse_special=True          False       parse_special=True

A model without a template (the default Gemma 3 270M base model) gets its family's known
format; `--chat-template` picks a built-in by name or reads a Jinja file.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ferrum.errors import InvalidRequest

# Written for ferrum from each family's documented turn format.
BUILTIN_TEMPLATES = {
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(system='') %}"
        "{% for m in messages %}"
        "{% if m.role in ['system', 'developer'] %}"
        "{% set ns.system = ns.system + (m.content | trim) + '\\n\\n' %}"
        "{% else %}"
        "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
        "{% if m.role != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ m.content | trim }}<end_of_turn>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "chatml": (
        "{% for m in messages %}"
        "<|im_start|>{{ 'system' if m.role == 'developer' else m.role }}\n"
        "{{ m.content }}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for m in messages %}"
        "<|start_header_id|>{{ 'system' if m.role == 'developer' else m.role }}"
        "<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
}


def _raise(message: str) -> None:
    raise InvalidRequest(f"chat template: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def resolve_template(choice: str, model_template: str | None, architecture: str) -> str:
    """The template text: --chat-template (name or file), else the model's, else its family's."""
    if choice:
        if choice in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[choice]
        if os.path.isfile(choice):
            with open(choice, encoding="utf-8") as f:
                return f.read()
        raise ValueError(
            f"--chat-template {choice!r} is neither a built-in "
            f"({', '.join(BUILTIN_TEMPLATES)}) nor a file"
        )
    if model_template:
        return model_template
    if architecture.startswith("gemma"):
        return BUILTIN_TEMPLATES["gemma"]
    return BUILTIN_TEMPLATES["chatml"]


Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)


@dataclass(frozen=True)
class ChatFormatter:
    template_text: str
    bos_text: str
    eos_text: str
    add_bos: bool

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        object.__setattr__(self, "_template", env.from_string(self.template_text))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        try:
            return self._template.render(  # type: ignore[attr-defined]
                messages=list(messages),
                add_generation_prompt=True,
                bos_token=self.bos_text,
                eos_token=self.eos_text,
            )
        except InvalidRequest:
            raise
        except TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc

    def tokenize(self, messages: Sequence[dict[str, str]], tokenize: Tokenize) -> list[int]:
        rendered = self.render(messages)
        tokens: list[int] = []
        if self.add_bos and not (self.bos_text and rendered.startswith(self.bos_text)):
            tokens = tokenize("", True, False)  # just the BOS the model expects
        for text, is_content in split_content(rendered, [m["content"] for m in messages]):
            tokens += tokenize(text, False, not is_content)
        return tokens


def split_content(rendered: str, contents: Sequence[str]) -> list[tuple[str, bool]]:
    """Splits the rendered prompt into (text, is_user_content) segments, in order.

    Each message's content is looked up after the previous one; templates may trim it, so
    the trimmed form is looked for. Content the template rewrote beyond that is not found and
    stays template text (tokenized with specials parsed): only custom templates that rewrite
    content do that, and the built-in ones never do.
    """
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for content in contents:
        needle = content.strip()
        if not needle:
            continue
        at = rendered.find(needle, cursor)
        if at < 0:
            continue
        if at > cursor:
            segments.append((rendered[cursor:at], False))
        segments.append((needle, True))
        cursor = at + len(needle)
    if cursor < len(rendered):
        segments.append((rendered[cursor:], False))
    return segments
