"""Images in: a vision-language model (the tiny Idefics3 of tests/tiny_vision.py) through the engine
and the routes. Greedy answers equal `generate`'s with the processor's own inputs; the prefix cache
keys image positions by their pixels."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.model.loading import load_model
from engine.request import SamplingParams
from tests.tiny_vision import test_image  # tiny_vlm: the session fixture (a plugin, conftest.py)

MAX_NEW = 12


def _messages(question: str, images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def loaded(tiny_vlm):
    return load_model(str(tiny_vlm))


@pytest.fixture(scope="module")
def reference(tiny_vlm):
    """`generate`'s greedy answer with the processor's own inputs: (ids, pictures, question) -> new tokens."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()

    def answer(pictures: list, question: str) -> tuple[list[int], list[int]]:
        """(the prompt's ids, the answer's) of a question about `pictures`, or of plain text without any."""
        if pictures:
            text = processor.apply_chat_template(_messages(question, len(pictures)), add_generation_prompt=True)
            inputs = processor(text=text, images=pictures, return_tensors="pt")
        else:
            inputs = {"input_ids": torch.tensor([processor.tokenizer.encode(question, add_special_tokens=False)])}
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        n = inputs["input_ids"].shape[1]
        return inputs["input_ids"][0].tolist(), out[0, n:].tolist()

    return answer


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kwargs)


def test_loads_split_with_its_processor(loaded):
    """The folder loads as a text model plus the image encoder; the text half takes the paged path."""
    assert loaded.vision is not None and loaded.vision.family == "idefics3"
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=128))
    assert llm.core.attention_path == "paged" and llm.core.vision is loaded.vision


@pytest.mark.parametrize("budget", [128, 7], ids=["whole-prompt", "chunked-inside-the-image"])
def test_greedy_equals_generate_alone_and_beside_text(loaded, reference, budget):
    """One image request, then two image requests (different pictures and shapes) in one batch beside
    two text requests: each answer is `generate`'s token for token. A budget of 7 tokens a step cuts
    the prompt's 20 image tokens across chunks."""
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=budget))
    pictures = [test_image(1), test_image(2, (30, 70))]
    want = [reference([p], q) for p, q in zip(pictures, ["What is this?", "Describe it."])]
    ids, images = loaded.vision.prepare(_messages("What is this?"), [pictures[0]])
    assert ids == want[0][0]  # the processor's own tokens
    alone = llm.generate([ids], _greedy(), images=[images])
    assert alone[0].token_ids == want[0][1]
    prepared = [loaded.vision.prepare(_messages(q), [p]) for p, q in zip(pictures, ["What is this?", "Describe it."])]
    texts = [reference([], t) for t in ("hello there", "the sun and the moon")]
    results = llm.generate([prepared[0][0], texts[0][0], prepared[1][0], texts[1][0]], _greedy(),
                           images=[prepared[0][1], None, prepared[1][1], None])
    assert [r.token_ids for r in results] == [want[0][1], texts[0][1], want[1][1], texts[1][1]]


def test_prefix_cache_hits_the_same_picture_and_misses_another(loaded):
    """A repeated picture under a new question takes its image blocks from the cache; another picture
    of the same size (same tokens, other pixels) takes none of them; another cache_salt none either."""
    llm = LLM(loaded, EngineConfig(block_size=4))
    alloc = llm.core.allocator

    def hit(picture, question, salt=None) -> int:
        ids, images = loaded.vision.prepare(_messages(question), [picture])
        before = alloc.hit_tokens
        llm.generate([ids], _greedy(cache_salt=salt), images=[images])
        return alloc.hit_tokens - before

    ids, images = loaded.vision.prepare(_messages("What is this?"), [test_image(1)])
    assert hit(test_image(1), "What is this?") == 0
    past_image = hit(test_image(1), "Anything else?")
    assert past_image > images.last  # every image block came from the cache
    other = hit(test_image(3), "Anything else?")
    assert other <= images.first  # only the text before the image
    assert hit(test_image(1), "Anything else?", salt="another caller") == 0
    encoded = loaded.vision.images_encoded
    hit(test_image(1), "Anything else?")
    assert loaded.vision.images_encoded == encoded  # a whole hit on the image runs no encoder


