"""Tests for trl_ext.rewards: answer extraction, grading, course-style reward_fn and TRL-style reward functions.

Expected values are worked out by hand from the rules in the docstrings.
"""

from __future__ import annotations

import math
import threading

import pytest
from math_verify import parse

from trl_ext.rewards import (
    arithmetic_reward,
    as_course_reward_fn,
    as_trl_reward,
    completion_text,
    extract_answer_tag,
    extract_boxed,
    extract_last_number,
    extract_math_answer,
    grade_math_answer,
    gsm8k_reward,
    gsm8k_reward_fn,
    math_reward,
    math_reward_fn,
    numbers_equal,
    parse_gsm8k_ground_truth,
    r1_zero_reward,
    r1_zero_reward_fn,
)

RIGHT = {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
FORMAT_ONLY = {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0}
ZERO = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


# ------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", "1234"),
        ("So we get 42.", "42"),
        ("x = -7", "-7"),
        ("first 3, then 10, finally 12", "12"),
        ("It costs $3.50 in total", "3.50"),
        ("5-3", "3"),  # "-" between digits is subtraction, not a sign
        ("f(2)-4", "4"),
        ("\u22124 degrees", "-4"),  # Unicode minus
        ("$1,234,567.89!", "1234567.89"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("Half of 144 is 144/2 = <<144/2=72>>72\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("... #### -5", "-5"),
        ("#### 3.75.", "3.75"),
        ("a #### 1 b #### 2", "2"),  # the last marker counts
    ],
)
def test_parse_gsm8k_ground_truth(field, expected):
    assert parse_gsm8k_ground_truth(field) == expected


@pytest.mark.parametrize("field", ["the answer is 72", "#### seventy-two", "####"])
def test_parse_gsm8k_ground_truth_rejects(field):
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_ground_truth(field)


def test_numbers_equal():
    assert numbers_equal("3.50", "3.5")
    assert numbers_equal("1,234", "1234.0")
    assert not numbers_equal("72", "27")
    with pytest.raises(ValueError, match="expected two numbers"):
        numbers_equal("72", "seventy-two")


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("24 + 48 = 72, so the answer is 72.", "72", RIGHT),
        ("I think it is 71.", "72", FORMAT_ONLY),
        ("I don't know.", "72", ZERO),
        ("That is $3.50", "3.5", RIGHT),  # numeric, not string, equality
        ("Total: 1,234 residents", "1234", RIGHT),
        ("72 is the answer", "Some text\n#### 72", RIGHT),  # raw GSM8K field accepted too
        ("3 + 4 = 7 and then 12", "7", FORMAT_ONLY),  # only the LAST number counts
    ],
)
def test_gsm8k_reward_fn(response, truth, expected):
    assert gsm8k_reward_fn(response, truth) == expected


def test_gsm8k_reward_fn_rejects_non_numeric_ground_truth():
    with pytest.raises(ValueError, match="ground_truth must be a number"):
        gsm8k_reward_fn("72", "seventy-two")


# ----------------------------------------------------------------------------------------------- MATH
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"first \boxed{3}, then \boxed{x^{2}+1}", "x^{2}+1"),  # the last box
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        (r"\boxed{3", None),  # unclosed (truncated generation)
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_tag_and_math_answer():
    assert extract_answer_tag("<answer> 5 </answer>") == "5"
    assert extract_answer_tag("<answer>1</answer> then <answer>2</answer> junk") == "2"
    assert extract_answer_tag("<answer>5") is None
    assert extract_answer_tag("<answer>  </answer>") is None
    # tags win over boxes outside them; a box inside the tags is unwrapped
    assert extract_math_answer(r"\boxed{3} <answer>4</answer>") == "4"
    assert extract_math_answer(r"<answer>so \boxed{\frac{1}{2}}</answer>") == r"\frac{1}{2}"
    assert extract_math_answer(r"the result is \boxed{9}") == "9"
    assert extract_math_answer("the result is 9") is None


