"""transformers' text streamers fed by the engine thread instead of `model.generate`."""

from __future__ import annotations

from transformers import TextIteratorStreamer

from engine.request import FinishReason, InvalidRequest, RequestOutput, SamplingParams
from engine.streams import Aborts, OutputSink


class ReasoningPiece(str):
    """A piece of the model's thought (params.reasoning) in a text streamer's queue: iterating the
    streamer yields it like any text; `isinstance(piece, ReasoningPiece)` tells it from the answer."""


def check_one_sample(params: SamplingParams) -> None:
    """A text streamer carries one sample: InvalidRequest (400) for n > 1."""
    if params.n != 1:
        raise InvalidRequest(f"A text streamer carries one sample: `n` must be 1. Given: {params.n}", "n")


class RequestTextStreamer(OutputSink, TextIteratorStreamer):
    """A `TextIteratorStreamer` fed by the engine thread: `for piece in streamer` in any thread. It
    also records how the request ended, and its size."""

    def __init__(self, engine: Aborts, request_id: str, tokenizer, timeout: float | None = None):
        TextIteratorStreamer.__init__(self, tokenizer, skip_prompt=True, timeout=timeout)
        self.engine = engine
        self.request_id = request_id
        self.unfinished = {0}
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.arrival_time: float | None = None
        self.scheduled_time: float | None = None

    def _on_output(self, out: RequestOutput) -> None:  # engine thread
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.first_token_time = out.first_token_time
        self.arrival_time, self.scheduled_time = out.arrival_time, out.scheduled_time
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
        if out.reasoning:
            self.on_finalized_text(ReasoningPiece(out.reasoning))
        if out.text:
            self.on_finalized_text(out.text)
        if out.finished:
            self.on_finalized_text("", stream_end=True)

    def abort(self) -> bool:
        return self.engine.abort(self.request_id)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

