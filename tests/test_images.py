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
from tests.tiny_vision import test_image, tiny_vlm  # noqa: F401 (tiny_vlm: the session fixture)

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


def test_text_only_model_refuses_images(tiny_model, loaded):
    """An image request to a text model is refused (never served without its image)."""
    from engine.request import InvalidRequest

    llm = LLM(load_model(str(tiny_model("llama"))))
    _, images = loaded.vision.prepare(_messages("What is this?"), [test_image(1)])
    with pytest.raises(InvalidRequest, match="text only"):
        llm.generate([[1, 2, 3]], _greedy(), images=[images])
