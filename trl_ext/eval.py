"""Greedy evaluation of a causal LM on a math dataset, graded by a course-style reward function.

``evaluate_math`` generates one greedy completion per prompt with Hugging Face ``generate`` (batched, left-padded,
with a progress bar) and scores it with ``reward_fn(response, ground_truth) -> {"reward", "format_reward",
"answer_reward"}`` (see ``trl_ext.rewards``). Accuracy is the mean ``answer_reward``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm


def render_prompts(tokenizer: Any, prompts: Sequence[str | list[dict[str, str]]]) -> list[str]:
    """Strings stay as they are; conversations are rendered with the chat template and the generation prompt."""
    return [
        p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str | list[dict[str, str]]],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "generating",
    disable_progress: bool = False,
) -> list[str]:
    """Greedy completions for ``prompts`` (plain strings or chat conversations), in order.

    Args:
        model: causal LM (put in eval mode for the call, then restored).
        tokenizer: its tokenizer; must have a pad token.
        prompts: N prompts.
        max_new_tokens: generation budget per completion (>= 1).
        batch_size: prompts per ``generate`` call (>= 1).

    Returns:
        N decoded completions without special tokens.

    Raises:
        ValueError: when ``max_new_tokens`` or ``batch_size`` is < 1.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}; expected both >= 1")
    texts = render_prompts(tokenizer, prompts)
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    outputs: list[str] = []
    try:
        for start in tqdm(range(0, len(texts), batch_size), desc=desc, disable=disable_progress):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            batch = {k: v.to(device) for k, v in batch.items()}
            generated = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            outputs += tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return outputs


def evaluate_math(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Any,
    reward_fn: Callable[[str, str], dict[str, float]],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "evaluating",
    num_examples: int = 3,
) -> dict[str, Any]:
    """Greedy accuracy of ``model`` on ``dataset`` (columns ``prompt`` and ``answer``).

    Returns:
        dict with ``accuracy`` (mean answer_reward), ``format_rate`` (mean format_reward), ``reward`` (mean
        reward), ``n``, ``seconds``, ``examples_per_second``, ``examples`` (the first ``num_examples`` records)
        and ``records`` (every prompt, response, answer and score).

    Raises:
        ValueError: when the dataset lacks a ``prompt`` or ``answer`` column or is empty.
    """
    for column in ("prompt", "answer"):
        if column not in dataset.column_names:
            raise ValueError(f"dataset has columns {dataset.column_names}; expected a '{column}' column")
    if len(dataset) == 0:
        raise ValueError("dataset is empty; expected at least one row to evaluate")
    start = time.perf_counter()
    responses = generate_completions(model, tokenizer, dataset["prompt"], max_new_tokens, batch_size, desc)
    seconds = time.perf_counter() - start
    records = []
    for prompt, response, answer in zip(dataset["prompt"], responses, dataset["answer"]):
        scores = reward_fn(response, answer)
        records.append({"prompt": prompt, "response": response, "answer": answer, **scores})
    n = len(records)
    mean = lambda key: sum(float(r[key]) for r in records) / n  # noqa: E731
    return {
        "accuracy": mean("answer_reward"),
        "format_rate": mean("format_reward"),
        "reward": mean("reward"),
        "n": n,
        "seconds": seconds,
        "examples_per_second": n / seconds,
        "examples": records[:num_examples],
        "records": records,
    }
