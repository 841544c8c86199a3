"""LLM: the offline batch API. All prompts go into one continuous batch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.worker.engine.api import Completion, EngineRequest, FinishReason, SamplingParams
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel


@dataclass(slots=True)
class _Progress:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int = 0


class LLM:
    """`LLM(model=...).generate(prompts, sampling)` -> one Completion per prompt, in order."""

    def __init__(self, model: str | LoadedModel, **engine_config_overrides: object) -> None:
        """model: a model spec to load, or a model already loaded (shared, not copied)."""
        if isinstance(model, LoadedModel):
            config = EngineConfig(model=model.name).replace(**engine_config_overrides)
            self.engine = Engine(model, config)
        else:
            config = EngineConfig(model=model).replace(**engine_config_overrides)
            self.engine = Engine.from_config(config)
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion (text prompts are encoded without a chat template)."""
        params = _per_prompt(sampling, len(prompts))
        prompt_ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        request_ids = [f"llm-{next(self._request_ids)}" for _ in prompts]
        progress = {rid: _Progress() for rid in request_ids}
        for sp in params:  # every compile starts before the first one is waited for
            if sp.constraint is not None:
                sp.constraint.validate()
                self.engine.grammars.submit(sp.constraint)
        try:
            for rid, ids, sp in zip(request_ids, prompt_ids, params, strict=True):
                self.engine.add_request(EngineRequest(rid, ids, sp))
            while self.engine.has_work():
                for output in self.engine.step():
                    entry = progress[output.request_id]
                    entry.token_ids.extend(output.new_token_ids)
                    entry.text.append(output.text_delta)
                    entry.finish_reason = output.finish_reason
                    entry.num_cached_prompt_tokens = output.num_cached_prompt_tokens
        except BaseException:
            # A failure (or KeyboardInterrupt) leaves no request behind in the engine.
            self.engine.abort_all()
            raise
        completions = []
        for ids, rid in zip(prompt_ids, request_ids, strict=True):
            entry = progress[rid]
            assert entry.finish_reason is not None  # the engine ran every request to its end
            completions.append(
                Completion(
                    prompt_token_ids=ids,
                    token_ids=entry.token_ids,
                    text="".join(entry.text),
                    finish_reason=entry.finish_reason,
                    num_cached_prompt_tokens=entry.num_cached_prompt_tokens,
                )
            )
        return completions


def _per_prompt(
    sampling: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling, SamplingParams):
        return [sampling] * num_prompts
    if len(sampling) != num_prompts:
        raise ValueError(f"{len(sampling)} SamplingParams for {num_prompts} prompts")
    return list(sampling)
