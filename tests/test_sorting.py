"""The lecture's sorting task: shaped and all-or-nothing rewards (hand-worked values) and the prompt generator."""

from __future__ import annotations

import pytest

from trl_ext.data.sorting import SORT_INSTRUCTION, is_test_numbers, make_sorting_dataset
from trl_ext.rewards import (
    parse_number_list,
    sort_exact_match,
    sort_exact_reward,
    sort_exact_reward_fn,
    sort_inclusion_ordering_reward,
    sort_shaped_reward,
    sort_shaped_reward_fn,
)


# ------------------------------------------------------------------------------------------------------ rewards
@pytest.mark.parametrize(
    "response, expected",
    [
        ([0, 1, 2, 3], 7.0),  # lecture: 4 included + 3 ordered pairs
        ([7, 2, 2, 5], 3.0),  # lecture: only 2 included; 2<=2 and 2<=5 ordered
        ([0, 3, 1, 2], 6.0),  # lecture: 4 included; 0<=3 and 1<=2 ordered, 3<=1 not
        ([3, 2, 1, 0], 4.0),  # all included, every pair descending
        ([3, 3, 3, 3], 4.0),  # 3 included once (prompt counts), 3 ordered pairs (3<=3)
        ([9, 8, 7, 6], 0.0),
    ],
)
def test_inclusion_ordering_reward_hand_worked(response, expected):
    assert sort_inclusion_ordering_reward([3, 1, 0, 2], response) == expected


def test_exact_match():
    assert sort_exact_match([3, 1, 0, 2], [0, 1, 2, 3]) == 1.0
    assert sort_exact_match([3, 1, 0, 2], [0, 1, 2, 3, 4]) == 0.0  # an extra number is wrong
    assert sort_exact_match([3, 1, 0, 2], [0, 1, 3, 2]) == 0.0
    assert sort_exact_match([3, 1, 0, 2], []) == 0.0


def test_list_rewards_reject_bad_input():
    with pytest.raises(ValueError, match="prompt must hold at least one number"):
        sort_inclusion_ordering_reward([], [])
    with pytest.raises(ValueError, match="response has 2 numbers, prompt 4; expected the same count"):
        sort_inclusion_ordering_reward([3, 1, 0, 2], [0, 1])
    with pytest.raises(ValueError, match="response must be a sequence of ints"):
        sort_exact_match([1, 2], "1 2")
    with pytest.raises(ValueError, match="prompt must be a sequence of ints"):
        sort_inclusion_ordering_reward([1.0, 2.0], [1, 2])


def test_parse_number_list():
    assert parse_number_list("Sorted: 3, 7 and 19.") == [3, 7, 19]
    assert parse_number_list("no numbers here") == []
    assert parse_number_list("007 12") == [7, 12]


@pytest.mark.parametrize(
    "response, shaped, fmt, exact",
    [
        ("3 7 19 42", 7.0, 1.0, 1.0),
        ("3, 7, 19, 42.", 7.0, 1.0, 1.0),
        # prompt order kept: 4 included; 42<=7 no, 7<=19 yes, 19<=3 no -> 4 + 1
        ("The numbers are 42, 7, 19, 3", 5.0, 1.0, 0.0),
        ("19 3 7 42", 6.0, 1.0, 0.0),  # 4 included; 19<=3 no, 3<=7 and 7<=42 yes
        ("7 3", 0.0, 0.0, 0.0),  # only 2 of 4 numbers: no shaped reward
        ("3 7 19 42 50", 0.0, 0.0, 0.0),  # an extra number: no shaped reward (else extras would be free)
        ("I cannot sort", 0.0, 0.0, 0.0),
    ],
)
def test_course_style_sort_rewards(response, shaped, fmt, exact):
    assert sort_shaped_reward_fn(response, "3 7 19 42") == {
        "reward": shaped,
        "format_reward": fmt,
        "answer_reward": exact,
    }
    assert sort_exact_reward_fn(response, "3 7 19 42") == {
        "reward": exact,
        "format_reward": fmt,
        "answer_reward": exact,
    }


