"""`LLM`: offline batches on the engine core, in the caller's thread."""

from __future__ import annotations

from engine.chat_template import encode_chat
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import CompletionOutput, GenerationResult, SamplingParams, new_request_id


class LLM:
    """Offline batches: `LLM(model).generate(prompts, SamplingParams(...))`, no threads."""

    def __init__(self, model, config: EngineConfig | None = None, draft=None, **load_kwargs):
        """`model`: a loaded model or what `load_model` takes (with `load_kwargs`). `draft`: the loaded
        draft model of speculative="draft"; None loads `config.draft_model` with the same kwargs."""
        if isinstance(model, (str, bytes)) or model is None or hasattr(model, "__fspath__"):
            from engine.model.loading import load_model
            model = load_model(model, **load_kwargs)
        if draft is None and config is not None and config.speculative == "draft":
            from engine.draft import load_draft
            draft = load_draft(config.draft_model, model, **load_kwargs)
        self.loaded = model
        self.tokenizer = model.tokenizer
        self.core = EngineCore(model.model, model.tokenizer, config, model.context_length, draft=draft,
                               vision=model.vision)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 images: list | None = None) -> list[GenerationResult]:
        """Strings are tokenized raw (no chat template); lists of ints are token ids. `images`: per
        prompt, None or its `PromptImages` (a vision-language model's `loaded.vision.prepare`)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        for prompt, p, prompt_images in zip(prompts, all_params, images or [None] * len(prompts)):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
            rid = new_request_id()
            self.core.add_request(rid, ids, p, images=prompt_images)
            results[rid] = GenerationResult(rid, ids, [CompletionOutput(i, "", [], None, [] if p.logprobs is not None else None)
                                                       for i in range(p.n)])
        while self.core.has_work():
            for out in self.core.step():
                c = results[out.request_id].outputs[out.index]
                c.text += out.text
                c.token_ids.extend(out.token_ids)
                c.reasoning += out.reasoning
                if out.logprobs and c.logprobs is not None:
                    c.logprobs.extend(out.logprobs)
                if out.finished:
                    c.finish_reason = out.finish_reason
        return list(results.values())

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None) -> list[GenerationResult]:
        return self.generate([encode_chat(self.tokenizer, c) for c in conversations], params)
