"""Chat prompts: messages -> prompt text through the tokenizer's chat template, shared by
``LLM.chat`` and the server's ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

# A ChatML template for tokenizers that ship without one (random test checkpoints).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
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
        **(chat_template_kwargs or {}),
    )
