"""The local backend: today's in-process `AsyncEngine`, with the few members the engine-client
interface adds (all answered at once: admission happens in `add_request`)."""

from __future__ import annotations

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.request import SamplingParams


def engine_config(fields: dict) -> EngineConfig:
    """The EngineConfig of the model and engine settings (frontend.backends.iter_engine_fields)."""
    return EngineConfig(block_size=fields["block_size"], num_kv_blocks=fields["num_kv_blocks"],
                        kv_cache_memory=fields["kv_cache_memory"], kv_cache_dtype=fields["kv_cache_dtype"],
                        max_num_seqs=fields["max_num_seqs"],
                        max_num_batched_tokens=fields["max_num_batched_tokens"], max_queue=fields["max_queue"],
                        max_model_len=fields["max_model_len"], seed=fields["seed"],
                        max_restarts=fields["max_engine_restarts"], stall_timeout_s=fields["stall_timeout"],
                        speculative=fields.get("speculative", "off"), draft_model=fields.get("draft_model"),
                        num_speculative_tokens=fields.get("num_speculative_tokens", 4),
                        speculative_max_seqs=fields.get("speculative_max_seqs", 4))


def load_engine(fields: dict, engine_class=AsyncEngine) -> AsyncEngine:
    """Load the model the fields name and build its engine (not started). Raises ModelLoadError,
    or ValueError for a bad engine setting."""
    from engine.model.loading import load_model

    config = engine_config(fields)
    load_kwargs = {name: fields[name] for name in ("dtype", "device", "trust_remote_code", "quantize", "activations")}
    loaded = load_model(fields["model_id"], **load_kwargs)
    draft = None
    if config.speculative == "draft":  # the same loader and settings; its vocabulary checked against the model's
        from engine.draft import load_draft

        draft = load_draft(config.draft_model, loaded, **load_kwargs)
    return engine_class(loaded, config, draft)


class LocalEngine(AsyncEngine):
    """The engine in this process (the default backend)."""

    backend = "local"
    continuable = True

    @classmethod
    def from_settings(cls, settings) -> "LocalEngine":
        from frontend.backends import iter_engine_fields

        return load_engine(dict(iter_engine_fields(settings)), cls)

    def unavailable_reason(self) -> str:
        if self.stalled:
            return (f"The engine has been inside one step for {self.busy_s:.0f} s (--stall-timeout "
                    f"{self.config.stall_timeout_s:g} s): it is stuck, and requests are refused until it "
                    "comes back. Restart the server if it does not; its log has every thread's stack after "
                    "kill -USR1 <pid>.")
        return "The engine is not running; the server cannot generate. Check /health."

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prior_output_ids: list[int] = (), session: str | None = None, client: str | None = None,
                    images=None):
        """`session` is for backends with several replicas; one engine has one prefix cache."""
        return super().add_request(prompt_token_ids, params, request_id, prior_output_ids, client, images)

    async def wait_admitted(self, stream, timeout: float | None = None) -> None:
        return None  # add_request already admitted it or raised

    @property
    def generation_config(self):
        return self.loaded.model.generation_config

    @property
    def kv_cache_tokens(self) -> int:
        return self.core.num_kv_blocks * self.config.block_size

    def replica_stats(self) -> list[dict]:
        return []

    def health_info(self) -> dict:
        routes = self.loaded.activations
        return {"backend": "local", "weights": self.loaded.weights, "linears": self.core.linears,
                "activations": routes.as_dict() if routes is not None else None,
                "decode_attention": self.core.decode_attention, "runner": self.core.attention_path,
                "runner_reason": self.core.runner_reason,
                "kv_cache_dtype": str(self.core.kv_cache_dtype).removeprefix("torch."),
                "engine_restarts": self.num_restarts, "speculative": self._speculative()}

    def _speculative(self) -> dict:
        """The mode and its counts; which requests are never drafted (engine/speculative.py)."""
        config, stats = self.core.config, self.core.stats()
        drafter = getattr(self.core.speculator, "drafter", None)  # engine/draft.py's DraftModel, in draft mode
        return {"mode": config.speculative if self.core.speculator is not None else "off",
                "draft_model": self.draft.name if self.draft is not None and self.core.speculator is not None else None,
                "num_speculative_tokens": config.num_speculative_tokens, "max_seqs": config.speculative_max_seqs,
                "draft_tokens": stats.spec_draft_tokens, "accepted_tokens": stats.spec_accepted_tokens,
                # prompt tokens the draft took from its own prefix cache (not computed again)
                "draft_prefix_cache_hit_tokens": drafter.allocator.hit_tokens if drafter is not None else None,
                "not_drafted": "grammar, logprobs, repetition/presence/frequency penalties, under min_tokens, "
                               "a thought with a token budget"}
