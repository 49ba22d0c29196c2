"""ferrum's built-in chat templates, and the choice of template for a model.

A model without a template of its own (the default Gemma 3 270M base model) gets its
family's; `--chat-template` picks one of these by name or reads a Jinja file.
"""

from __future__ import annotations

import os

# Written for ferrum from each family's documented turn format. With `tools`, each also
# teaches and replays its family's tool-call format (ferrum/api/prompting/tool_calls.py): chatml the
# Hermes/Qwen tags, llama3 Llama 3.1 JSON calls and `ipython` results, gemma ferrum's fenced
# ```tool_call convention. (Under trim_blocks a newline right after a block tag vanishes,
# hence the {{ '\n' }}.)
_CALL_ARGS = "{% set a = c.function.arguments %}{{ a if a is string else a | tojson }}"
BUILTIN_TEMPLATES = {
    "gemma": (
        "{{ bos_token }}{% set ns = namespace(system='', told=not tools) %}"
        "{% for m in messages %}"
        "{% if m.role in ['system', 'developer'] %}"
        "{% set ns.system = ns.system + (m.content | trim) + '\\n\\n' %}"
        "{% elif m.role == 'assistant' %}"
        "<start_of_turn>model\n{{ m.content | trim }}"
        "{% for c in m.tool_calls or [] %}"
        "{% if m.content | trim or not loop.first %}{{ '\\n' }}{% endif %}"
        '```tool_call\n{"name": {{ c.function.name | tojson }}, "arguments": '
        + _CALL_ARGS
        + "}\n```"
        "{% endfor %}"
        "<end_of_turn>\n"
        "{% else %}"
        "{% if m.role != 'tool' or loop.first or loop.previtem.role != 'tool' %}"
        "<start_of_turn>user\n{{ ns.system }}{% set ns.system = '' %}"
        "{% if not ns.told %}{% set ns.told = true %}"
        "You can call the functions below, given as JSON schemas:\n"
        "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
        "To call a function, answer with a fenced block like this, one block per call:\n"
        '```tool_call\n{"name": "function_name", "arguments": {"argument": "value"}}\n```\n'
        "Function results come back in ```tool_output blocks.\n\n"
        "{% endif %}"
        "{% else %}{{ '\\n' }}{% endif %}"
        "{% if m.role == 'tool' %}```tool_output\n{{ m.content | trim }}\n```"
        "{% else %}{{ m.content | trim }}{% endif %}"
        "{% if m.role != 'tool' or loop.last or loop.nextitem.role != 'tool' %}"
        "<end_of_turn>\n"
        "{% endif %}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "chatml": (
        "{% set ns = namespace(first=0) %}"
        "{% if tools %}"
        "<|im_start|>system\n"
        "{% if messages[0].role in ['system', 'developer'] %}"
        "{{ messages[0].content }}\n\n{% set ns.first = 1 %}"
        "{% endif %}"
        "# Tools\n\nYou may call one or more of the functions whose signatures are listed "
        "in <tools></tools> tags:\n<tools>"
        "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
        "{{ '\\n' }}</tools>\n\nFor each call, answer with a JSON object giving the "
        "function name and its arguments, inside <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "{% endif %}"
        "{% for m in messages[ns.first:] %}"
        "{% if m.role == 'tool' %}"
        "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
        "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
        "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}"
        "<|im_start|>{{ 'system' if m.role == 'developer' else m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
        '<tool_call>\n{"name": {{ c.function.name | tojson }}, "arguments": '
        + _CALL_ARGS
        + "}\n</tool_call>"
        "{% endfor %}"
        "<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% set ns = namespace(first=0) %}"
        "{% if tools %}"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "{% if messages[0].role in ['system', 'developer'] %}"
        "{{ messages[0].content | trim }}\n\n{% set ns.first = 1 %}"
        "{% endif %}"
        "You have access to the functions below. To call one, respond with only a JSON object "
        'in the format {"name": function name, "parameters": dictionary of argument name and '
        "its value}, one line per call. Do not use variables.\n\n"
        "{% for t in tools %}{{ '\\n\\n' if not loop.first else '' }}"
        "{{ t | tojson(indent=4) }}{% endfor %}"
        "<|eot_id|>"
        "{% endif %}"
        "{% for m in messages[ns.first:] %}"
        "<|start_header_id|>"
        "{{ 'ipython' if m.role == 'tool' else 'system' if m.role == 'developer' else m.role }}"
        "<|end_header_id|>\n\n{{ m.content | trim }}"
        "{% for c in m.tool_calls or [] %}"
        "{% if m.content | trim or not loop.first %}{{ '\\n' }}{% endif %}"
        '{"name": {{ c.function.name | tojson }}, "parameters": ' + _CALL_ARGS + "}"
        "{% endfor %}"
        "<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
}


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
