"""Rewards for the lecture's toy task: sort N numbers (CS336 spring 2025, lecture 17, "policy gradient" toy example).

The prompt lists N distinct non-negative integers; the response should list them in ascending order. Two rewards:

* shaped (``sort_inclusion_ordering_reward``, the lecture's partial-credit reward): one point per prompt number that
  appears in the response, plus one point per adjacent pair of the response in non-decreasing order; a correct
  response scores ``N + (N - 1) = 2N - 1``. Lecture example, prompt ``[3, 1, 0, 2]``: ``[0, 1, 2, 3]`` -> 4 + 3 = 7,
  ``[7, 2, 2, 5]`` -> 1 + 2 = 3, ``[0, 3, 1, 2]`` -> 4 + 2 = 6.
* all-or-nothing (``sort_exact_match``): 1.0 when the response lists exactly ``sorted(prompt)``, else 0.0.

A response's numbers are all non-negative integers written in it (:func:`parse_number_list`), and it must list
exactly N of them to earn any shaped reward (the lecture's model emits exactly N tokens; without the gate a run learned
to append extra numbers for free points). Both rewards are course-style and exported TRL-style
(:func:`trl_ext.rewards.adapters.as_trl_reward`); the ground truth is the ``answer`` column of
:func:`trl_ext.data.sorting.make_sorting_dataset` (the sorted numbers, space separated).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from trl_ext.rewards.adapters import as_trl_reward

_INT_RE = re.compile(r"\d+")


def parse_number_list(text: str) -> list[int]:
    """All non-negative integers written in ``text``, in order (``"3, 7 and 19."`` -> ``[3, 7, 19]``).

    Any non-digit character separates numbers, so ``"-5"`` reads as ``5`` and ``"3.5"`` as ``[3, 5]``: the sorting
    task only uses non-negative integers.
    """
    return [int(m) for m in _INT_RE.findall(text)]


def _check_numbers(name: str, numbers: Sequence[int]) -> None:
    if (
        not isinstance(numbers, Sequence)
        or isinstance(numbers, str)
        or any(not isinstance(x, int) or isinstance(x, bool) for x in numbers)
    ):
        raise ValueError(f"{name} must be a sequence of ints, got {numbers!r}")


def sort_inclusion_ordering_reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    """The lecture's shaped sorting reward: inclusion points + ordering points.

    ``inclusion = #{x in prompt : x in response}``; ``ordering = #{i : response[i] <= response[i + 1]}``. Range
    ``0 .. 2 * len(prompt) - 1``.

    Args:
        prompt: the N numbers to sort (N >= 1).
        response: N numbers, the model's answer.

    Returns:
        The reward as a float, e.g. ``sort_inclusion_ordering_reward([3, 1, 0, 2], [0, 3, 1, 2]) == 6.0``.

    Raises:
        ValueError: ``prompt`` is empty, the lengths differ (the lecture asserts they are equal), or either argument
            is not a sequence of ints.
    """
    _check_numbers("prompt", prompt)
    _check_numbers("response", response)
    if not prompt:
        raise ValueError("prompt must hold at least one number")
    if len(response) != len(prompt):
        raise ValueError(f"response has {len(response)} numbers, prompt {len(prompt)}; expected the same count")
    inclusion = sum(1 for x in prompt if x in response)
    ordering = sum(1 for x, y in itertools.pairwise(response) if x <= y)
    return float(inclusion + ordering)


def sort_exact_match(prompt: Sequence[int], response: Sequence[int]) -> float:
    """All-or-nothing sorting reward: 1.0 when ``list(response) == sorted(prompt)``, else 0.0.

    Raises:
        ValueError: ``prompt`` is empty, or either argument is not a sequence of ints.
    """
    _check_numbers("prompt", prompt)
    _check_numbers("response", response)
    if not prompt:
        raise ValueError("prompt must hold at least one number")
    return float(list(response) == sorted(prompt))


def _ground_truth_numbers(ground_truth: str) -> list[int]:
    truth = ground_truth.split()
    if not truth or any(not t.isdigit() for t in truth):
        raise ValueError(
            f"ground_truth must be non-negative integers separated by spaces (e.g. '3 7 19'), got {ground_truth!r}"
        )
    return [int(t) for t in truth]


def _sort_scores(response: str, ground_truth: str) -> tuple[float, float, float]:
    truth = _ground_truth_numbers(ground_truth)
    numbers = parse_number_list(response)
    well_formed = float(len(numbers) == len(truth))
    # inclusion ignores the order of the prompt, so the sorted ground truth stands in for it
    shaped = sort_inclusion_ordering_reward(truth, numbers) if well_formed else 0.0
    exact = sort_exact_match(truth, numbers)
    return shaped, well_formed, exact


def sort_shaped_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Course-style shaped sorting reward.

    ``format_reward`` = 1.0 when the response holds exactly N numbers; ``reward`` = then
    :func:`sort_inclusion_ordering_reward` of those numbers (1 .. 2N-1), else 0.0; ``answer_reward`` =
    :func:`sort_exact_match` (0 or 1).

    Args:
        response: the model's completion text.
        ground_truth: the numbers in ascending order, space separated (``"3 7 19 42"``, the ``answer`` column).

    Raises:
        ValueError: the ground truth is not a space-separated list of non-negative integers.
    """
    shaped, well_formed, exact = _sort_scores(response, ground_truth)
    return {"reward": shaped, "format_reward": well_formed, "answer_reward": exact}


def sort_exact_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Course-style all-or-nothing sorting reward: like :func:`sort_shaped_reward_fn` with ``reward`` =
    ``answer_reward`` (1.0 only for exactly the sorted numbers).

    Raises:
        ValueError: the ground truth is not a space-separated list of non-negative integers.
    """
    _, well_formed, exact = _sort_scores(response, ground_truth)
    return {"reward": exact, "format_reward": well_formed, "answer_reward": exact}


sort_shaped_reward = as_trl_reward(sort_shaped_reward_fn, name="sort_shaped_reward")
sort_exact_reward = as_trl_reward(sort_exact_reward_fn, name="sort_exact_reward")