@pytest.mark.parametrize(
    ("answer", "truth", "expected"),
    [
        (r"\frac{1}{2}", "0.5", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"\sqrt{4}", "2", True),
        (r"\dfrac{3}{4}", "0.75", True),
        (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
        ("x+1", "1+x", True),
        ("3", "4", False),
        (r"\frac{1}{3}", "0.5", False),
        ("3.50", "3.5", True),
        ("", "3", False),
        ("banana", "3", False),
    ],
)
def test_grade_math_answer(answer, truth, expected):
    assert grade_math_answer(answer, truth) is expected


def test_grade_math_answer_works_outside_the_main_thread():
    # The premise: math-verify's default signal-based timeout fails in a worker thread ...
    errors: list[Exception] = []

    def default_timeout():
        try:
            parse("$1/2$", parsing_timeout=5, raise_on_error=True)
        except ValueError as err:
            errors.append(err)

    worker = threading.Thread(target=default_timeout)
    worker.start()
    worker.join()
    assert errors and "thread" in str(errors[0])
    # ... and grade_math_answer turns the timeout off there, so it grades normally.
    results: list[bool] = []
    worker = threading.Thread(
        target=lambda: results.extend([grade_math_answer(r"\sqrt{4}", "2"), grade_math_answer("3", r"\frac{8}{2}")])
    )
    worker.start()
    worker.join()
    assert results == [True, False]


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (r"Divide by 2: $\boxed{\frac{1}{2}}$.", "0.5", RIGHT),
        (r"The answer is $\boxed{\frac{1}{3}}$.", r"\frac{1}{2}", FORMAT_ONLY),
        (r"The answer is 1/2.", r"\frac{1}{2}", ZERO),  # no marked answer
        (r"<answer>\sqrt{4}</answer>", "2", RIGHT),
    ],
)
def test_math_reward_fn(response, truth, expected):
    assert math_reward_fn(response, truth) == expected


# -------------------------------------------------------------------------------------------- R1-Zero
@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("24 + 48 = 72 </think> <answer>72</answer>", "72", RIGHT),  # well formed, right
        ("24 + 48 = 71 </think> <answer>71</answer>", "72", FORMAT_ONLY),  # well formed, wrong
        ("24 + 48 = 72 <answer>72</answer>", "72", ZERO),  # malformed (no "</think> "), right answer
        ("24 + 48 = 72 </think>\n<answer>72</answer>", "72", ZERO),  # malformed: newline instead of one space
        ("24 + 48 = 72 </think> <answer>72", "72", ZERO),  # malformed: never closed
        (r"half </think> <answer>\frac{1}{2}</answer>", "0.5", RIGHT),  # math-verify equivalence
        (r"half </think> <answer>so \boxed{\frac{1}{2}}</answer>", "0.5", RIGHT),  # box inside the tags
        (r"half </think> <answer>\boxed{\frac{1}{2}</answer>", "0.5", FORMAT_ONLY),  # unclosed box
        ("x </think> <answer>72</answer>\nUser: more text 5", "72", RIGHT),  # text after </answer> ignored
        ("x </think> <answer></answer>", "72", FORMAT_ONLY),
    ],
)
def test_r1_zero_reward_fn(response, truth, expected):
    assert r1_zero_reward_fn(response, truth) == expected


