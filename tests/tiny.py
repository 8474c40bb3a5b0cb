"""A tiny randomly initialised Llama for fast tests (``tiny_model_for_tests``): a test helper, so it lives here, not
in the library. ``tests/architectures.py`` builds tiny models of every other architecture."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def tiny_model_for_tests(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
) -> LlamaForCausalLM:
    """A small randomly initialised `LlamaForCausalLM` that speaks `tokenizer`'s vocabulary, for fast tests.

    Vocabulary size is `len(tokenizer)` (added tokens included); `bos/eos/pad_token_id` come from the tokenizer and
    are set on both the config and the generation config. Embeddings are tied, dtype float32, CPU. The same `seed`
    gives the same weights; the global torch RNG is left untouched. With the defaults and the SmolLM2 tokenizer it
    has about 3.2 M parameters (3.1 M of them the 49152 x 64 embedding).

    Args:
        tokenizer: the tokenizer whose ids the model must accept (e.g. `load_tokenizer()`).
        seed: weight-initialisation seed.
        hidden_size: model width; must be divisible by `num_heads`.
        num_layers: number of decoder layers.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention); default `num_heads`. Must divide `num_heads`.
        intermediate_size: MLP width; default `2 * hidden_size`.
        max_position_embeddings: longest sequence the rotary embedding is set up for.

    Raises:
        ValueError: the sizes are not positive or do not divide as stated.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    intermediate_size = 2 * hidden_size if intermediate_size is None else intermediate_size
    sizes = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        **special,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(**special)
    return model
