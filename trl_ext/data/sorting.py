"""Seeded generator of "sort these N numbers" prompts (the lecture's toy RL task), with disjoint train/test splits.

Grade with :mod:`trl_ext.rewards.sorting` (``sort_shaped_reward`` for partial credit, ``sort_exact_reward`` for
all-or-nothing); both read the ``answer`` column.

Split rule (as in :mod:`trl_ext.data.arithmetic`): a problem belongs to the test split when
``sha256("sort:" + the sorted numbers)``, read as a fraction of 2**64, is below ``test_fraction``. Every ordering of
the same numbers therefore lands in the same split, whatever the seed, so no train set shares a set of numbers with a
test set drawn with the same ``test_fraction``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from datasets import Dataset

from trl_ext.data.prompts import format_prompt

SORT_INSTRUCTION = "Answer with just the sorted numbers, separated by spaces."
"""Default instruction appended to each sorting question."""


def is_test_numbers(numbers: list[int] | tuple[int, ...], test_fraction: float = 0.2) -> bool:
    """True when this set of numbers belongs to the test split (see the module docstring)."""
    key = "sort:" + " ".join(str(x) for x in sorted(numbers))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < test_fraction


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

    Each question draws ``num_numbers`` distinct integers uniformly from ``low .. high`` (inclusive) in random order:
    ``"Sort these numbers in ascending order: 42 7 19 3"``. Draws outside the requested split, or with the same
    numbers as an earlier question of this dataset, are rejected.

    Args:
        n: number of questions (>= 1).
        seed: random seed.
        split: ``"train"`` or ``"test"``.
        num_numbers: N, numbers per question (>= 2).
        low, high: range of the numbers, ``0 <= low`` and ``high - low + 1 >= num_numbers``.
        test_fraction: share of the problem space reserved for the test split, in (0, 1).
        template, tokenizer, system_prompt, instruction: passed to :func:`trl_ext.data.prompts.format_prompt`
            (default: a chat conversation with :data:`SORT_INSTRUCTION` appended to the question).

    Returns:
        A ``datasets.Dataset`` with columns ``prompt``, ``answer`` (the sorted numbers, space separated, e.g.
        ``"3 7 19 42"``), ``numbers`` (the list in prompt order) and ``question``.

    Raises:
        ValueError: an argument is out of range (the message names it), or fewer than ``n`` distinct questions of the
            split were found in ``100 * n + 10_000`` draws.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if num_numbers < 2:
        raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
    if low < 0 or high - low + 1 < num_numbers:
        raise ValueError(
            f"low={low}, high={high}: expected 0 <= low and at least num_numbers={num_numbers} values in low..high"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")

    rng = random.Random(f"trl_ext.sorting:{seed}:{split}")
    want_test = split == "test"
    seen: set[tuple[int, ...]] = set()
    rows: list[list[int]] = []
    for _ in range(100 * n + 10_000):
        if len(rows) == n:
            break
        numbers = rng.sample(range(low, high + 1), num_numbers)
        key = tuple(sorted(numbers))
        if key in seen or is_test_numbers(numbers, test_fraction) != want_test:
            continue
        seen.add(key)
        rows.append(numbers)
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