# ------------------------------------------------------------------------------------ TRL-style wrappers
def test_trl_reward_functions_take_strings_and_messages_and_log():
    logged: list[tuple[str, float]] = []
    completions = [
        "a </think> <answer>72</answer>",  # right
        [{"role": "assistant", "content": "a </think> <answer>70</answer>"}],  # wrong, conversational
        "no format 72",  # malformed
        [
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "b </think> "}, {"type": "text", "text": "<answer>5</answer>"}],
            }
        ],
    ]
    rewards = r1_zero_reward(
        prompts=["p"] * 4,
        completions=completions,
        completion_ids=None,
        answer=["72", "72", "72", "5"],
        question=["q"] * 4,
        trainer_state=None,
        log_extra=None,
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    assert dict(logged) == {"rewards/r1_zero_reward/format_reward": 0.75, "rewards/r1_zero_reward/answer_reward": 0.5}


def test_trl_reward_names_and_values():
    assert [f.__name__ for f in (r1_zero_reward, gsm8k_reward, math_reward, arithmetic_reward)] == [
        "r1_zero_reward",
        "gsm8k_reward",
        "math_reward",
        "arithmetic_reward",
    ]
    assert gsm8k_reward(["p", "p"], ["so 1,234.", "so 12"], answer=["1234", "13"]) == [1.0, 0.0]
    assert arithmetic_reward(["p"], ["23 + 45 = 68"], answer=["68"]) == [1.0]
    assert math_reward(["p"], [r"\boxed{\frac{2}{4}}"], answer=["0.5"]) == [1.0]


def test_trl_reward_errors_name_the_row_and_field():
    with pytest.raises(ValueError, match=r"no ground-truth column 'answer' among the dataset columns \['solution'\]"):
        gsm8k_reward(["p"], ["72"], solution=["72"], trainer_state=None)
    with pytest.raises(ValueError, match=r"row 1 \(0-based\): field 'answer' is missing or empty"):
        gsm8k_reward(["p", "p"], ["72", "72"], answer=["72", None])
    with pytest.raises(ValueError, match="has 1 entries but there are 2 completions"):
        gsm8k_reward(["p", "p"], ["72", "72"], answer=["72"])
    with pytest.raises(ValueError, match="completion 0"):
        gsm8k_reward(["p"], [42], answer=["72"])


def test_as_trl_reward_key_and_column():
    fmt = as_trl_reward(gsm8k_reward_fn, key="format_reward", answer_column="target", name="number_found")
    assert fmt.__name__ == "number_found"
    assert fmt(["p", "p"], ["it is 3", "no idea"], target=["4", "4"]) == [1.0, 0.0]
    assert as_trl_reward(math_reward_fn).__name__ == "math_reward"
    with pytest.raises(ValueError, match="key must be one of"):
        as_trl_reward(gsm8k_reward_fn, key="total")


def test_as_course_reward_fn_round_trip():
    course = as_course_reward_fn(gsm8k_reward)
    out = course("the answer is 72", "72")
    assert out["reward"] == 1.0 and out["answer_reward"] == 1.0 and math.isnan(out["format_reward"])
    with_format = as_course_reward_fn(
        gsm8k_reward, format_reward_func=as_trl_reward(gsm8k_reward_fn, key="format_reward")
    )
    assert with_format("the answer is 71", "72") == FORMAT_ONLY
    assert with_format("no idea", "72") == ZERO


def test_as_course_reward_fn_wraps_a_trl_library_reward():
    from trl.rewards import accuracy_reward  # conversational completions, ground truth in "solution"

    course = as_course_reward_fn(accuracy_reward, answer_column="solution", conversational=True)
    assert course.__name__ == "accuracy_reward_fn"
    assert course(r"so \boxed{\frac{1}{3}}", r"\frac{1}{3}")["reward"] == 1.0
    assert course(r"so \boxed{\frac{1}{2}}", r"\frac{1}{3}")["reward"] == 0.0
    # accuracy_reward returns None when the gold answer does not parse: that is an error here
    with pytest.raises(ValueError, match="expected one float"):
        course(r"\boxed{1}", "")


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "abc"}]) == "abc"
    assert (
        completion_text([{"role": "assistant", "content": "tool?"}, {"role": "assistant", "content": "final"}])
        == "final"
    )
    with pytest.raises(ValueError, match="completion 3"):
        completion_text([], row=3)
    with pytest.raises(ValueError, match="no string 'content'"):
        completion_text([{"role": "assistant"}])
