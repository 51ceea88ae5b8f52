"""Small, deterministic Hugging Face model directories for tests, demos and benchmarks.

No machine batchd is developed on can download weights, so it builds its own (docs/core.md):
ordinary model directories cached under ``$BATCHD_MODEL_CACHE``, rebuilt only when missing,
the same on every machine.

    python -m core.llms.demo            # build every preset, print the paths
    python -m core.llms.demo llama-25m  # build one"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.settings import get_settings

# ChatML, with tools as Hermes and Qwen2.5 render them: the functions in the system turn,
# each call a ``<tool_call>`` block of JSON, each result a ``<tool_response>`` in a user turn.
# Without tools the text is plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\nCall a function as <tool_call>\n' }}"
    '{{- \'{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\' }}'
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined"
    " and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] | tojson if call['arguments'] is not string else call['arguments'] }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BUILD_VERSION = 2  # bump when the recipe changes, so cached directories are rebuilt


@dataclass(frozen=True)
class Preset:
    arch: str  # "llama", "qwen2", "mistral" or "gemma2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    # A wider init than the usual 0.02 spreads the logits of a random model, so greedy
    # decoding has clear winners and batched and unbatched runs agree token for token.
    initializer_range: float = 0.08
    seed: int = 0
    # Attention features of the model families (None: off). A window small enough, and a cap
    # low enough, that ignoring them changes the text of a prompt longer than the window.
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


PRESETS: dict[str, Preset] = {
    # Fast enough for unit tests on two CPU cores.
    "llama-tiny": Preset("llama", 64, 2, 4, 2, 176, max_position_embeddings=1024),
    "qwen2-tiny": Preset("qwen2", 64, 2, 4, 2, 176, max_position_embeddings=1024, seed=1),
    # The benchmark and demo model: ~25M parameters, 8 layers, hidden 512.
    "llama-25m": Preset("llama", 512, 8, 8, 4, 1376, max_position_embeddings=4096),
    "qwen2-25m": Preset("qwen2", 512, 8, 8, 4, 1376, max_position_embeddings=4096, seed=1),
    # Tiny members of model families with attention features of their own (tests):
    # Mistral: a sliding window on every layer.
    "mistral-tiny": Preset(
        "mistral", 64, 2, 4, 2, 176, max_position_embeddings=1024, seed=2, sliding_window=32
    ),
    # Qwen2 with use_sliding_window: layer 0 global, layer 1 windowed (max_window_layers=1).
    "qwen2-swa-tiny": Preset(
        "qwen2", 64, 2, 4, 2, 176, max_position_embeddings=1024, seed=3, sliding_window=32
    ),
    # Gemma-2: local (windowed) and global layers alternate; attention and final logits
    # soft-capped.
    "gemma2-tiny": Preset(
        "gemma2",
        64,
        2,
        4,
        2,
        176,
        max_position_embeddings=1024,
        seed=4,
        sliding_window=32,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=8.0,
    ),
}
FAMILY_MODELS = ("mistral-tiny", "qwen2-swa-tiny", "gemma2-tiny")
DEFAULT_DEMO_MODEL = "llama-25m"

_WORDS = (
    "the a an of to in and or for with on at by from is are was were be been batch request "
    "model token tokens prompt output input job queue worker shard cache block page memory "
    "attention layer head step decode prefill schedule run wait cancel file line error result "
    "hello world please write summary classify translate answer question review text data "
    "night pipeline evaluation label positive negative neutral yes no one two three four five "
    "six seven eight nine ten red green blue cat dog bird tree river mountain city road car "
    "quick brown fox jumps over lazy sun moon star light dark time day week year good bad new "
    "old small large fast slow first last next open close read send user assistant system"
).split()


def cache_root() -> Path:
    """Where built models live (``Settings.model_cache``, shared with ``core.llms.gguf``)."""
    return get_settings().model_cache.expanduser()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 24))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def _build_tokenizer(preset: Preset, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(preset.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_model(preset: Preset, out: Path, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    common = dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        initializer_range=preset.initializer_range,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config = _family_config(preset, common)
    torch.manual_seed(preset.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)


def _family_config(preset: Preset, common: dict) -> object:
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    head_dim = preset.hidden_size // preset.num_heads
    if preset.arch == "llama":
        return LlamaConfig(**common)
    if preset.arch == "qwen2":
        if preset.sliding_window is None:
            return Qwen2Config(**common)
        return Qwen2Config(
            **common,
            use_sliding_window=True,
            sliding_window=preset.sliding_window,
            max_window_layers=preset.num_layers // 2,
        )
    if preset.arch == "mistral":
        return MistralConfig(**common, head_dim=head_dim, sliding_window=preset.sliding_window)
    if preset.arch == "gemma2":
        return Gemma2Config(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=preset.sliding_window,
            attn_logit_softcapping=preset.attn_logit_softcapping,
            final_logit_softcapping=preset.final_logit_softcapping,
        )
    raise ValueError(f"unknown demo architecture {preset.arch!r}")


def build(name: str = DEFAULT_DEMO_MODEL, root: Path | None = None) -> Path:
    """Return the directory of preset ``name``, building it on first use."""
    if name not in PRESETS:
        raise ValueError(f"unknown demo model {name!r}; choose one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    root = Path(root) if root else cache_root()
    target = root / f"{name}-v{BUILD_VERSION}"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build in a temporary directory and rename: concurrent builders never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _build_tokenizer(preset, tmp)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp)
        _build_model(preset, tmp, tok.eos_token_id, tok.pad_token_id)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> None:
    for name in argv or sorted(PRESETS):
        print(build(name))


if __name__ == "__main__":
    main(sys.argv[1:])
