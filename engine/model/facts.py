"""What the engine reads off a loaded model: its context length and the tokens that end an answer."""

from __future__ import annotations


def model_context_length(config) -> int:
    """The context the model was trained for (its config's position limit; 2048 when it names none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's, else the tokenizer's EOS."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)