def test_two_pictures_share_the_first_ones_blocks_and_part_at_the_second(loaded, reference):
    """Each block's hash takes the digests of the images whose tokens it holds: [picture 1, picture 2]
    then [picture 1, picture 3] (picture 3 of picture 2's size: the same tokens, other pixels) share
    every block before the one where picture 2's tokens start, and none from there on; the second
    answer, computed on the first one's blocks, is still `generate`'s."""
    bs = 4
    llm = LLM(loaded, EngineConfig(block_size=bs))
    alloc = llm.core.allocator
    pictures = [test_image(1), test_image(2, (30, 70)), test_image(3, (30, 70))]
    first_ids, first = loaded.vision.prepare(_messages("Compare them.", 2), pictures[:2])
    ids, images = loaded.vision.prepare(_messages("Compare them.", 2), [pictures[0], pictures[2]])
    assert ids == first_ids and images.spans[0].digest == first.spans[0].digest != first.spans[1].digest
    second_start = images.spans[1].first
    assert second_start // bs > images.spans[0].last // bs  # picture 1's blocks lie wholly before picture 2's
    llm.generate([first_ids], _greedy(), images=[first])
    before = alloc.hit_tokens
    out = llm.generate([ids], _greedy(), images=[images])
    assert alloc.hit_tokens - before == second_start // bs * bs  # up to the block where picture 2 starts
    assert out[0].token_ids == reference([pictures[0], pictures[2]], "Compare them.")[1]


def test_encoder_cache_skips_a_repeated_picture_without_its_blocks(loaded, reference):
    """With no prefix cache (every KV block computed again), a picture seen before is not encoded
    again: its features come from the encoder cache; a new picture beside it is, alone; another
    caller's cache_salt encodes its own. Answers stay `generate`'s. A cache too small for one
    picture's features keeps none."""
    vision = loaded.vision
    llm = LLM(loaded, EngineConfig(prefix_caching=False))
    pictures = [test_image(11), test_image(12, (30, 70))]

    def run(images: list, question: str, salt=None) -> int:
        """Images encoded for the request; its answer checked against generate's."""
        ids, prompt_images = vision.prepare(_messages(question, len(images)), images)
        before = vision.images_encoded
        out = llm.generate([ids], _greedy(cache_salt=salt), images=[prompt_images])
        assert out[0].token_ids == reference(images, question)[1]
        return vision.images_encoded - before

    assert run([pictures[0]], "What is this?") == 1
    assert run([pictures[0]], "And now?") == 0  # its blocks were not kept, its features were
    assert run([pictures[0], pictures[1]], "Compare them.") == 1  # only the new one
    assert run([pictures[0]], "What is this?", salt="another caller") == 1
    kept = vision.cache.max_bytes
    try:
        vision.cache = type(vision.cache)(16)  # bytes: no picture's features fit
        assert run([pictures[0]], "What is this?") == 1
        assert run([pictures[0]], "What is this?") == 1 and vision.cache.bytes == 0
    finally:
        vision.cache = type(vision.cache)(kept)


