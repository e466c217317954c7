"""Vision-language checkpoints: the text half served as a causal LM, the vision half as an encoder.

A composite model (`Idefics3ForConditionalGeneration`, SmolVLM's; `LlavaForConditionalGeneration`;
`LlavaNextForConditionalGeneration`; `Gemma3ForConditionalGeneration`) is split at load: its language
model and head become a plain causal LM (`LlamaForCausalLM`, `Gemma3ForCausalLM`) sharing their
modules, which the engine runs as any text model (paged KV cache, packed linears, the native decode step); the vision encoder and its
connector stay in the composite and run at prefill (`ImageEncoder.embed`, on the engine thread):
their outputs replace the embeddings of the prompt's image tokens, as the model's own
`inputs_merger` does. The processor makes a prompt's tokens and pixels exactly as for `generate`.
Gemma 3's image tokens attend to each other both ways: the scheduler keeps each image in one
prefill chunk (`PromptImages.chunk_tokens`) and the chunk's mask opens its block (engine/attention.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.model.errors import ModelLoadError

log = logging.getLogger("rill.engine")

# model_type -> what the split needs: the attribute of the language model inside `composite.model`
FAMILIES = {"idefics3": "text_model", "smolvlm": "text_model", "llava": "language_model", "llava_next": "language_model",
            "gemma3": "language_model"}
# families whose image tokens attend to each other both ways inside an image (Gemma 3): an image is
# computed in one prefill chunk (the scheduler never cuts one) under a mask that opens its block
WHOLE_IMAGE_FAMILIES = {"gemma3"}
# model_type -> the token just before each image's last run of image tokens (Idefics3 splits an image
# into tiles, one run each, its global view last); in a family without one every image has one tile
# and the same number of tokens (LLaVA), whose runs may touch
LAST_TILE_MARKERS = {"idefics3": "<global-img>", "smolvlm": "<global-img>"}


def is_vision_config(config) -> bool:
    """A checkpoint with a vision tower (its config names one)."""
    return getattr(config, "vision_config", None) is not None


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image of a prompt: its image tokens' positions, its tiles and the digest of its pixels."""

    first: int  # the prompt position of its first image token
    last: int  # of its last one
    tiles: tuple[int, int]  # [start, stop) of its tiles in `PromptImages.pixel_values`
    digest: bytes  # 16 bytes of its processed pixels: the prefix cache's key of the blocks holding its tokens


