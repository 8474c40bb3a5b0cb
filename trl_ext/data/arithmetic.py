"""Seeded generator of arithmetic questions with verifiable integer answers, with disjoint train/test splits.

The default task is two-digit addition asked plainly ("What is 23 + 45?"); operations ``+ - *``, operand digit
counts and a word-problem phrasing are options. Grade with ``trl_ext.rewards.arithmetic_reward`` (last number in
the completion, compared numerically with the ``answer`` column).

Split rule (:mod:`trl_ext.data.splits`) on the canonical problem ``"a op b"``, the operands of ``+`` and ``*`` sorted:
"23 + 45" and "45 + 23" land in the same split, whatever the seed, ``n`` or the phrasing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from datasets import Dataset

from trl_ext.data.prompts import format_prompt
from trl_ext.data.splits import check_split_request, draw_distinct, in_test_split

OPERATIONS = ("+", "-", "*")
"""Supported operations."""

PHRASINGS = ("plain", "word")
"""``"plain"``: "What is 23 + 45?"; ``"word"``: a one-sentence story with the same numbers."""

_NAMES = ("Ann", "Ben", "Carla", "Dev", "Emma", "Femi", "Gita", "Hugo")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cards")
_WORD_TEMPLATES = {
    "+": "{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?",
    "-": "{name} has {a} {items} and gives {b} of them away. How many {items} does {name} have left?",
    "*": "{name} fills {a} bags with {b} {items} each. How many {items} are in the bags altogether?",
}


def canonical_problem(a: int, op: str, b: int) -> str:
    """``"a op b"``, operands sorted for the commutative ``+`` and ``*`` (``canonical_problem(45, "+", 23)`` is
    ``"23 + 45"``)."""
    if op in ("+", "*") and a > b:
        a, b = b, a
    return f"{a} {op} {b}"


def is_test_problem(a: int, op: str, b: int, test_fraction: float = 0.2) -> bool:
    """True when the problem ``a op b`` belongs to the test split (see the module docstring for the rule)."""
    return in_test_split(canonical_problem(a, op, b), test_fraction)


def _operand_range(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _question_and_answer(a: int, op: str, b: int, phrasing: str, rng: random.Random) -> tuple[str, str]:
    """The question in ``phrasing`` (a word problem draws its name and items from ``rng``) and its integer answer."""
    if phrasing == "plain":
        question = f"What is {a} {op} {b}?"
    else:
        question = _WORD_TEMPLATES[op].format(name=rng.choice(_NAMES), items=rng.choice(_ITEMS), a=a, b=b)
    return question, str(a + b if op == "+" else a - b if op == "-" else a * b)


def make_arithmetic_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    *,
    operations: Sequence[str] = ("+",),
    digits: int | tuple[int, int] = 2,
    phrasing: str = "plain",
    allow_negative: bool = False,
    test_fraction: float = 0.2,
    template: str = "chat",
    tokenizer: Any | None = None,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> Dataset:
    """Generate ``n`` distinct arithmetic questions of one split, reproducibly from ``seed``.

    Operation uniform over ``operations``, operands uniform over their digit range (1 digit: 0-9; d >= 2: 10**(d-1) ..
    10**d - 1); ``-`` swaps operands unless ``allow_negative``. Draws outside the split or repeating an earlier question
    are rejected.

    Args:
        n: number of questions (>= 1).
        seed: random seed.
        split: ``"train"`` or ``"test"``; disjoint for the same ``test_fraction``.
        operations: subset of ``("+", "-", "*")``; default addition only.
        digits: digits of both operands, or a pair (a, b); each 1..9.
        phrasing: ``"plain"`` ("What is 23 + 45?") or ``"word"`` (a short story problem).
        allow_negative: allow ``a - b < 0`` (not with ``phrasing="word"``).
        test_fraction: share of the problem space reserved for the test split, in (0, 1).
        template, tokenizer, system_prompt, instruction: for :func:`trl_ext.data.prompts.format_prompt` (default
            ``"chat"``).

    Returns:
        A ``datasets.Dataset`` with ``prompt``, ``answer`` (e.g. ``"68"``) and ``question``.

    Raises:
        ValueError: an argument out of range (named), or fewer than ``n`` distinct questions in 100 * n + 10_000
            draws."""
    check_split_request(n, split, test_fraction)
    if not operations or any(op not in OPERATIONS for op in operations):
        raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {operations!r}")
    digit_pair = (digits, digits) if isinstance(digits, int) else tuple(digits)
    if len(digit_pair) != 2 or any(not isinstance(d, int) or not 1 <= d <= 9 for d in digit_pair):
        raise ValueError(f"digits must be an int in 1..9 or a pair of them, got {digits!r}")
    if phrasing not in PHRASINGS:
        raise ValueError(f"phrasing must be one of {PHRASINGS}, got {phrasing!r}")
    if allow_negative and phrasing == "word" and "-" in operations:
        raise ValueError("allow_negative=True with phrasing='word' would ask to give away more than one has")

    rng = random.Random(f"trl_ext.arithmetic:{seed}:{split}")  # str seeds are hashed with SHA-512: stable
    range_a, range_b = _operand_range(digit_pair[0]), _operand_range(digit_pair[1])

    def draw() -> tuple[str, bool, tuple[int, str, int]]:
        op = rng.choice(list(operations))
        a, b = rng.randint(*range_a), rng.randint(*range_b)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        return f"{a} {op} {b}", is_test_problem(a, op, b, test_fraction), (a, op, b)

    drawn = draw_distinct(n, split, draw, lambda problem: _question_and_answer(*problem, phrasing, rng))
    if len(drawn) < n:
        raise ValueError(
            f"could draw only {len(drawn)} distinct {split} problems of the {n} asked (operations={operations!r}, "
            f"digits={digits!r}, test_fraction={test_fraction}); lower n or widen the problem space"
        )
    questions = [q for q, _ in drawn]
    prompts = [
        format_prompt(q, template, tokenizer, system_prompt=system_prompt, instruction=instruction) for q in questions
    ]
    return Dataset.from_dict({"prompt": prompts, "answer": [a for _, a in drawn], "question": questions})