@pytest.mark.parametrize("budget", [256, 6], ids=["whole-prompt", "chunked-inside-an-image"])
@pytest.mark.parametrize("family", ["llava", "llava_next", "gemma3"])
def test_more_families_greedy_equals_generate(request, family, budget):
    """LLaVA (a CLIP tower and projector, one tile a picture), LLaVA-NeXT (anyres: a picture's grid
    of tiles and its whole view, unpadded, rows ended by image_newline; so pictures of other sizes
    get other token counts) and Gemma 3 (a picture's tokens attend to each other both ways, on a
    text model with a sliding window) through the same split and ImageEncoder: two pictures (LLaVA's
    tokens touching) beside a text request answer as `generate` with the processor's inputs. With 6
    tokens a step LLaVA's pictures span many chunks; Gemma 3's 4-token pictures, which such chunks
    would cut (positions 9-12 and 19-22), are each computed in one chunk."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = request.getfixturevalue(f"tiny_{family}")
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    pictures = [test_image(1), test_image(2, (30, 70))]
    text = processor.apply_chat_template(_messages("Compare them.", 2), add_generation_prompt=True)
    inputs = processor(text=text, images=pictures, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    want = out.sequences[0, n:].tolist()
    # each token's logprob under generate: closer than the argmax alone (Gemma 3's image attention moves
    # the logits after the pictures by a few thousandths, which no argmax here shows)
    want_logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(out.logits, want)]
    plain = torch.tensor([processor.tokenizer.encode("the sun and the moon", add_special_tokens=False)])
    want_text = model.generate(input_ids=plain, max_new_tokens=MAX_NEW, do_sample=False)[0, plain.shape[1]:].tolist()

    loaded = load_model(str(folder))
    text_class = "Gemma3ForCausalLM" if family == "gemma3" else "LlamaForCausalLM"
    assert loaded.vision.family == family and type(loaded.model).__name__ == text_class
    llm = LLM(loaded, EngineConfig(max_num_batched_tokens=budget))
    assert llm.core.attention_path == "paged"
    ids, images = loaded.vision.prepare(_messages("Compare them.", 2), pictures)
    assert ids == inputs["input_ids"][0].tolist() and images.count == 2
    if family == "gemma3":
        assert [(span.first, span.last) for span in images.spans] == [(9, 12), (19, 22)]
    else:
        assert images.spans[1].first == images.spans[0].last + 1  # the two pictures' tokens touch
    results = llm.generate([ids, plain[0].tolist()], _greedy(logprobs=0), images=[images, None])
    assert [r.token_ids for r in results] == [want, want_text]
    assert [lp.logprob for lp in results[0].outputs[0].logprobs] == pytest.approx(want_logprobs, abs=1e-4)


def test_whole_images_chunking_and_blocks(tiny_gemma3, loaded):
    """Gemma 3's pictures (4 tokens at 9-12 and 19-22) are never cut: a chunk that would end inside one
    stops before it, one starting at or inside one runs to its end (past the budget); the mask's blocks
    are the images ending in the chunk, one begun before it (a prefix hit inside it) included. Other
    families are chunked as text."""
    gemma3 = load_model(str(tiny_gemma3)).vision
    _, images = gemma3.prepare(_messages("Compare them.", 2), [test_image(1), test_image(2, (30, 70))])
    assert [(span.first, span.last) for span in images.spans] == [(9, 12), (19, 22)] and images.whole
    assert [images.chunk_tokens(start, n) for start, n in [(0, 6), (6, 6), (9, 2), (11, 1), (13, 6), (0, 9)]] == \
        [6, 3, 4, 2, 6, 9]
    assert images.blocks_within(9, 15) == ((9, 12),) and images.blocks_within(11, 13) == ((9, 12),)
    assert images.blocks_within(0, 9) == () and images.blocks_within(9, 23) == ((9, 12), (19, 22))
    _, other = loaded.vision.prepare(_messages("What is this?"), [test_image(1)])  # Idefics3: chunked as text
    assert not other.whole and other.chunk_tokens(other.first, 2) == 2 and other.blocks_within(0, 100) == ()


def test_text_only_model_refuses_images(tiny_model, loaded):
    """An image request to a text model is refused (never served without its image)."""
    from engine.request import InvalidRequest

    llm = LLM(load_model(str(tiny_model("llama"))))
    _, images = loaded.vision.prepare(_messages("What is this?"), [test_image(1)])
    with pytest.raises(InvalidRequest, match="text only"):
        llm.generate([[1, 2, 3]], _greedy(), images=[images])


# --------------------------------------------------------------------------- over HTTP

IMAGE_BYTES_LIMIT = 8000  # the server's --max-image-bytes: a 50x40 random PNG (about 6 KB) fits, a 90x90 one (24 KB) not


def _png(picture) -> bytes:
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    import base64

    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _bomb_png(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims width x height (its CRC made right): decoding it would take
    width x height x 3 bytes."""
    import struct
    import zlib

    data = _png(test_image(0, (1, 1)))
    start = data.index(b"IHDR")
    fields = struct.pack(">II", width, height) + data[start + 12:start + 17]
    chunk = b"IHDR" + fields
    return data[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[start + 21:]


def _chat_body(parts: list[dict], **extra) -> dict:
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_NEW,
            "temperature": 0, **extra}


@pytest.fixture(scope="module")
def vlm_server(server_with, tiny_vlm):
    return server_with("--max-image-bytes", str(IMAGE_BYTES_LIMIT), model=tiny_vlm)


