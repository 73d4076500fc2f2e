"""Random-weight causal LMs of named shapes: real transformers models that need no download.

Tests and benchmarks need a model whose compute is real (same layers, same attention, same cache
traffic as a trained one) but that loads offline in milliseconds. Weights are drawn with a std large
enough that the next-token distribution is sharp and varied, so greedy outputs change from token to
token instead of collapsing into one repeated id; that is what makes token-for-token parity tests bite.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# Shapes, by name. "tiny" is the benchmark model; "qwen2.5-0.5b" copies Qwen2.5-0.5B's dimensions.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=2048,
    ),
    "25m": dict(  # about 25M parameters
        hidden_size=512,
        intermediate_size=1344,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": dict(  # about 494M parameters
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
}

# Weight std: transformers' default (0.02) gives near-uniform logits on a random model, and greedy
# decoding then repeats one token; a larger std makes each position's argmax depend on the context.
INIT_STD = 0.25


def random_model(
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A transformers causal LM of family ``arch`` and shape ``size`` with seeded random weights, in eval mode.

    ``config_overrides`` replace fields of the shape (e.g. ``hidden_size=64, num_hidden_layers=2``).
    Token 0 is padding, 1 is BOS and 2 is EOS. The global torch RNG is left untouched.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    fields = {**SIZES[size], **config_overrides}
    rope_theta = fields.pop("rope_theta", 10_000.0)
    config = AutoConfig.for_model(
        arch,
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=INIT_STD,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    if arch == "mistral" and "sliding_window" not in config_overrides:
        config.sliding_window = None  # full attention, like the other families, unless asked for
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model.eval()
