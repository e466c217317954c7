"""Tiny random-weight models for tests, built at test time (no network) and cached per test run.

As a pytest plugin (listed in the top-level conftest.py) it provides the session fixture
`tiny_model`: `tiny_model("llama") -> Path` of a folder with config.json, safetensors weights
and a tokenizer, built once per run. Without pytest: `build_tiny_model(arch, out_dir)` and
`bench_llama(out_dir)`, or from a shell:

    python -m tests.tiny_models llama /tmp/tiny-llama
    python -m tests.tiny_models bench /tmp/bench-llama

The tokenizer is a byte-level BPE trained here on the small corpus below (English, Chinese,
emoji, code), so any text round-trips and a Chinese character or an emoji spans several tokens.
Special tokens follow SmolLM2: <|endoftext|> (0, pad), <|im_start|> (1, bos), <|im_end|> (2, eos),
with a ChatML chat template.

`tiny_model("qwen3")` is a Qwen2 model dressed as a thinking, tool-calling Qwen3: the tokenizer
adds <think>, </think>, <tool_call>, </tool_call> (ids 1024-1027, not special, as Qwen's are),
the model's vocabulary is padded to 1088 (logits wider than the tokenizer, as Qwen's 151936 are
wider than its 151665 tokens), and QWEN3_CHAT_TEMPLATE renders tools, tool calls, tool results
and `enable_thinking` (on by default: the generation prompt opens the thought with `<think>`, as
Qwen3's thinking-only releases and DeepSeek-R1's templates do; off, it writes an empty thought).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ARCHS = ("llama", "mistral", "qwen2", "qwen3norm", "gpt2", "bloom", "gemma2",  # qwen3norm: Qwen3ForCausalLM
         "gptoss", "stablelm")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD, BOS, EOS = SPECIAL_TOKENS
TINY_VOCAB = 1024
BENCH_VOCAB = 4096
CONTEXT = 1024  # max_position_embeddings (and the tokenizer's model_max_length)
SLIDING_WINDOW = 32  # mistral and gemma2: small enough that a 300-token prompt crosses it many times
SEED = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

THINK_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # ids 1024-1027 in "qwen3"
QWEN3_VOCAB = 1088  # the padded vocabulary of "qwen3" (the tokenizer has 1028 tokens)
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ('user', 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content.split('</think>')[-1].lstrip('\\n') }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' }}"
    "{%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.
Streaming chat sends one piece of text at a time, and the page shows the answer as it grows.
A paged KV cache keeps keys and values in fixed-size blocks; the scheduler batches many requests at once.
Hello, world! How are you today? I am fine, thank you. Please tell me a short story about a robot.
Once upon a time there was a little robot who wanted to learn how to paint the sea at night.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5. Dates: 2025-01-31, 12:30:45.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n
{"prompt": "hi", "stream": true, "max_new_tokens": 16, "temperature": 0.7}
你好，世界！今天天气很好。我们一起去公园散步吧。法国的首都是巴黎。北京是中国的首都。
机器学习模型可以生成文本。请用中文回答这个问题。谢谢你的帮助！
こんにちは、元気ですか。안녕하세요. Привет, как дела? Ça va très bien, merci. Größe, Straße, naïve café.
Emoji: 😀 😂 🎉 🚀 ❤️ 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🌍 🔥 ✨ 🤖 — and symbols: © ® ™ € £ ¥ → ← ≤ ≥ ∞ π Ω.
"""

_SYLLABLES = ("ka", "ri", "to", "me", "sun", "lo", "pa", "ni", "ve", "dor", "shi", "qu", "an", "el", "mor",
              "tis", "ba", "ze", "gu", "fa", "lin", "ro", "hei", "cha", "po", "wu", "xi", "yan", "th", "ing")
_HAN = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴注"
_EMOJI = "😀😃😄😁😆😅😂🤣😊😇🙂🙃😉😌😍🥰😘😗😙😚😋😛😝😜🤪🤨🧐🤓😎🤩🥳😏😒😞😔😟😕🙁😣😖😫😩🥺😢😭😤😠😡🤬🤯😳🥵🥶😱😨😰😥😓🤗🤔🤭🤫🤥😶😐😑😬🙄😯😦😧😮😲🥱😴🤤😪😵🤐🥴🤢🤮🤧😷🤒🤕🤑🤠🎉🚀🔥✨🌍🌙⭐🍕🍣🐍🐱🐶🦊🐼"


def corpus_text(num_lines: int = 400) -> str:
    """The training corpus: CORPUS plus deterministic pseudo-text (made-up words, Chinese, emoji)."""
    rng = random.Random(SEED)
    lines = [CORPUS]
    for _ in range(num_lines):
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(4, 14))]
        han = "".join(rng.choice(_HAN) for _ in range(rng.randint(2, 10)))
        emoji = "".join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 3)))
        lines.append(f"{' '.join(words).capitalize()}, {rng.randint(0, 9999)}. {han}。{emoji}")
    return "\n".join(lines)


