"""Chat prompts: messages -> prompt text through the tokenizer's chat template, shared by
``LLM.chat`` and the server's ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

# A ChatML template for tokenizers that ship without one (random test checkpoints). With
# tools it writes them in the Hermes / Qwen format, which --tool-call-parser hermes reads.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Their signatures are within '"
    "'<tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each call, return a JSON object with the function name and '"
    "'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    "'{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>'"
    "'<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if message['content'] %}{{ message['content'] + '\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>\n' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text (encode it with ``add_special_tokens=False``: the template already
    holds whatever special tokens the model wants, as transformers does)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tools=tools,
        **(chat_template_kwargs or {}),
    )
