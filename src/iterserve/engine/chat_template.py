"""Chat prompts: messages -> prompt text through the tokenizer's chat template, shared by
``LLM.chat`` and the server's ``/v1/chat/completions``."""

from __future__ import annotations

import contextlib
import re
import secrets
from dataclasses import dataclass
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


@dataclass(slots=True)
class ChatPieces:
    """A rendered conversation and where each message's content lies in it.

    ``spans`` are (start, end) character ranges of message content in ``text``; None
    when the template could not be followed and no content holds special-token text
    (then the text is safe to tokenize as a whole)."""

    text: str
    spans: list[tuple[int, int]] | None

    def split(self) -> list[tuple[str, bool]]:
        """(piece, is_content) in order, covering ``text``."""
        out: list[tuple[str, bool]] = []
        pos = 0
        for s, e in self.spans or []:
            out.append((self.text[pos:s], False))
            out.append((self.text[s:e], True))
            pos = e
        out.append((self.text[pos:], False))
        return out


def render_chat_pieces(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    special_tokens: set[str],
    **kwargs: Any,
) -> ChatPieces:
    """Render ``messages`` and find each content's span in the result.

    The template is rendered twice: as asked, and with every content replaced by a
    unique marker. The marker render gives the template's own text between contents;
    walking the real render against it locates each content (as given, or trimmed, as
    templates often do). Raises ``ChatContentError`` when that fails and some content
    holds special-token text (it could not be kept from becoming control tokens)."""
    from iterserve.engine.tokenization import ChatContentError

    text = render_chat(tokenizer, messages, **kwargs)
    nonce = secrets.token_hex(8)
    marks = [f"ISMARK{nonce}N{i}E" for i in range(len(messages))]
    marked = [dict(m, content=mark) for m, mark in zip(messages, marks, strict=True)]
    spans: list[tuple[int, int]] | None = None
    with contextlib.suppress(Exception):  # the template may reject a marker: no spans
        spans = _locate(text, render_chat(tokenizer, marked, **kwargs), nonce,
                        [m.get("content") or "" for m in messages])
    if spans is None and any(s in (m.get("content") or "") for m in messages
                             for s in special_tokens):
        raise ChatContentError(
            "message content holds special-token text and this chat template renders "
            "content in a way the server cannot keep apart from its own markers")
    return ChatPieces(text, spans)


def _locate(text: str, marked: str, nonce: str, contents: list[str]) -> list[tuple[int, int]] | None:
    parts = re.split(f"ISMARK{nonce}N(\\d+)E", marked)
    # parts: template text, message index, template text, ...
    spans: list[tuple[int, int]] = []
    pos = 0
    for k in range(0, len(parts), 2):
        literal = parts[k]
        if not text.startswith(literal, pos):
            return None
        pos += len(literal)
        if k + 1 == len(parts):
            break
        content = contents[int(parts[k + 1])]
        following = parts[k + 2]
        for candidate in (content, content.strip(), content.lstrip(), content.rstrip()):
            if text.startswith(candidate, pos) and text.startswith(following,
                                                                   pos + len(candidate)):
                spans.append((pos, pos + len(candidate)))
                pos += len(candidate)
                break
        else:
            return None
    return spans if pos == len(text) else None
