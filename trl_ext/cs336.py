"""The CS336 assignment 5 adapters, implemented by trl_ext: run the course's own tests against this library.

Replace the body of the course's ``tests/adapters.py`` (CS336 spring 2025, assignment 5 and its supplement) with

    from trl_ext.cs336 import *  # noqa: F401,F403

and ``uv run pytest`` there runs the course's tests against trl_ext. Each ``run_*`` function keeps the course's name
and arguments and delegates to ``trl_ext.functional``, ``trl_ext.objective`` (whose course helpers are re-exported
here under their own names), ``trl_ext.eval`` or ``trl_ext.data``; only the supplement's packed SFT dataset and
Alpaca template live here (their layout is the course's convention).
"""

from __future__ import annotations

import gzip
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from trl_ext import functional
from trl_ext.data.instructions import iterate_batches
from trl_ext.data.math_datasets import json_line
from trl_ext.errors import decode_text
from trl_ext.eval import parse_gsm8k_response, parse_mmlu_response
from trl_ext.objective import course as C
from trl_ext.objective import losses
from trl_ext.objective.course import (
    compute_gae,
    compute_group_normalized_rewards,
    get_response_log_probs,
    grpo_microbatch_train_step,
    mean_response_entropy,
    per_instance_dpo_loss,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)

__all__ = [
    "ALPACA_TEMPLATE",
    # the course-only helpers of trl_ext.objective.course, under their own names
    "compute_gae",
    "compute_group_normalized_rewards",
    "get_response_log_probs",
    "grpo_microbatch_train_step",
    "mean_response_entropy",
    "per_instance_dpo_loss",
    "sft_microbatch_train_step",
    "tokenize_prompt_and_output",
    # the adapters of the course's tests/adapters.py
    "PackedSFTDataset",
    "get_packed_sft_dataset",
    "run_compute_entropy",
    "run_compute_group_normalized_rewards",
    "run_compute_grpo_clip_loss",
    "run_compute_naive_policy_gradient_loss",
    "run_compute_per_instance_dpo_loss",
    "run_compute_policy_gradient_loss",
    "run_get_response_log_probs",
    "run_grpo_microbatch_train_step",
    "run_iterate_batches",
    "run_masked_mean",
    "run_masked_normalize",
    "run_parse_gsm8k_response",
    "run_parse_mmlu_response",
    "run_sft_microbatch_train_step",
    "run_tokenize_prompt_and_output",
]

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n{response}"
)
"""The Alpaca prompt of the course supplement (instruction tuning and DPO)."""


# ------------------------------------------------------------------------------------------- handout, section 4
def run_tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer: Any
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels``, ``response_mask``, each (B, max_len - 1):
    :func:`trl_ext.objective.course.tokenize_prompt_and_output`."""
    return C.tokenize_prompt_and_output(prompt_strs, output_strs, tokenizer)


def run_compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (B, T) of (B, T, V) logits: :func:`trl_ext.functional.compute_entropy`."""
    return functional.compute_entropy(logits)


def run_get_response_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool
) -> dict[str, torch.Tensor]:
    """``{"log_probs": (B, T), "token_entropy": (B, T) when asked}``:
    :func:`trl_ext.objective.course.get_response_log_probs`."""
    return C.get_response_log_probs(model, input_ids, labels, return_token_entropy)


def run_masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None, normalize_constant: float = 1.0
) -> torch.Tensor:
    """Masked sum along ``dim`` (all when None) / ``normalize_constant``:
    :func:`trl_ext.functional.masked_normalize`."""
    return functional.masked_normalize(tensor, mask, dim, normalize_constant)


def run_sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float | None = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One SFT microbatch backward: :func:`trl_ext.objective.course.sft_microbatch_train_step` (``None`` constant =
    1.0)."""
    constant = 1.0 if normalize_constant is None else normalize_constant
    return C.sft_microbatch_train_step(policy_log_probs, response_mask, gradient_accumulation_steps, constant)


# ------------------------------------------------------------------------------------------- handout, section 7
def run_compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(advantages (N,), raw_rewards (N,), metadata)``:
    :func:`trl_ext.objective.course.compute_group_normalized_rewards`."""
    return C.compute_group_normalized_rewards(
        reward_fn, rollout_responses, repeated_ground_truths, group_size, advantage_eps, normalize_by_std
    )


def run_compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """-A * log p, (B, T): :func:`trl_ext.functional.compute_naive_policy_gradient_loss`."""
    return functional.compute_naive_policy_gradient_loss(raw_rewards_or_advantages, policy_log_probs)


def run_compute_grpo_clip_loss(
    advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(-min(ratio A, clip(ratio) A) (B, T), metadata)``: :func:`trl_ext.functional.compute_grpo_clip_loss`."""
    return functional.compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


def run_compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"],
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch on ``loss_type``: :func:`trl_ext.objective.losses.compute_policy_gradient_loss` (also ``"grpo_no_clip"``
    and any other registered loss)."""
    return losses.compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )


