"""Incremental detokenization and stop strings, per sequence.

Text is decoded over a short window of recent tokens; a piece ending in U+FFFD (a UTF-8
character whose bytes are split over tokens) is held back until the next token completes it.
Bytes that can never complete (a run of stray continuation bytes, which random or broken
models emit) are released as U+FFFD once a later byte shows they are final, where the
tokenizer decodes bytes one error at a time; a byte-fallback decoder, which may turn a whole
run of byte tokens from U+FFFD into text at its last byte, keeps holding them (there, a run
that turns invalid after some of its characters were shown reads as all U+FFFD in a decode
of the whole output, while the stream keeps what it showed: broken output only).
Text that could be the beginning of a stop string is also held back, so a stop string spread
over several tokens is never half-emitted.
"""

from __future__ import annotations


def replacement_is_final(tokenizer) -> bool:
    """Whether U+FFFD followed by more text stays U+FFFD whatever comes next: true for fast
    tokenizers decoding bytes as UTF-8 with replacement (byte-level BPE: GPT-2, Llama 3, Qwen,
    SmolLM2); false with a ByteFallback decoder (SentencePiece models) or a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return backend is not None  # no decoder: tokens are joined as they are
    try:
        state = decoder.__getstate__()  # the decoder (and any it chains) as JSON bytes
    except Exception:
        return False
    return b'"ByteFallback"' not in state


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, release_final_replacements: bool | None = None):
        self.tokenizer = tokenizer
        if release_final_replacements is None:
            release_final_replacements = replacement_is_final(tokenizer)
        self.release_final_replacements = release_final_replacements
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # output tokens only
        self.prefix_offset = 0  # window start: decoding restarts here for context
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""  # all text decoded so far (stop string excluded once found)
        self.emitted = 0  # characters of `text` handed out
        self.stop = stop
        self.stopped = False  # a stop string was found; `text` ends right before it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; returns the new text that is safe to show (maybe "")."""
        self.token_ids.append(token_id)
        window_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(window_text) and not new_text.endswith("\ufffd"):
            self._commit(new_text[len(window_text):], len(self.token_ids))
        elif self.release_final_replacements and new_text.endswith("\ufffd"):
            # the longest run of held tokens whose text the later ones only extended: final
            for cut in range(len(self.token_ids) - 1, self.read_offset, -1):
                cut_text = self._decode(self.token_ids[self.prefix_offset:cut])
                if len(window_text) < len(cut_text) < len(new_text) and new_text.startswith(cut_text):
                    self._commit(cut_text[len(window_text):], cut)
                    break
        return self._release(final=False)

    def _commit(self, text: str, read_offset: int) -> None:
        self.text += text
        self.prefix_offset = self.read_offset
        self.read_offset = read_offset

    def prime(self, token_ids: list[int]) -> None:
        """Start after output that was already shown (a resumed stream): the text of these
        tokens counts as emitted, and later tokens decode in their context."""
        for token_id in token_ids:
            self.add(token_id)
        self.flush()
        self.emitted = len(self.text)

    def flush(self) -> str:
        """At the end: whatever was held back (never a broken stop string: it is removed)."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            window_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset:])
            self.text += new_text[len(window_text):]
            self.read_offset = len(self.token_ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.emitted - longest)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        end = len(self.text)
        if self.stop and not self.stopped and not final:
            end -= self._partial_stop_len()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
