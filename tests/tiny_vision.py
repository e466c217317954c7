"""A tiny random-weight vision-language model for tests, built at test time (no network).

`build_tiny_idefics3(out_dir)`: an `Idefics3ForConditionalGeneration` (SmolVLM's architecture: a
SigLIP encoder, a pixel-shuffle connector, a Llama text model) saved with its `Idefics3Processor`:
the tiny tests' tokenizer with Idefics3's image tokens added, images split into 32x32 tiles of 4
image tokens each, and a ChatML template whose image parts render as `<image>`. `test_image(seed)`:
a small random RGB picture (PIL). `build_tiny_llava(out_dir)`: a LLaVA of the same text model, one
tile a picture; `build_tiny_llava_next(out_dir)`: a LLaVA-NeXT (anyres tiles, image_newline). As a
pytest plugin it provides the session fixtures `tiny_vlm`, `tiny_llava` and `tiny_llava_next`.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
TILE = 32  # pixels of a tile's side (the vision tower's image_size)
PATCH = 8
SCALE = 2  # the connector's pixel shuffle
VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_idefics3(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Idefics3 model and its processor into `out_dir` (float32 safetensors)."""
    import torch
    import transformers as tf

    from tests.tiny_models import CONTEXT, _special_ids, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    ids = _special_ids(tokenizer)
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                          initializer_range=0.2, **ids)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
                  patch_size=PATCH, initializer_range=0.2)
    config = tf.Idefics3Config(text_config=text.to_dict(), vision_config=vision, scale_factor=SCALE,
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                               **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Idefics3ForConditionalGeneration(config).eval()
    model.generation_config = tf.GenerationConfig(**ids)
    images = tf.Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    processor = tf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                     image_seq_len=(TILE // PATCH) ** 2 // SCALE ** 2, chat_template=VLM_TEMPLATE)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny `LlavaForConditionalGeneration` (a CLIP vision tower, the two-layer projector, a
    Llama text model) and its `LlavaProcessor` into `out_dir`: the tiny tokenizer with `<image>`
    added, each picture resized and cropped to one 32x32 tile of 16 image tokens (the CLS position
    dropped, "default")."""
    import torch
    import transformers as tf

    from tests.tiny_models import CONTEXT, _special_ids, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ids = _special_ids(tokenizer)
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                          initializer_range=0.2, **ids)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=TILE, patch_size=PATCH, projection_dim=32, initializer_range=0.2)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(
        "<image>"), tie_word_embeddings=False, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlavaForConditionalGeneration(config).eval()
    model.generation_config = tf.GenerationConfig(**ids)
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE})
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=VLM_TEMPLATE)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def _tiny_llama_text(tokenizer):
    import transformers as tf

    from tests.tiny_models import CONTEXT, _special_ids

    return tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                          initializer_range=0.2, **_special_ids(tokenizer))


def build_tiny_llava_next(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny `LlavaNextForConditionalGeneration` (CLIP on 32x32 tiles, the projector, a Llama
    text model, its `image_newline`) and its `LlavaNextProcessor` into `out_dir`: "anyres", a picture
    resized to the best of the 32x64, 64x32 and 64x64 grids and cut into its 32x32 tiles after a
    32x32 view of the whole, the tiles' features unpadded to the picture's aspect and ended row by
    row with the newline."""
    import torch
    import transformers as tf

    from tests.tiny_models import _special_ids, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ids = _special_ids(tokenizer)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=TILE, patch_size=PATCH, projection_dim=32, initializer_range=0.2)
    grid = [[TILE, 2 * TILE], [2 * TILE, TILE], [2 * TILE, 2 * TILE]]
    config = tf.LlavaNextConfig(vision_config=vision, text_config=_tiny_llama_text(tokenizer), image_grid_pinpoints=grid,
                                image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                                **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlavaNextForConditionalGeneration(config).eval()
        with torch.no_grad():  # initialised to zeros by default: random, so a wrong placement shows
            model.model.image_newline.normal_(0, 0.5)
    model.generation_config = tf.GenerationConfig(**ids)
    images = tf.LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                           image_grid_pinpoints=grid)
    processor = tf.LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      chat_template=VLM_TEMPLATE)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_gemma3(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny `Gemma3ForConditionalGeneration` (SigLIP on 32x32 pictures, the pooling projector
    down to 4 tokens a picture, a Gemma 3 text model with a sliding window of 48: the answers see both
    test pictures, their last tokens not the prompt's start) and its
    `Gemma3Processor` into `out_dir`: each picture as `<start_of_image>`, 4 `<image_soft_token>`s
    (which attend to each other both ways) and `<end_of_image>`."""
    import torch
    import transformers as tf

    from tests.tiny_models import CONTEXT, _special_ids, build_tokenizer

    tokenizer = build_tokenizer()
    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(marks.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=marks)  # the processor reads them by these names
    ids = _special_ids(tokenizer)
    token = tokenizer.convert_tokens_to_ids
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
                               sliding_window=48, query_pre_attn_scalar=16, initializer_range=0.2, **ids)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=TILE, patch_size=PATCH)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                             boi_token_index=token(marks["boi_token"]), eoi_token_index=token(marks["eoi_token"]),
                             image_token_index=token(marks["image_token"]), tie_word_embeddings=False, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # initialised to zeros (every image token the same): random, so they differ
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.generation_config = tf.GenerationConfig(**ids)
    images = tf.Gemma3ImageProcessorPil(size={"height": TILE, "width": TILE})
    processor = tf.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                                   chat_template=VLM_TEMPLATE.replace("<image>", marks["boi_token"]))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def test_image(seed: int = 0, size: tuple[int, int] = (50, 40)):
    """A random RGB picture of `size` (width, height)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


test_image.__test__ = False  # a helper, not a test

try:
    import pytest
except ImportError:
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def tiny_vlm(tmp_path_factory) -> Path:
        """The folder of the tiny Idefics3 model, built once per run."""
        return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_vlm") / "idefics3")

    @pytest.fixture(scope="session")
    def tiny_llava(tmp_path_factory) -> Path:
        """The folder of the tiny LLaVA model, built once per run."""
        return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava") / "llava")

    @pytest.fixture(scope="session")
    def tiny_gemma3(tmp_path_factory) -> Path:
        """The folder of the tiny Gemma 3 model, built once per run."""
        return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3") / "gemma3")

    @pytest.fixture(scope="session")
    def tiny_llava_next(tmp_path_factory) -> Path:
        """The folder of the tiny LLaVA-NeXT model, built once per run."""
        return build_tiny_llava_next(tmp_path_factory.mktemp("tiny_llava_next") / "llava_next")