@dataclass(frozen=True, slots=True, eq=False)
class PromptImages:
    """A prompt's images as the model's processor made them, and where their tokens sit."""

    pixel_values: torch.Tensor  # [tiles, 3, H, W]: every image's tiles, in prompt order
    pixel_attention_mask: torch.Tensor | None  # [tiles, H, W] bool: the real (unpadded) pixels
    positions: torch.Tensor  # [image tokens] int64: the prompt positions the features replace, in order
    spans: tuple[ImageSpan, ...]  # each image, in prompt order
    sizes: torch.Tensor | None = None  # [images, 2] (height, width) each picture had (LLaVA-NeXT's unpadding)
    whole: bool = False  # an image's tokens attend both ways (Gemma 3): each computed in one chunk

    def chunk_tokens(self, start: int, num_tokens: int) -> int:
        """The tokens a prefill chunk from `start` takes instead of `num_tokens` when images must stay
        whole: it stops before an image it would cut, or, starting inside or at one, runs to its end
        (past the step's budget if need be)."""
        if not self.whole:
            return num_tokens
        end = start + num_tokens
        for span in self.spans:
            if span.first < end <= span.last:  # the chunk would end inside this image
                return span.first - start if span.first > start else span.last + 1 - start
        return num_tokens

    def blocks_within(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """[first, last] positions of the images whose tokens end in positions [start, stop), when they
        attend both ways: an image begun in cached blocks (a prefix hit inside it) is one too, its
        cached tokens the keys its rest sees."""
        if not self.whole:
            return ()
        return tuple((span.first, span.last) for span in self.spans if start <= span.last < stop)

    @property
    def count(self) -> int:
        """Images in the prompt."""
        return len(self.spans)

    def digests_within(self, start: int, stop: int) -> bytes:
        """The digests of the images with image tokens in positions [start, stop), in order: what the
        prefix cache adds to the hash of a block holding those positions (engine/kv_cache.py)."""
        return b"".join(span.digest for span in self.spans if span.first < stop and span.last >= start)

    @property
    def first(self) -> int:
        return int(self.positions[0])

    @property
    def last(self) -> int:
        return int(self.positions[-1])


def counted_spans(input_ids: torch.Tensor, image_token_id: int, tiles: list[int], tokens: list[int],
                  pixels: torch.Tensor, sizes: torch.Tensor) -> tuple[ImageSpan, ...]:
    """Each image's span when the processor says how many tiles (`tiles`) and image tokens (`tokens`)
    each has (LLaVA-NeXT: both depend on the picture's size, and pictures' tokens may touch)."""
    positions = (input_ids == image_token_id).nonzero().flatten().tolist()
    if sum(tokens) != len(positions) or sum(tiles) != pixels.shape[0]:
        raise RuntimeError(f"the processor's prompt has {len(positions)} image tokens and {pixels.shape[0]} tiles; "
                           f"its images need {sum(tokens)} and {sum(tiles)}")
    spans, token, tile = [], 0, 0
    for i, (n_tiles, n_tokens) in enumerate(zip(tiles, tokens)):
        h = hashlib.blake2b(pixel_digest(pixels[tile:tile + n_tiles], None), digest_size=16)
        h.update(sizes[i].numpy().tobytes())  # the unpadding depends on the picture's size too
        spans.append(ImageSpan(positions[token], positions[token + n_tokens - 1], (tile, tile + n_tiles), h.digest()))
        token, tile = token + n_tokens, tile + n_tiles
    return tuple(spans)


def image_spans(input_ids: torch.Tensor, image_token_id: int, marker_id: int | None, pixels: torch.Tensor,
                mask: torch.Tensor | None, count: int) -> tuple[ImageSpan, ...]:
    """Each of `count` images' span in a prompt (`input_ids` [tokens]): its runs of image tokens (a
    tile each) up to the run after `marker_id` (its last tile), or one run when there is no marker."""
    positions = (input_ids == image_token_id).nonzero().flatten().tolist()
    if marker_id is None:  # one tile an image, the same tokens each
        if pixels.shape[0] != count or len(positions) % max(1, count):
            raise RuntimeError(f"the processor's prompt has {len(positions)} image tokens and {pixels.shape[0]} "
                               f"images' pixels for {count} images")
        each = len(positions) // max(1, count)
        return tuple(ImageSpan(positions[i * each], positions[(i + 1) * each - 1], (i, i + 1),
                               pixel_digest(pixels[i:i + 1], mask[i:i + 1] if mask is not None else None))
                     for i in range(count))
    runs: list[list[int]] = []  # [first, last] of each run of consecutive image tokens
    for p in positions:
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    groups: list[list[list[int]]] = [[]]
    for run in runs:
        groups[-1].append(run)
        if marker_id is None or (run[0] > 0 and int(input_ids[run[0] - 1]) == marker_id):
            groups.append([])
    groups = [g for g in groups if g]
    tiles_per_run = 1  # each run one tile
    if len(groups) != count or tiles_per_run * len(runs) != pixels.shape[0]:
        raise RuntimeError(f"the processor's prompt has {len(runs)} runs of image tokens in {len(groups)} "
                           f"images for {count} images and {pixels.shape[0]} tiles")
    spans, tile = [], 0
    for group in groups:
        stop = tile + tiles_per_run * len(group)
        spans.append(ImageSpan(group[0][0], group[-1][1], (tile, stop),
                               pixel_digest(pixels[tile:stop], mask[tile:stop] if mask is not None else None)))
        tile = stop
    return tuple(spans)


def pixel_digest(pixel_values: torch.Tensor, mask: torch.Tensor | None) -> bytes:
    """A BLAKE2 digest of the processed pixels (and their mask and shape): what the features depend on."""
    h = hashlib.blake2b(b"rill-images\0" + repr(tuple(pixel_values.shape)).encode(), digest_size=16)
    h.update(pixel_values.contiguous().numpy().tobytes())
    if mask is not None:
        h.update(mask.contiguous().numpy().tobytes())
    return h.digest()


ENCODER_CACHE_BYTES = 128 * 2**20  # the features of recent images kept (SmolVLM-256M: about 2 MB a picture)


class EncoderCache:
    """Recent images' features by (cache_salt, pixel digest), least recently used dropped past `max_bytes`:
    the same picture in a later request is not encoded again, even once its KV blocks are evicted. The
    salt keeps callers apart, as in the prefix cache. Used on the engine thread only."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # least recently used first
        self.bytes = 0  # of the entries' tensors
        self.hits = 0  # images found
        self.misses = 0  # images looked up and not found

    def get(self, key: tuple) -> torch.Tensor | None:
        feats = self.entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return feats

    def put(self, key: tuple, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.entries[key] = feats
        self.bytes += size


class ImageEncoder:
    """The vision half of a loaded vision-language model and its processor."""

    def __init__(self, composite, processor, family: str, cache_bytes: int = ENCODER_CACHE_BYTES):
        self.composite = composite  # the whole model: its vision tower and connector run here
        self.processor = processor
        self.family = family  # the config's model_type
        self.image_token_id = int(composite.config.image_token_id)
        marker = LAST_TILE_MARKERS.get(family)
        self.marker_id = processor.tokenizer.convert_tokens_to_ids(marker) if marker is not None else None
        self.encoder_calls = 0  # vision forwards run (one per step that brings new images)
        self.images_encoded = 0  # images that went through the encoder (not found in `cache`)
        self.cache = EncoderCache(cache_bytes)  # recent images' features

    def describe(self) -> dict:
        """What /health says of the vision half."""
        cache = self.cache
        return {"family": self.family, "families": sorted(FAMILIES), "image_token": self.processor.image_token,
                "encoder": "transformers' modules (float32, on the engine thread at prefill)",
                "encoder_cache": {"max_bytes": cache.max_bytes, "bytes": cache.bytes, "images": len(cache.entries),
                                  "hits": cache.hits, "misses": cache.misses}}

    def prepare(self, messages: list[dict], images: list, template_kwargs: dict | None = None) -> tuple[list[int], PromptImages | None]:
        """Blocking (a worker thread): the conversation through the processor's chat template (an
        image part as `{"type": "image"}`) and the processor itself, as `generate`'s caller does:
        the prompt's ids (image tokens expanded) and its `PromptImages` (None without images)."""
        proc = self.processor
        # every content as a list of parts: the processors' templates iterate over it
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                    else m for m in messages]
        text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
        out = proc(text=text, images=list(images) or None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, None
        positions = (out["input_ids"][0] == self.image_token_id).nonzero().flatten()
        if self.family == "llava_next":  # [images, most tiles, 3, H, W], each picture's own tile count
            sizes = out["image_sizes"]  # [images, 2]: each picture's (height, width)
            tiles = [self._tiles_of(size) for size in sizes.tolist()]
            pixels = torch.cat([out["pixel_values"][i, :n] for i, n in enumerate(tiles)])  # [tiles, 3, H, W]
            tokens = list(proc._get_num_multimodal_tokens(image_sizes=sizes.tolist()).num_image_tokens)
            spans = counted_spans(out["input_ids"][0], self.image_token_id, tiles, tokens, pixels, sizes)
            return ids, PromptImages(pixels, None, positions, spans, sizes)
        whole = self.family in WHOLE_IMAGE_FAMILIES
        pixels = out["pixel_values"]  # [1, tiles, 3, H, W] (Idefics3) or [images, 3, H, W] (LLaVA)
        pixels = pixels[0] if pixels.dim() == 5 else pixels  # [tiles, 3, H, W]
        mask = out.get("pixel_attention_mask")
        mask = mask[0].bool() if mask is not None else None
        spans = image_spans(out["input_ids"][0], self.image_token_id, self.marker_id, pixels, mask, len(images))
        return ids, PromptImages(pixels, mask, positions, spans, whole=whole)

    def _tiles_of(self, size: list[int]) -> int:
        """LLaVA-NeXT: the tiles of a picture of `size` (height, width): its grid's and the whole view."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        config = self.composite.config
        return image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)

    @torch.inference_mode()
    def features(self, images: list[tuple]) -> list[torch.Tensor]:
        """[image tokens, hidden] per image ((its tiles [tiles, 3, H, W], their mask or None, its size
        [2] or None)): the vision tower and connector once over the images whose tiles have one shape
        (padded with all-zero tiles, which `get_image_features` drops)."""
        model = self.composite.model
        out: dict[int, torch.Tensor] = {}
        groups: dict[tuple, list[int]] = {}
        for i, (pixels, *_) in enumerate(images):
            groups.setdefault(tuple(pixels.shape[1:]), []).append(i)
        for members in groups.values():
            most = max(images[i][0].shape[0] for i in members)
            pixels = torch.zeros(len(members), most, *images[members[0]][0].shape[1:])
            masks = torch.zeros(len(members), most, *pixels.shape[-2:], dtype=torch.bool)
            for row, i in enumerate(members):
                tiles, mask, _ = images[i]
                pixels[row, :tiles.shape[0]] = tiles
                masks[row, :tiles.shape[0]] = mask if mask is not None else True
            dev = self.composite.device
            if self.family in ("llava", "gemma3"):  # one tile an image: [images, 3, H, W] -> [tokens, hidden] each
                pooled = model.get_image_features(pixel_values=pixels[:, 0].to(dev), return_dict=True).pooler_output
            elif self.family == "llava_next":  # [images, tiles, ...] and their sizes -> a [tokens, hidden] per image
                sizes = torch.stack([images[i][2] for i in members]).to(dev)
                pooled = model.get_image_features(pixel_values=pixels.to(dev), image_sizes=sizes,
                                                  return_dict=True).pooler_output
            else:  # [images, tiles, ...] with the real pixels' mask -> [images, tiles, tokens, hidden]
                pooled = model.get_image_features(pixels.to(dev), masks.to(dev), return_dict=True).pooler_output
            for row, i in enumerate(members):
                out[i] = pooled[row].reshape(-1, pooled[row].shape[-1]).clone()  # its own storage (cached alone)
            self.encoder_calls += 1
        self.images_encoded += len(images)
        return [out[i] for i in range(len(images))]

    def prompt_features(self, seqs: list) -> list[torch.Tensor]:
        """[image tokens, hidden] per sequence: each image's features from the encoder cache (by its
        caller's cache_salt and its digest), the rest through one `features` call, then cached."""
        found: dict[tuple, torch.Tensor] = {}
        missing: dict[tuple, tuple] = {}  # key -> (tiles, mask) of an image not in the cache
        for seq in seqs:
            images = seq.images
            for index, span in enumerate(images.spans):
                key = (seq.params.cache_salt, span.digest)
                if key in found or key in missing:
                    continue
                feats = self.cache.get(key)
                if feats is not None:
                    found[key] = feats
                else:
                    start, stop = span.tiles
                    mask = images.pixel_attention_mask
                    missing[key] = (images.pixel_values[start:stop], mask[start:stop] if mask is not None else None,
                                    images.sizes[index] if images.sizes is not None else None)
        if missing:
            for key, feats in zip(missing, self.features(list(missing.values()))):
                found[key] = feats
                self.cache.put(key, feats)
        result = []
        for seq in seqs:
            feats = torch.cat([found[(seq.params.cache_salt, span.digest)] for span in seq.images.spans])
            if feats.shape[0] != seq.images.positions.numel():
                raise RuntimeError(f"the vision encoder gave {feats.shape[0]} image features for "
                                   f"{seq.images.positions.numel()} image tokens")
            result.append(feats)
        return result

    def embed(self, embeddings, plan, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings [1, tokens, hidden]: the tokens' own, with the image features
        at the image positions each chunk covers. A sequence's features are computed at its first
        chunk that covers one (several sequences in one encoder call) and kept on it until its
        prefill passed its last image token (engine/core.py drops them), so a chunk boundary
        inside an image takes its slice of the same features; an image's features come from the
        encoder cache when the same picture (same caller's salt) was encoded before."""
        todo = [c.seq for c in plan if covers_images(c) and c.seq.image_features is None]
        if todo:
            for seq, feats in zip(todo, self.prompt_features(todo)):
                seq.image_features = feats
        embeds = embeddings(input_ids)  # [1, tokens, hidden]
        offset = 0
        for chunk in plan:
            if covers_images(chunk):
                images, start = chunk.seq.images, chunk.start
                inside = (images.positions >= start) & (images.positions < start + chunk.num_tokens)
                rows = images.positions[inside] - start + offset
                embeds[0, rows.to(embeds.device)] = chunk.seq.image_features[inside.to(embeds.device)].to(embeds.dtype)
            offset += chunk.num_tokens
        return embeds


def covers_images(chunk) -> bool:
    """The chunk computes positions where its sequence's image features go."""
    images = chunk.seq.images
    return images is not None and chunk.start <= images.last and chunk.start + chunk.num_tokens > images.first


def load_vision_model(location: str, *, device, dtype, trust_remote_code: bool, attn_implementation=None):
    """(the text half as a causal LM, the tokenizer, its `ImageEncoder`) of a vision-language folder
    or hub id. Raises ModelLoadError for a family the split does not know yet."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    family = config.model_type
    if family not in FAMILIES:
        raise ModelLoadError(f"{location!r} is a vision-language model of the {family!r} family, which rill does not "
                             f"serve yet (it serves {', '.join(sorted(FAMILIES))}); give a text model or one of those")
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        processor = AutoProcessor.from_pretrained(location, trust_remote_code=trust_remote_code)
        composite = AutoModelForImageTextToText.from_pretrained(location, **kwargs).to(device).eval()
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        raise ModelLoadError(f"could not load the vision-language model {location!r}: "
                             f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}; "
                             "check that it has its processor (processor_config.json, tokenizer)") from error
    text_model = getattr(composite.model, FAMILIES[family])
    with torch.device("meta"):  # an empty shell: its modules are the composite's
        lm = AutoModelForCausalLM.from_config(text_model.config)
    lm.model, lm.lm_head = text_model, composite.lm_head
    lm.config = text_model.config
    lm.generation_config = composite.generation_config
    lm.eval()
    tokenizer = processor.tokenizer
    if getattr(tokenizer, "chat_template", None) is None and processor.chat_template is not None:
        tokenizer.chat_template = processor.chat_template  # text-only requests render with it too
    log.info("vision-language model %s: the %s text half on the engine, the vision encoder at prefill",
             family, type(lm).__name__)
    return lm, tokenizer, ImageEncoder(composite, processor, family)