def test_course_style_rewards_reject_bad_ground_truth():
    with pytest.raises(ValueError, match="ground_truth must be non-negative integers separated by spaces"):
        sort_shaped_reward_fn("1 2", "1,2")
    with pytest.raises(ValueError, match="ground_truth"):
        sort_exact_reward_fn("1 2", "")


def test_trl_style_sort_rewards_read_the_answer_column():
    completions = [[{"role": "assistant", "content": "3 7 19 42"}], [{"role": "assistant", "content": "42 19 7 3"}]]
    answers = ["3 7 19 42", "3 7 19 42"]
    logged = {}
    shaped = sort_shaped_reward(
        prompts=[[], []], completions=completions, answer=answers, log_metric=logged.__setitem__
    )
    assert shaped == [7.0, 4.0]  # reversed: 4 included, no ordered pair
    assert logged == {"rewards/sort_shaped_reward/format_reward": 1.0, "rewards/sort_shaped_reward/answer_reward": 0.5}
    assert sort_exact_reward(prompts=[[], []], completions=completions, answer=answers) == [1.0, 0.0]
    assert sort_shaped_reward.__name__ == "sort_shaped_reward" and sort_exact_reward.__name__ == "sort_exact_reward"


# --------------------------------------------------------------------------------------------------------- data
def test_make_sorting_dataset_rows():
    ds = make_sorting_dataset(30, seed=3, num_numbers=4, low=10, high=60)
    assert ds.column_names == ["prompt", "answer", "numbers", "question"]
    assert len(ds) == 30
    for row in ds:
        numbers = row["numbers"]
        assert len(numbers) == 4 and len(set(numbers)) == 4
        assert all(10 <= x <= 60 for x in numbers)
        assert row["answer"] == " ".join(map(str, sorted(numbers)))
        assert row["question"] == "Sort these numbers in ascending order: " + " ".join(map(str, numbers))
        assert row["prompt"] == [{"role": "user", "content": row["question"] + "\n" + SORT_INSTRUCTION}]
        assert not is_test_numbers(numbers)
        # the generator's answer is exactly what the rewards call correct
        assert sort_shaped_reward_fn(row["answer"], row["answer"])["reward"] == 7.0
    assert len({tuple(sorted(r)) for r in ds["numbers"]}) == 30  # distinct sets of numbers


def test_make_sorting_dataset_is_seeded_and_splits_are_disjoint():
    a = make_sorting_dataset(50, seed=0, num_numbers=3, high=30)
    assert a["numbers"] == make_sorting_dataset(50, seed=0, num_numbers=3, high=30)["numbers"]
    assert a["numbers"] != make_sorting_dataset(50, seed=1, num_numbers=3, high=30)["numbers"]
    test = make_sorting_dataset(50, seed=0, split="test", num_numbers=3, high=30)
    train_sets = {tuple(sorted(r)) for r in a["numbers"]}
    test_sets = {tuple(sorted(r)) for r in test["numbers"]}
    assert not train_sets & test_sets
    assert all(is_test_numbers(r) for r in test["numbers"])
    # permutations of the same numbers share a split
    assert is_test_numbers([3, 1, 2]) == is_test_numbers([1, 2, 3]) == is_test_numbers((2, 3, 1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be >= 1"),
        (dict(n=5, split="dev"), "split must be 'train' or 'test'"),
        (dict(n=5, num_numbers=1), "num_numbers must be >= 2"),
        (dict(n=5, low=5, high=6, num_numbers=3), "at least num_numbers=3 values"),
        (dict(n=5, low=-1), "0 <= low"),
        (dict(n=5, test_fraction=1.0), "test_fraction must be in"),
        (dict(n=200, num_numbers=2, low=0, high=9), "could draw only"),  # 45 pairs exist
    ],
)
def test_make_sorting_dataset_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_sorting_dataset(**kwargs)
