"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's names and semantics): a chat
reply's ``<think>...</think>`` goes to ``message.reasoning`` (and ``reasoning_content``,
its older name), the rest to ``content``, in responses and stream deltas alike.

- ``qwen3``: reasoning only inside ``<think>`` ... ``</think>``: an output that does not
  begin with ``<think>`` is all content (so ``chat_template_kwargs: {"enable_thinking":
  false}``, whose prompt closes the block, gives content).
- ``deepseek_r1``: the output is reasoning until ``</think>`` (the model may leave out
  ``<think>``); without ``</think>`` all of it is reasoning.

Where the prompt itself opens the block (the last marker in it is ``<think>``, as newer
Qwen3 and DeepSeek-R1 templates write), both read the output as reasoning until
``</think>``; where the prompt closes it (the last marker is ``</think>``), both read
content unless the output opens a block again.

A structured output or a forced tool call (``tool_choice`` required or named) applies
to the content only: its grammar waits for the end marker's tokens
(``StructuredOutputsParams.reasoning_end_token_ids``) unless the prompt has closed the
block, as vLLM's engine does. The tool parser of ``tool_choice: "auto"`` sees only the
content.

Streaming: a marker may be split across tokens and deltas; text that may still become a
marker is held back, never sent as reasoning or content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from iterserve.entrypoints.parser_registry import ParserRegistry, partial_marker

# Where the prompt leaves the model: inside a think block, after one, or neither.
PromptState = Literal["open", "closed", "none"]

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning; subclasses say whether an output without
    ``<think>`` is reasoning (``implicit_start``)."""

    start, end = START, END
    implicit_start = False

    def prompt_state(self, prompt_text: str) -> PromptState:
        i, j = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if i < 0 and j < 0:
            return "none"
        return "open" if i > j else "closed"

    def starts_in_reasoning(self, state: PromptState) -> bool:
        """Whether an output that does not begin with ``<think>`` is reasoning."""
        return state == "open" or (state == "none" and self.implicit_start)

    def grammar_waits(self, state: PromptState) -> bool:
        """Whether a request's output constraint starts only after ``</think>``: unless
        the prompt has ended the reasoning (vLLM's ``is_reasoning_end`` on the prompt)."""
        return state != "closed"

    def splitter(self, state: PromptState) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.end, self.starts_in_reasoning(state))

    def extract(self, text: str, state: PromptState) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part."""
        split = self.splitter(state)
        r1, c1 = split.feed(text)
        r2, c2 = split.finish()
        return (r1 + r2) or None, (c1 + c2) or None


REASONING_PARSERS: ParserRegistry[ThinkReasoningParser] = ParserRegistry(
    "reasoning parser", "--reasoning-parser")


@REASONING_PARSERS.register("qwen3")
class Qwen3ReasoningParser(ThinkReasoningParser):
    implicit_start = False


@REASONING_PARSERS.register("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    implicit_start = True


@dataclass(slots=True)
class ReasoningSplitter:
    """One choice's output, fed as it grows: ``feed`` returns the (reasoning, content)
    text that is certain so far, ``finish`` what was held back at the end."""

    start: str
    end: str
    default_reasoning: bool  # an output that does not open with ``start`` is reasoning
    phase: Literal["head", "reasoning", "content"] = "head"
    held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.phase == "content":
            return "", text
        buf = self.held + text
        self.held = ""
        if self.phase == "head":
            body = buf.lstrip()
            if body.startswith(self.start):
                buf, self.phase = body[len(self.start):], "reasoning"
            elif self.start.startswith(body):  # empty, or a marker may be coming
                self.held = buf
                return "", ""
            elif self.default_reasoning:
                self.phase = "reasoning"
            else:
                self.phase = "content"
                return "", buf
        i = buf.find(self.end)
        if i >= 0:
            self.phase = "content"
            return buf[:i], buf[i + len(self.end):]
        k = partial_marker(buf, self.end)
        self.held = buf[len(buf) - k:] if k else ""
        return buf[: len(buf) - k], ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.phase == "reasoning" or (self.phase == "head" and self.default_reasoning):
            return held, ""
        return "", held