def test_health_says_images_and_limits(vlm_server, tiny_server):
    import httpx

    images = httpx.get(f"{vlm_server.url}/health").json()["images"]
    assert images["family"] == "idefics3" and images["max_images"] == 4
    assert images["families"] == ["gemma3", "idefics3", "llava", "llava_next", "smolvlm"]  # the families that load
    assert images["max_bytes"] == IMAGE_BYTES_LIMIT and images["allowed_media_domains"] == []
    assert httpx.get(f"{tiny_server.url}/health").json()["images"] is None


def test_chat_completions_answers_about_an_image_as_generate_does(vlm_server, reference, loaded):
    """An image_url part (a data: URL) and a text part: the answer is generate's on the same picture,
    and a different picture gets generate's answer for that one."""
    import httpx

    for seed in (1, 4):
        picture = test_image(seed)
        _, want = reference([picture], "What is this?")
        parts = [{"type": "image_url", "image_url": {"url": _data_url(_png(picture))}},
                 {"type": "text", "text": "What is this?"}]
        r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json=_chat_body(parts), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == len(want)
        assert r.json()["choices"][0]["message"]["content"] == loaded.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("case", ["count", "url", "bytes", "pixels", "bomb", "format", "base64"])
def test_each_image_limit_is_a_400_naming_it(vlm_server, case):
    import httpx

    png = _data_url(_png(test_image(1)))
    image = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    parts, says = {
        "count": ([image(png)] * 5, ["at most 4 images", "Given: 5"]),
        "url": ([image("https://example.com/cat.png")], ["--allowed-media-domains", "'example.com'"]),
        "bytes": ([image(_data_url(_png(test_image(1, (90, 90)))))], [f"at most {IMAGE_BYTES_LIMIT} bytes", "Given:"]),
        "pixels": ([image(_data_url(_bomb_png(5000, 4000)))], ["at most 16777216 pixels",
                                                               "5000x4000 = 20000000 pixels"]),
        "bomb": ([image(_data_url(_bomb_png(100_000, 100_000)))], ["at most 16777216 pixels",
                                                                   "Given: 10000000000 pixels"]),
        "format": ([image(_data_url(b"BM" + b"\0" * 60, "image/bmp"))], ["is not a PNG, JPEG, WEBP, GIF file"]),
        "base64": ([image("data:image/png;base64,@@@@")], ["not valid base64"]),
    }[case]
    r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json=_chat_body(parts + [{"type": "text", "text": "hi"}]),
                   timeout=60)
    assert r.status_code == 400, r.text
    for text in says:
        assert text in r.json()["error"]["message"]


def test_text_model_refuses_an_image(tiny_server):
    import httpx

    parts = [{"type": "image_url", "image_url": {"url": _data_url(_png(test_image(1)))}},
             {"type": "text", "text": "What is this?"}]
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=_chat_body(parts), timeout=60)
    assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"]


def _sse_text(raw: str, field: str) -> str:
    """The text of /chat's SSE stream: its `field` deltas joined."""
    import json

    text = ""
    for line in raw.splitlines():
        if line.startswith("data:"):
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get(field), str):
                text += event[field]
    return text


def test_every_route_takes_the_image(vlm_server, reference, loaded):
    """/chat `images`, /v1/messages image blocks (and count_tokens), /v1/responses input_image: each
    answers about the picture as generate does."""
    import base64

    import httpx

    picture = test_image(5)
    ids, want = reference([picture], "What is this?")
    answer = loaded.tokenizer.decode(want, skip_special_tokens=True)
    png = _png(picture)
    url = vlm_server.url
    r = httpx.post(f"{url}/chat", json={"messages": [{"role": "user", "content": "What is this?"}],
                                        "images": [_data_url(png)], "temperature": 0, "max_new_tokens": MAX_NEW,
                                        "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == answer
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}
    messages = [{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(f"{url}/v1/messages", json={"model": "idefics3", "messages": messages, "max_tokens": MAX_NEW,
                                               "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == answer
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "idefics3", "messages": messages}, timeout=60)
    assert r.json()["input_tokens"] == len(ids)  # the image's tokens counted
    content = [{"type": "input_image", "image_url": _data_url(png)}, {"type": "input_text", "text": "What is this?"}]
    r = httpx.post(f"{url}/v1/responses", json={"input": [{"role": "user", "content": content}], "temperature": 0,
                                                "max_output_tokens": MAX_NEW}, timeout=120)
    assert r.status_code == 200, r.text
    assert "".join(p["text"] for item in r.json()["output"] if item["type"] == "message"
                   for p in item["content"]) == answer
