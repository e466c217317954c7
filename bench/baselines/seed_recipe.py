"""The seed recipe, as a baseline: FastAPI + sse-starlette + `TextIteratorStreamer`, with
`model.generate` run in an executor thread per request.

    python -m bench.baselines.seed_recipe --model DIR [--host 127.0.0.1] [--port 8000]

Wire format of the seed's `/chat`: body `{"prompt", "stream", "max_new_tokens",
"temperature"}`; streaming answers SSE `data:` text pieces, then `event: end` / `data: [DONE]`;
non-streaming answers `{"response": ...}`. Unknown fields (rill's `raw`) are ignored.

Two fixes to the seed's code so that it runs at all, nothing more:
- `loop.run_in_executor(None, model.generate, **kwargs)` raises TypeError (run_in_executor
  takes no keyword arguments): `functools.partial` is used.
- Reading the streamer with `run_in_executor(None, next, streamer)` raises StopIteration into a
  Future at the end of every answer (a TypeError in asyncio; the stream never sends its end
  event), and with more clients than executor threads the blocked `next` calls starve the
  `generate` calls they wait for (a hang). Here `next(streamer, sentinel)` ends the loop, and
  the generate threads and the reader threads have separate pools big enough for every client.
Temperature 0 is greedy (`do_sample=False`), as in rill; transformers refuses temperature 0
with sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


class ChatRequest(BaseModel):
    prompt: str
    stream: bool = True
    max_new_tokens: int = 512
    temperature: float = 0.7


def build_app(model_dir: str, max_threads: int = 256) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    generate_pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="generate")
    reader_pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="reader")
    done = object()
    app = FastAPI()

    def generation_kwargs(request: ChatRequest, streamer=None) -> dict:
        input_ids = tokenizer(request.prompt, return_tensors="pt").input_ids.to(model.device)
        kwargs = dict(input_ids=input_ids, max_new_tokens=request.max_new_tokens, streamer=streamer)
        if request.temperature > 0:
            kwargs.update(do_sample=True, temperature=request.temperature)
        else:
            kwargs.update(do_sample=False)
        return kwargs

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/chat")
    async def chat(request: ChatRequest):
        if request.stream:
            return EventSourceResponse(predict_stream(request))
        loop = asyncio.get_running_loop()
        output_ids = await loop.run_in_executor(generate_pool, functools.partial(model.generate, **generation_kwargs(request)))
        text = tokenizer.decode(output_ids[0], skip_special_tokens=True)
        return {"response": text[len(request.prompt):] if text.startswith(request.prompt) else text}

    async def predict_stream(request: ChatRequest):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        loop = asyncio.get_running_loop()
        loop.run_in_executor(generate_pool, functools.partial(model.generate, **generation_kwargs(request, streamer)))
        while True:
            token = await loop.run_in_executor(reader_pool, next, streamer, done)
            if token is done:
                break
            yield {"data": token}
        yield {"event": "end", "data": "[DONE]"}

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="The seed recipe (FastAPI + TextIteratorStreamer + generate per request).")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    uvicorn.run(build_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
