"""Offline inference: ``LLM(model=...).generate(prompts, sampling_params)``.

The engine itself comes from ``engine.builder.build_engine``; text, stop strings,
n-sample fan-out and timings from ``engine.output_processor``, as for the server.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, cast

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.request import RequestStatus
from iterserve.core.sampling_params import SamplingParams, bad_words_token_ids_for
from iterserve.engine.builder import build_engine_and_config, engine_config_from_args
from iterserve.engine.output_processor import OutputProcessor, RequestState
from iterserve.measure.latency import RequestMetrics
from iterserve.model.generation_config import sampling_defaults


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: entry k is prompt token k + 1's log-probability
    # (the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None


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
    def prompt_logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].prompt_logprobs

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache (vLLM's field)."""
        m = self.outputs[0].metrics
        return m.num_cached_tokens if m is not None else None


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: text to tokenize, and an optional prefix-cache salt."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: token ids as given (``prompt`` is only echoed back)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A prompt in any accepted form, resolved: token ids or text, and its salt."""

    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None


class LLM:
    """Offline batch inference over the continuous-batching engine.

    ``LLM(model=None)`` uses the built-in tiny default model; ``engine_args`` are the
    fields of CacheConfig / SchedulerConfig / BackendConfig / EngineConfig (vLLM names,
    docs/configuration.md), e.g. ``LLM("path/to/ckpt", dtype="float32", max_num_seqs=64,
    num_gpu_blocks_override=512)``; an unknown name raises TypeError listing the known ones.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # The settings as given, then resolved against the model (a new frozen config).
        config = engine_config_from_args(model, **engine_args)
        self.engine, self.tokenizer, self.model_config, self.engine_config = (
            build_engine_and_config(config)
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, self.model_config.eos_token_ids,
            long_rope_after=self.model_config.long_rope_after)
        self._chat_tokenizer: Any = None  # built on the first chat()
        self.eos_token_id: int | None = self.output_processor.eos_token_id
        self.sampling_defaults = sampling_defaults(
            self.model_config.model_path, self.engine_config.generation_config
        )
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
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        params_list = [self._resolve_params(p) for p in params_list]
        engine = self.engine
        processor = self.output_processor
        start = engine.clock()
        results: dict[str, RequestOutput] = {}
        child_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                token_ids = (list(prompt.token_ids) if prompt.token_ids is not None
                             else self.tokenizer.encode(prompt.text))
                out = RequestOutput(str(next(self._ids)), prompt.text, token_ids)
                results[out.request_id] = out
                reqs = processor.add_request(
                    out.request_id,
                    [token_ids],
                    params,
                    engine.clock(),
                    priority=priority[i] if priority is not None else 0,
                    cache_salt=prompt.cache_salt,
                )
                for j, req in enumerate(reqs):
                    out.outputs.append(CompletionOutput(
                        j, "", [], None, logprobs=[] if params.logprobs is not None else None
                    ))
                    child_ids.append(req.request_id)
                for req in reqs:
                    engine.add_request(req)
        except BaseException:
            self._abort(child_ids)  # all or nothing
            raise

        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(child_ids), desc="generate", unit="req", dynamic_ncols=True)
        num_out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                processed = processor.process_outputs(engine.step(), engine.clock())
                if processed.reqs_to_finish:  # stop strings: free them before the next step
                    engine.finish_requests(processed.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
                for state, d in processed.deltas:
                    c = results[state.parent.request_id].outputs[state.index]
                    c.token_ids.extend(d.token_ids)
                    num_out_tokens += len(d.token_ids)
                    c.text += d.text
                    if d.logprobs and c.logprobs is not None:
                        c.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs is not None and c.prompt_logprobs is None:
                        c.prompt_logprobs = list(d.prompt_logprobs)
                    if d.finish_reason is not None:
                        c.finish_reason = d.finish_reason
                        c.stop_reason = d.stop_reason
                        c.metrics = _metrics(state, start)
                        if pbar is not None:
                            pbar.update(1)
                            elapsed = pbar.format_dict.get("elapsed") or 0.0
                            if elapsed > 0:
                                pbar.set_postfix(out_tok_s=f"{num_out_tokens / elapsed:.1f}")
        except BaseException:
            self._abort(child_ids)
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return list(results.values())

    def _abort(self, child_ids: list[str]) -> None:
        self.engine.abort_requests(child_ids)
        self.output_processor.finish_requests(child_ids, "abort", self.engine.clock())

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
        conversations: Sequence[list[dict[str, str]]]
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[dict[str, str]], messages)]
        else:
            conversations = cast(Sequence[list[dict[str, str]]], messages)
        if self._chat_tokenizer is None:
            from iterserve.engine.tokenization import PromptTokenizer

            self._chat_tokenizer = PromptTokenizer(self.tokenizer, num_threads=1)
        # As the server does: message content never becomes control tokens.
        prompts: list[PromptType] = [
            self._chat_tokenizer.encode_chat_sync(
                list(conv),
                add_special_tokens=False,
                limit=self.engine_config.scheduler.max_model_len or 2**62,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids against the vocabulary; tokenize bad_words."""
        params.verify_token_ids(self.model_config.vocab_size)
        if params.bad_words and params.bad_words_token_ids is None:
            ids = bad_words_token_ids_for(self.tokenizer, params.bad_words)
            params = dataclasses.replace(params, bad_words_token_ids=ids)
        return params


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[_Prompt]:
    if isinstance(prompts, (str, dict)):
        items: list[Any] = [prompts]
    else:
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            items = [items]  # one prompt given as token ids
    return [_prompt(p, i) for i, p in enumerate(items)]


def _prompt(p: Any, i: int) -> _Prompt:
    if isinstance(p, str):
        return _Prompt(p, None)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return _Prompt(None, p)
    if not isinstance(p, dict):
        raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a "
                         f"TextPrompt / TokensPrompt dict, got {p!r:.80}")
    extra = set(p) - {"prompt", "prompt_token_ids", "cache_salt"}
    if extra:
        raise ValueError(f"prompts[{i}] has unsupported field(s) {sorted(extra)}")
    salt = p.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompts[{i}].cache_salt must be a non-empty string")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompts[{i}].prompt must be a string")
    if "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompts[{i}].prompt_token_ids must be a list of token ids")
        return _Prompt(text, ids, salt)
    if text is None:
        raise ValueError(f"prompts[{i}] needs 'prompt' or 'prompt_token_ids'")
    return _Prompt(text, None, salt)


def _metrics(state: RequestState, start: float) -> RequestMetrics:
    return state.metrics(start)
