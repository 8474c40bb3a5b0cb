"""The one home of the tests' tiny things: a tiny randomly initialised Llama (``tiny_model_for_tests``, saved with
its tokenizer by ``save_tiny_model``), the trainer settings every tiny CPU run shares (``CPU_QUIET``,
``CPU_TEST_ARGS``, ``GRPO_TINY``, ``GRPO_OFF_POLICY``) and the toy prompts (``count_prompts``). Test helpers, so they
live here, not in the library. ``tests/architectures.py`` builds tiny models of every other architecture."""

from __future__ import annotations

import copy

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
    sizes = {name: value for name, value in locals().items() if name not in ("tokenizer", "seed")}
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
    shape = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers)
    heads = dict(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)
    fixed = dict(vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings, tie_word_embeddings=True)
    config = LlamaConfig(**fixed, **shape, **heads, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(**special)
    return model


def save_tiny_model(tokenizer: PreTrainedTokenizerBase, path, **sizes) -> LlamaForCausalLM:
    """`tiny_model_for_tests(tokenizer, **sizes)` saved with `tokenizer` to `path` (what `from_pretrained`, TRL's
    reference model and the recipes' --model_name_or_path load); returns the model."""
    model = tiny_model_for_tests(tokenizer, **sizes)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def count_prompts(n: int = 4):
    """A `datasets.Dataset` of `n` toy prompts "Count to 3:", "Count to 4:", ..."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"Count to {i + 3}:" for i in range(n)]})


# Trainer settings of every tiny CPU run: float32 on the CPU, no saving, no reporting, seed 0 (CPU_QUIET: and a log
# line each step).
CPU_RUN = dict(report_to="none", bf16=False, use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True)
CPU_QUIET = dict(CPU_RUN, logging_steps=1)
# One CPU step without activation checkpointing (every tiny-model SFT/DPO/Reward trainer test).
CPU_TEST_ARGS = dict(CPU_QUIET, max_steps=1, activation_checkpointing=False)
# GRPO: 2 steps of one prompt's 4 completions of 8 tokens, sampled at temperature 1.5 (tests/test_grpo_trainer.py).
GRPO_TINY = dict(CPU_QUIET, per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
GRPO_TINY.update(max_steps=2, learning_rate=1e-2, temperature=1.5)
# GRPO against upstream off-policy: one generation batch of 8 completions of up to 12 tokens (steps_per_generation 4)
# feeds 2 optimizer steps of 2 accumulated micro-batches of 2; plain SGD, so equal weights mean equal gradients.
GRPO_OFF_POLICY = dict(GRPO_TINY, per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4)
GRPO_OFF_POLICY.update(max_completion_length=12, optim="sgd", learning_rate=0.5)


def tiny_grpo_trainer(model, tokenizer, output_dir, prompts, rewards, trainer_cls=None, config_cls=None, **settings):
    """A GRPO trainer for a tiny CPU run: ``trainer_cls`` (default `trl_ext.GRPOTrainer`) rewarded by ``rewards``, with
    ``config_cls(output_dir=output_dir, **CPU_RUN, **settings)`` (default `trl_ext.GRPOConfig`; ``settings`` win),
    ``prompts`` (a list of strings, or a dataset as is) as the training set and a left-padding copy of ``tokenizer``
    (the caller's stays as it is)."""
    from datasets import Dataset

    import trl_ext

    args = (config_cls or trl_ext.GRPOConfig)(output_dir=str(output_dir), **{**CPU_RUN, **settings})
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    data = Dataset.from_dict({"prompt": prompts}) if isinstance(prompts, list) else prompts
    trainer_cls = trainer_cls or trl_ext.GRPOTrainer
    return trainer_cls(model=model, reward_funcs=rewards, args=args, train_dataset=data, processing_class=tok)
