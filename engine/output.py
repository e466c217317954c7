"""The per-token state machine of a sequence's output: stop, reasoning, grammar, detokenize.

Each sampled token takes one way through `OutputProcessor.route`: into the thought (between think
tags, engine/reasoning.py), the tags themselves (which switch the grammar off and on), or the
answer, which the grammar checks (engine/grammar.py) and the detokenizer turns into text, holding
back what may still become a stop string (engine/detokenizer.py). The same route replays the output
a resumed request already had, so its states continue where they were.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer, replacement_is_final
from engine.grammar import GrammarCompiler, GrammarState
from engine.reasoning import ReasoningState, think_tags
from engine.request import FinishReason, SamplingParams, Sequence


@dataclass(slots=True)
class TokenOutcome:
    """What one generated token adds to its sequence's output."""

    text: str = ""  # answer text released by this token
    thought: str = ""  # reasoning text released by this token
    finish_reason: FinishReason | None = None  # None: the sequence goes on
    error: str | None = None  # with FinishReason.ERROR: what went wrong


class OutputProcessor:
    """Turns each sequence's generated tokens into text, thought and the reason it ends."""

    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int, grammars: GrammarCompiler):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammars = grammars  # compiles each request's constraint into a matcher
        self.think_tags = think_tags(tokenizer)  # None unless the model thinks between <think> tags
        self.replacement_is_final = replacement_is_final(tokenizer)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # seq_id -> its answer's detokenizer

    def _detokenizer(self, params: SamplingParams, stop=None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, params.stop if stop is None else stop,
                                      params.skip_special_tokens, self.replacement_is_final)

    def prepare(self, seq: Sequence, prior_output_ids: list[int]) -> IncrementalDetokenizer:
        """The sequence's grammar and reasoning states and its detokenizer, replayed over output it
        already had; nothing is registered until `add`."""
        params = seq.params
        detok = self._detokenizer(params)
        if params.reasoning and self.think_tags is not None:
            seq.reasoning = ReasoningState(self.think_tags, seq.token_ids[:seq.num_prompt_tokens],
                                           params.max_reasoning_tokens, self._detokenizer(params, ()))
        if params.constraint is not None:
            seq.grammar = GrammarState(self.grammars.matcher(params.constraint),
                                       active=seq.reasoning is None or not seq.reasoning.thinking)
        answer = []
        for token_id in prior_output_ids:
            kind, _ = self.route(seq, token_id)  # a thought's text is not shown again
            if kind == "answer":
                answer.append(token_id)
                if seq.grammar is not None and seq.grammar.active:
                    seq.grammar.accept(token_id)
        detok.prime(answer)
        if seq.reasoning is not None:
            seq.reasoning.answer_text(detok.text[:detok.emitted])  # the answer's leading space went then
        return detok

    def add(self, seq: Sequence, detok: IncrementalDetokenizer) -> None:
        self.detokenizers[seq.seq_id] = detok

    @staticmethod
    def route(seq: Sequence, token_id: int) -> tuple[str, str]:
        """(kind, thought text) of a token: "thought", "start" or "end" of a thought (the grammar off
        inside it), or "answer"."""
        reasoning, grammar = seq.reasoning, seq.grammar
        kind = reasoning.on_token(token_id) if reasoning is not None else "answer"
        thought = ""
        if kind == "thought":
            thought = reasoning.detokenizer.add(token_id)
        elif kind == "start" and grammar is not None:
            grammar.active = False  # the model opened a thought: free text until it ends
        elif kind == "end":
            thought = reasoning.detokenizer.flush()  # the thought's end shows what it held
            if grammar is not None:
                grammar.active = True  # the constraint applies to the answer, after the thought
        return kind, thought

    def on_token(self, seq: Sequence, token_id: int) -> TokenOutcome:
        """The outcome of `token_id`, just appended to `seq.token_ids`."""
        params, grammar = seq.params, seq.grammar
        num_out = seq.num_output_tokens
        constrained = grammar is not None and grammar.active
        out = TokenOutcome()
        if ((token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids) \
                and (num_out >= params.min_tokens or constrained):
            out.finish_reason = FinishReason.STOP  # the EOS / stop token is kept in token_ids, not in the text
        else:
            kind, out.thought = self.route(seq, token_id)
            if kind == "answer":
                if constrained and not grammar.accept(token_id):
                    return TokenOutcome(finish_reason=FinishReason.ERROR,
                                        error=f"The constraint rejected token {token_id}: {grammar.error}")
                detok = self.detokenizers[seq.seq_id]
                out.text = detok.add(token_id)
                if seq.reasoning is not None:
                    out.text = seq.reasoning.answer_text(out.text)
                if detok.stopped or (constrained and grammar.complete):
                    out.finish_reason = FinishReason.STOP  # a stop string, or the grammar is complete
        if out.finish_reason is None and (num_out >= params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            out.finish_reason = FinishReason.LENGTH
        return out

    def finish(self, seq: Sequence, reason: FinishReason, text: str, thought: str) -> tuple[str, str]:
        """(text, thought) of the sequence's last output, with what its detokenizers held back; forgets it.
        An error or an abort shows nothing that was held back: a resumed stream's continuation holds it
        again and releases it in context (`IncrementalDetokenizer.prime`)."""
        detok = self.detokenizers.pop(seq.seq_id, None)
        if detok is not None and reason not in (FinishReason.ERROR, FinishReason.ABORT):
            text += detok.flush()
            if seq.reasoning is not None:
                text = seq.reasoning.answer_text(text)
                if seq.reasoning.thinking:  # ended inside the thought: what it held back is thought
                    thought += seq.reasoning.detokenizer.flush()
        return text, thought