def build_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = corpus_text(400 if vocab_size <= TINY_VOCAB else 6000)
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus gave {tokenizer.get_vocab_size()} tokens, not {vocab_size}: make it larger")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      model_max_length=CONTEXT, clean_up_tokenization_spaces=False)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _config(arch: str, vocab_size: int, ids: dict):
    """A tiny config: hidden 64, 2 layers, 4 heads (2 KV heads where the architecture has them)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, **ids)
    # a wider init than the 0.02 default: logits of a random model are then far from ties, so that
    # greedy decoding gives the same tokens on every correct attention path (fp32 noise ~1e-6)
    init = 0.2
    if arch == "llama":
        return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=init, **common)
    if arch == "mistral":
        return tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
                                sliding_window=SLIDING_WINDOW, initializer_range=init, **common)
    if arch == "qwen2":  # like the released Qwen2 checkpoints: no sliding window
        return tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=CONTEXT, use_sliding_window=False,
                              initializer_range=init, tie_word_embeddings=False, **common)
    if arch == "qwen3norm":  # Qwen3: q/k norms per head, head_dim apart from hidden / heads
        return tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=CONTEXT,
                              use_sliding_window=False, initializer_range=init, **common)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=CONTEXT, initializer_range=init, **common)
    if arch == "bloom":  # ALiBi, no attention interface: the engine's fallback path
        return tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, initializer_range=init, **common)
    if arch == "gemma2":  # alternating sliding/full layers, attention and final logit softcapping
        return tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
                               sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                               initializer_range=init, **common)
    if arch == "gptoss":  # attention sinks, mixture of experts, sliding and full layers in turn
        return tf.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
                               max_position_embeddings=CONTEXT,  # YaRN's factor: 1024 positions over 32
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                                    beta_slow=1.0, truncate=False,
                                                    original_max_position_embeddings=CONTEXT // 32), initializer_range=init, **common)
    if arch == "stablelm":  # its decoder layers pass no keyword arguments to their attention: the fallback path
        return tf.StableLmConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=init,
                                 **common)
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}. Given: {arch!r}")


def _save_model(config, tokenizer, out_dir: Path, seed: int, dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):  # fixed weights, and the caller's RNG state untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)  # a Hub checkpoint's bfloat16 / float16, or float32
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _special_ids(tokenizer) -> dict:
    return dict(bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
                pad_token_id=tokenizer.convert_tokens_to_ids(PAD))


def build_tiny_model(arch: str, out_dir: str | Path, tokenizer=None, seed: int = SEED, dtype: str = "float32") -> Path:
    """Write a tiny random-weight `arch` model (safetensors in `dtype`: float32, bfloat16 or float16,
    the float32 weights rounded) with its tokenizer into `out_dir`."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(TINY_VOCAB)
    config = _config(arch, len(tokenizer), _special_ids(tokenizer))
    return _save_model(config, tokenizer, Path(out_dir), seed, dtype)


def build_tiny_qwen3(out_dir: str | Path, seed: int = SEED) -> Path:
    """The thinking, tool-calling "qwen3" (see the module docstring): a Qwen2 model, padded vocabulary."""
    tokenizer = build_tokenizer(TINY_VOCAB)
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    config = _config("qwen2", QWEN3_VOCAB, _special_ids(tokenizer))
    return _save_model(config, tokenizer, Path(out_dir), seed)


def bench_llama(out_dir: str | Path, seed: int = SEED) -> Path:
    """The benchmark model: random-weight Llama, hidden 512, 8 layers, 8 heads / 4 KV heads,
    intermediate 2048, vocab 4096 (a tokenizer of 4096 tokens trained like the tiny one), fp32."""
    import transformers as tf

    tokenizer = build_tokenizer(BENCH_VOCAB)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                            **_special_ids(tokenizer))
    tokenizer.model_max_length = 4096
    return _save_model(config, tokenizer, Path(out_dir), seed)


try:
    import pytest
except ImportError:  # the builders above work without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def tiny_model(tmp_path_factory):
        """Factory: `tiny_model("llama") -> Path` (`dtype="bfloat16"`: its weights saved in bfloat16,
        as a Hub checkpoint holds them), each built once per test run."""
        root = tmp_path_factory.mktemp("tiny_models")
        built: dict[str, Path] = {}
        shared = {}

        def make(arch: str = "llama", dtype: str = "float32") -> Path:
            if dtype != "float32":
                key = f"{arch}-{dtype}"
                if key not in built:
                    if "tokenizer" not in shared:
                        shared["tokenizer"] = build_tokenizer(TINY_VOCAB)
                    built[key] = build_tiny_model(arch, root / key, tokenizer=shared["tokenizer"], dtype=dtype)
                return built[key]
            if arch == "qwen3":
                if arch not in built:
                    built[arch] = build_tiny_qwen3(root / arch)
                return built[arch]
            if arch not in ARCHS:
                raise ValueError(f"arch must be one of {', '.join(ARCHS)}, or qwen3. Given: {arch!r}")
            if arch not in built:
                if "tokenizer" not in shared:
                    shared["tokenizer"] = build_tokenizer(TINY_VOCAB)
                built[arch] = build_tiny_model(arch, root / arch, tokenizer=shared["tokenizer"])
            return built[arch]

        return make


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tiny_models",
                                     description="Build a tiny random-weight model folder (no network).")
    parser.add_argument("arch", choices=(*ARCHS, "qwen3", "bench"),
                        help="architecture; 'qwen3' the thinking, tool-calling Qwen2; 'bench' the benchmark Llama")
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    if args.arch == "bench":
        path = bench_llama(args.out_dir, args.seed)
    elif args.arch == "qwen3":
        path = build_tiny_qwen3(args.out_dir, args.seed)
    else:
        path = build_tiny_model(args.arch, args.out_dir, seed=args.seed)
    config = json.loads((path / "config.json").read_text())
    print(f"{path} ({config['model_type']}, vocab {config['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
