"""The usual chat Space, as a baseline: `gr.ChatInterface` whose generator reads a
`TextIteratorStreamer` fed by `model.generate` in a new thread per message, `demo.queue()`
with its defaults (so one event runs at a time), the API under `api_name="/chat"`.

    python -m bench.baselines.usual_space --model DIR [--host 127.0.0.1] [--port 7861]

This is the pattern of the official Hugging Face chat demos: the conversation goes through the
model's chat template, each update is the answer so far, the sampling settings are additional
inputs. Temperature 0 is greedy (`do_sample=False`); transformers refuses temperature 0 with
sampling.
"""

from __future__ import annotations

import argparse
import os
from threading import Thread

import gradio as gr
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def build_demo(model_dir: str) -> gr.ChatInterface:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()

    def generate(message: str, history: list, max_new_tokens: int = 512, temperature: float = 0.7):
        conversation = [{"role": m["role"], "content": m["content"]} for m in history or [] if isinstance(m, dict)]
        conversation.append({"role": "user", "content": message})
        if tokenizer.chat_template:
            input_ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        else:
            input_ids = tokenizer(message, return_tensors="pt").input_ids
        streamer = TextIteratorStreamer(tokenizer, timeout=600.0, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(input_ids=input_ids.to(model.device), streamer=streamer, max_new_tokens=int(max_new_tokens))
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=float(temperature))
        else:
            kwargs.update(do_sample=False)
        Thread(target=model.generate, kwargs=kwargs).start()
        outputs = []
        for text in streamer:
            outputs.append(text)
            yield "".join(outputs)

    return gr.ChatInterface(
        fn=generate,
        additional_inputs=[
            gr.Slider(1, 2048, value=512, step=1, label="Max new tokens"),
            gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature"),
        ],
        api_name="chat",  # exposed as "/chat"
        title="The usual chat Space",
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="The usual chat Space (gr.ChatInterface + TextIteratorStreamer + a thread per message).")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7861)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    demo = build_demo(args.model)
    demo.queue().launch(server_name=args.host, server_port=args.port, show_error=True)


if __name__ == "__main__":
    main()
