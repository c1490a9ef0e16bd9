"""Offline inference: ``LLM(model=...).generate(prompts, sampling_params)``.

The engine itself comes from ``engine.builder.build_engine``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams, bad_words_token_ids_for
from iterserve.engine.builder import build_engine, engine_config_from_args
from iterserve.engine.chat_template import render_chat
from iterserve.model.generation_config import sampling_defaults


@dataclass(slots=True)
class RequestMetrics:
    """Per-request timings in seconds (engine clock); ``*_offset`` are since generate() began."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    arrival_offset: float = 0.0
    finished_offset: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (arrival -> first token)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result; ``outputs`` has ``n`` completions (vLLM's shape), and the
    first one's fields are mirrored at the top level for the common n == 1 case."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics


PromptType = str | list[int]


class LLM:
    """Offline batch inference over the continuous-batching engine.

    ``LLM(model=None)`` uses the built-in tiny default model; ``engine_args`` are the
    fields of CacheConfig / SchedulerConfig / EngineConfig (vLLM names), e.g.
    ``LLM("path/to/ckpt", dtype="float32", max_num_seqs=64, num_gpu_blocks=512)``.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_config = engine_config_from_args(model, **engine_args)
        self.engine, self.tokenizer, self.model_config = build_engine(self.engine_config)
        self.sampling_defaults = sampling_defaults(
            self.model_config.model_path, self.engine_config.generation_config
        )
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = self.model_config.eos_token_ids
        self.eos_token_id: int | None = eos if eos is not None else (ids[0] if ids else None)
        # Extra end-of-turn ids (Llama 3's <|eot_id|> ...) stop like stop_token_ids.
        self._extra_eos = [t for t in ids if t != self.eos_token_id]
        self._ids = itertools.count()

    @property
    def scheduler(self) -> Any:
        return self.engine.scheduler

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation_config.json defaults (vLLM's
        ``--generation-config auto``); what ``generate`` uses when given none."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        params_list = [self._resolve_params(p) for p in params_list]
        engine = self.engine
        start = engine.clock()
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, int, Request, Any]] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                if isinstance(prompt, str):
                    token_ids = self.tokenizer.encode(prompt)
                    text: str | None = prompt
                else:
                    token_ids, text = list(prompt), None
                out = RequestOutput(str(next(self._ids)), text, token_ids)
                results.append(out)
                for j in range(params.n):
                    p = self._child_params(params, j)
                    rid = out.request_id if params.n == 1 else f"{out.request_id}-{j}"
                    req = Request(
                        rid,
                        token_ids,
                        p,
                        engine.clock(),
                        eos_token_id=self.eos_token_id,
                        priority=priority[i] if priority is not None else 0,
                    )
                    engine.add_request(req)
                    out.outputs.append(
                        CompletionOutput(j, "", [], None, logprobs=[] if p.logprobs is not None else None)
                    )
                    children[rid] = (out, j, req, engine.detokenizers.get(rid))
        except BaseException:
            engine.abort_requests(list(children))  # all or nothing
            raise

        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(children), desc="generate", unit="req", dynamic_ncols=True)
        num_out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out, j, req, detok = children[o.request_id]
                    c = out.outputs[j]
                    c.token_ids.extend(o.new_token_ids)
                    num_out_tokens += len(o.new_token_ids)
                    if o.new_text:
                        c.text += o.new_text
                    if o.new_logprobs and c.logprobs is not None:
                        c.logprobs.extend(o.new_logprobs)
                    if o.finish_reason is not None:
                        c.finish_reason = o.finish_reason
                        c.stop_reason = o.stop_reason
                        if detok is not None:
                            c.text = detok.output_text  # includes any held-back tail
                        c.metrics = _metrics(req, start)
                        if pbar is not None:
                            pbar.update(1)
                            elapsed = pbar.format_dict.get("elapsed") or 0.0
                            if elapsed > 0:
                                pbar.set_postfix(out_tok_s=f"{num_out_tokens / elapsed:.1f}")
        except BaseException:
            engine.abort_requests(list(children))
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            text = render_chat(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids against the vocabulary; tokenize bad_words."""
        params.verify_token_ids(self.model_config.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            ids = bad_words_token_ids_for(self.tokenizer, params.bad_words)
            params = dataclasses.replace(params, bad_words_token_ids=ids)
        return params

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        changes: dict[str, Any] = {}
        if params.n > 1 and params.seed is not None:
            changes["seed"] = params.seed + index  # n distinct but reproducible samples
        if self._extra_eos and not params.ignore_eos:
            changes["stop_token_ids"] = [*params.stop_token_ids, *self._extra_eos]
        return dataclasses.replace(params, **changes) if changes else params


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str) and not (
            isinstance(p, list) and all(isinstance(t, int) for t in p)
        ):
            raise ValueError(f"prompts must be strings or lists of token ids, got {p!r:.80}")
    return prompts


def _metrics(req: Request, start: float) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=req.finished_time,
        arrival_offset=req.arrival_time - start,
        finished_offset=None if req.finished_time is None else req.finished_time - start,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
    )
