"""A streamed chat reply's deltas, per choice: the reasoning first (``reasoning`` and
``reasoning_content``, with a reasoning parser), then content, or ``tool_calls`` (with a
tool plan, which sees only the content). ``reply`` is the same split for a finished,
non-streamed choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.entrypoints.reasoning import PromptState, ThinkReasoningParser
from iterserve.entrypoints.tools import ToolCall, ToolPlan


@dataclass(slots=True)
class ChatReasoning:
    """A request's reasoning parser, where its prompt left the model, and whether the
    client wants the reasoning (vLLM's ``include_reasoning``)."""

    parser: ThinkReasoningParser
    state: PromptState
    include: bool = True


def _with_reasoning(delta: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    # vLLM's field is ``reasoning``; ``reasoning_content`` is its older name, which
    # clients written against earlier vLLM releases read.
    return {"reasoning": reasoning, "reasoning_content": reasoning, **delta} if reasoning \
        else delta


def reply(text: str, plan: ToolPlan | None, reasoning: ChatReasoning | None
          ) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished choice's text."""
    thought: str | None = None
    content: str | None = text
    if reasoning is not None:
        thought, content = reasoning.parser.extract(text, reasoning.state)
        if not reasoning.include:
            thought = None
    if plan is None or (content is None and reasoning is not None):
        return thought, content, []  # no content (the reasoning was cut short): no call
    content, calls = plan.extract(content or "")
    return thought, content, calls


def message_reasoning(thought: str | None) -> dict[str, Any]:
    """The response message's reasoning fields."""
    return {"reasoning": thought, "reasoning_content": thought}


class ChatDeltas:
    """The deltas of a streamed reply's ``n`` choices."""

    def __init__(self, n: int, plan: ToolPlan | None, reasoning: ChatReasoning | None) -> None:
        self.tools = _ToolStream(plan, n) if plan is not None else None
        self.reasoning = reasoning
        self.split = [reasoning.parser.splitter(reasoning.state) for _ in range(n)] \
            if reasoning is not None else None

    def delta(self, index: int, text: str, has_tokens: bool,
              finish: str | None) -> tuple[dict[str, Any], str | None]:
        """One engine output's delta and finish reason (tool calls make it ``tool_calls``).
        ``has_tokens``: the output carried tokens (an empty ``content`` then says so)."""
        thought = ""
        if self.split is not None:
            split = self.split[index]
            thought, text = split.feed(text)
            if finish is not None:
                more_thought, more_text = split.finish()
                thought, text = thought + more_thought, text + more_text
            if self.reasoning is not None and not self.reasoning.include:
                thought = ""
        if self.tools is not None:
            delta: dict[str, Any] = {}
            if text or finish is not None:
                delta, finish = self.tools.delta(index, text, finish)
        else:
            delta = {"content": text} if text or (has_tokens and not thought) else {}
        return _with_reasoning(delta, thought), finish


class _ToolStream:
    """Per-choice streaming of a tool plan: content while no call can have begun, then
    ``tool_calls`` deltas (a named call's arguments as they come, others once whole)."""

    def __init__(self, plan: ToolPlan, n: int) -> None:
        self.plan = plan
        self.text = [""] * n
        self.sent = [0] * n  # characters of text sent as content or arguments
        self.call_ids: dict[int, str] = {}

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        plan = self.plan
        self.text[index] += text
        full = self.text[index]
        if plan.is_streamed_as_arguments:
            piece = full[self.sent[index]:]
            self.sent[index] = len(full)
            if not piece:
                return {}, finish
            call: dict = {"index": 0, "function": {"arguments": piece}}
            if index not in self.call_ids:  # the first piece names the call
                first = plan.extract("")[1][0]
                self.call_ids[index] = first.id
                call = {"index": 0, "id": first.id, "type": "function",
                        "function": {"name": first.name, "arguments": piece}}
            return {"tool_calls": [call]}, finish
        if finish is None:
            upto = plan.content_prefix(full)
            piece = full[self.sent[index]:upto] if upto > self.sent[index] else ""
            self.sent[index] = max(self.sent[index], upto)
            return ({"content": piece} if piece else {}), None
        content, calls = plan.extract(full)
        delta: dict = {}
        if not calls:
            rest = full[self.sent[index]:]
            if rest:
                delta["content"] = rest
        else:
            head = content or ""
            if len(head) > self.sent[index]:
                delta["content"] = head[self.sent[index]:]
            delta["tool_calls"] = [c.to_dict(i) for i, c in enumerate(calls)]
        return delta, plan.finish_reason(finish, calls)