def run_masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over ``mask == 1`` along ``dim`` (all when None): :func:`trl_ext.functional.masked_mean`."""
    return functional.masked_mean(tensor, mask, dim)


def run_grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"],
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One GRPO microbatch backward with masked_mean length normalization (the handout's):
    :func:`trl_ext.objective.course.grpo_microbatch_train_step`."""
    return C.grpo_microbatch_train_step(
        policy_log_probs,
        response_mask,
        gradient_accumulation_steps,
        loss_type,
        raw_rewards,
        advantages,
        old_log_probs,
        cliprange,
    )


# ------------------------------------------------------------------------------------------------- supplement
def _read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = enumerate(decode_text(data, str(path)).split("\n"), start=1)  # UTF-8, BOM dropped
    return [json_line(line, f"{path}:{number}") for number, line in lines if line.strip()]


def _instruction_and_response(row: dict[str, Any], where: str) -> tuple[str, str]:
    for keys in (("prompt", "response"), ("instruction", "output")):
        if all(isinstance(row.get(k), str) for k in keys):
            return row[keys[0]], row[keys[1]]
    raise ValueError(
        f"{where}: expected string fields 'prompt' and 'response' (the supplement's SFT data) or 'instruction' and "
        f"'output'; got keys {sorted(row)}"
    )


class PackedSFTDataset(torch.utils.data.Dataset):
    """Fixed-length chunks of one token stream: item k is ``{"input_ids": stream[kL:(k+1)L], "labels":
    stream[kL+1:(k+1)L+1]}``, two LongTensors of shape (L,) with L = ``seq_length`` (labels are the next tokens)."""

    def __init__(self, stream: list[int], seq_length: int):
        self.seq_length = seq_length
        self._stream = torch.tensor(stream, dtype=torch.long)
        self._len = (len(stream) - 1) // seq_length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._len <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} packed examples")
        start = (index % self._len) * self.seq_length
        return {
            "input_ids": self._stream[start : start + self.seq_length],
            "labels": self._stream[start + 1 : start + self.seq_length + 1],
        }


def get_packed_sft_dataset(
    tokenizer: Any, dataset_path: str | os.PathLike, seq_length: int, shuffle: bool
) -> PackedSFTDataset:
    """The supplement's packed instruction-tuning dataset.

    Each JSONL row (``prompt``/``response`` or ``instruction``/``output``; ``.gz`` allowed) becomes
    :data:`ALPACA_TEMPLATE` filled in, tokenized with the default special tokens, followed by EOS. Documents (file
    order, or ``random.shuffle``d) form one stream cut into non-overlapping chunks of ``seq_length`` (the last partial
    one dropped); every next token is a label (unlike :func:`trl_ext.data.pack_instruction_dataset`).

    Returns:
        a :class:`PackedSFTDataset`; ``len`` = (stream length - 1) // ``seq_length``.

    Raises:
        ValueError: ``seq_length`` < 1, a tokenizer without EOS, a row without the fields (file and line named), or
        too few tokens for one example.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length}; expected a positive integer")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id, the delimiter between packed documents")
    rows = _read_jsonl(dataset_path)
    documents = [
        ALPACA_TEMPLATE.format(instruction=instruction, response=response)
        for i, row in enumerate(rows)
        for instruction, response in [_instruction_and_response(row, f"{dataset_path} row {i}")]
    ]
    if shuffle:
        random.shuffle(documents)
    stream: list[int] = []
    for document in documents:
        stream += tokenizer(document)["input_ids"] + [tokenizer.eos_token_id]
    dataset = PackedSFTDataset(stream, seq_length)
    if len(dataset) == 0:
        raise ValueError(f"{len(stream)} tokens in {dataset_path}; expected at least seq_length + 1 = {seq_length + 1}")
    return dataset


def run_iterate_batches(
    dataset: torch.utils.data.Dataset, batch_size: int, shuffle: bool
) -> torch.utils.data.DataLoader:
    """One epoch of batches of ``dataset`` (dicts of stacked tensors; the last batch may be smaller):
    :func:`trl_ext.data.instructions.iterate_batches`."""
    return iterate_batches(dataset, batch_size, shuffle)


def run_parse_mmlu_response(mmlu_example: dict[str, Any], model_output: str) -> str | None:
    """The option letter the output picks, or None: :func:`trl_ext.eval.parse_mmlu_response`."""
    return parse_mmlu_response(mmlu_example, model_output)


def run_parse_gsm8k_response(model_output: str) -> str | None:
    """The last number of the output, or None: :func:`trl_ext.eval.parse_gsm8k_response`."""
    return parse_gsm8k_response(model_output)


def run_compute_per_instance_dpo_loss(
    lm: torch.nn.Module,
    lm_ref: torch.nn.Module,
    tokenizer: Any,
    beta: float,
    prompt: str,
    response_chosen: str,
    response_rejected: str,
) -> torch.Tensor:
    """DPO loss of one pair with the supplement's Alpaca formatting: the prompt is :data:`ALPACA_TEMPLATE` up to
    ``"### Response:\\n"``, each response follows it and ends with EOS; then
    :func:`trl_ext.objective.course.per_instance_dpo_loss` (0-d tensor, gradients into ``lm``)."""
    rendered = ALPACA_TEMPLATE.format(instruction=prompt, response="")
    return C.per_instance_dpo_loss(lm, lm_ref, tokenizer, beta, rendered, response_chosen, response_rejected)
