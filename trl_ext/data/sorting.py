"""Seeded generator of "sort these N numbers" prompts (the lecture's toy RL task), with disjoint train/test splits.

Grade with :mod:`trl_ext.rewards.sorting` (``sort_shaped_reward`` for partial credit, ``sort_exact_reward`` for
all-or-nothing); both read the ``answer`` column.

Split rule (:mod:`trl_ext.data.splits`) on ``"sort:" + the sorted numbers``: every ordering of the same numbers
lands in the same split, whatever the seed.
"""

from __future__ import annotations

import random
from typing import Any

from datasets import Dataset

from trl_ext.data.prompts import format_prompt
from trl_ext.data.splits import check_split_request, draw_distinct, in_test_split

SORT_INSTRUCTION = "Answer with just the sorted numbers, separated by spaces."
"""Default instruction appended to each sorting question."""


def is_test_numbers(numbers: list[int] | tuple[int, ...], test_fraction: float = 0.2) -> bool:
    """True when this set of numbers belongs to the test split (see the module docstring)."""
    return in_test_split("sort:" + " ".join(str(x) for x in sorted(numbers)), test_fraction)


def make_sorting_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    *,
    num_numbers: int = 4,
    low: int = 0,
    high: int = 99,
    test_fraction: float = 0.2,
    template: str = "chat",
    tokenizer: Any | None = None,
    system_prompt: str | None = None,
    instruction: str | None = SORT_INSTRUCTION,
) -> Dataset:
    """Generate ``n`` distinct sorting questions of one split, reproducibly from ``seed``.

    ``num_numbers`` distinct integers uniform in ``low .. high`` (inclusive), in random order; draws outside the split
    or repeating an earlier question are rejected.

    Args:
        n: number of questions (>= 1).
        seed: random seed.
        split: ``"train"`` or ``"test"``.
        num_numbers: numbers per question (>= 2).
        low, high: ``0 <= low`` and ``high - low + 1 >= num_numbers``.
        test_fraction: share of the problem space reserved for the test split, in (0, 1).
        template, tokenizer, system_prompt, instruction: for :func:`trl_ext.data.prompts.format_prompt` (default: a chat
            with :data:`SORT_INSTRUCTION` appended).

    Returns:
        A ``datasets.Dataset`` with ``prompt``, ``answer`` (e.g. ``"3 7 19 42"``), ``numbers`` and ``question``.

    Raises:
        ValueError: an argument out of range (named), or fewer than ``n`` distinct questions in 100 * n + 10_000
            draws."""
    check_split_request(n, split, test_fraction)
    if num_numbers < 2:
        raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
    if low < 0 or high - low + 1 < num_numbers:
        raise ValueError(
            f"low={low}, high={high}: expected 0 <= low and at least num_numbers={num_numbers} values in low..high"
        )

    rng = random.Random(f"trl_ext.sorting:{seed}:{split}")

    def draw() -> tuple[tuple[int, ...], bool, list[int]]:
        numbers = rng.sample(range(low, high + 1), num_numbers)
        return tuple(sorted(numbers)), is_test_numbers(numbers, test_fraction), numbers

    rows = draw_distinct(n, split, draw, lambda numbers: numbers)
    if len(rows) < n:
        raise ValueError(
            f"could draw only {len(rows)} distinct {split} questions of the {n} asked (num_numbers={num_numbers}, "
            f"low={low}, high={high}, test_fraction={test_fraction}); lower n or widen the range"
        )
    questions = ["Sort these numbers in ascending order: " + " ".join(map(str, r)) for r in rows]
    prompts = [
        format_prompt(q, template, tokenizer, system_prompt=system_prompt, instruction=instruction) for q in questions
    ]
    return Dataset.from_dict(
        {
            "prompt": prompts,
            "answer": [" ".join(map(str, sorted(r))) for r in rows],
            "numbers": rows,
            "question": questions,
        }
    )
