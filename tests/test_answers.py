"""How answers are read (issue 10): LaTeX numbers, MMLU letters, several boxes, and grading bounded in time.

Every expected value is worked out by hand from the rules in the docstrings of trl_ext.rewards and trl_ext.eval.
"""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal

import pytest

from trl_ext.data import load_math_dataset
from trl_ext.eval import parse_gsm8k_response, parse_mmlu_response
from trl_ext.rewards import (
    extract_boxed_answer,
    extract_boxed_parts,
    extract_last_number,
    grade_math_answer,
    gsm8k_reward_fn,
    math_reward_fn,
    normalize_number_text,
    parse_gsm8k_ground_truth,
    r1_zero_reward_fn,
    to_decimal,
    verify_worker,
)


# ---------------------------------------------------------------------------------- 1. numbers the LaTeX way
@pytest.mark.parametrize(
    "text, expected",
    [
        ("costs $12{,}345.", "12345"),  # MATH's braced comma
        ("costs $12,\\!345.", "12345"),  # comma + negative thin space
        ("costs 12\\,345 dollars", "12345"),  # thin space as the separator
        ("1{,}234{,}567 people", "1234567"),  # several groups
        ("1\\,234\\,567", "1234567"),
        ("12,\\,345 and 12{,}\\!345", "12345"),  # comma followed by a LaTeX space
        ("12\\;345 and 3\\:000", "3000"),  # other LaTeX spaces, last number
        ("12~345", "12345"),
        ("0{.}75 of it", "0.75"),  # braced decimal point
        ("the rate is .25", "0.25"),  # no leading zero
        ("it fell by -.5 degrees", "-0.5"),
        ("$-1{,}000$", "-1000"),
        # unchanged: plain commas, sentence-final dot, operators, decimals as written, the CS336 examples
        ("The answer is 1,234.", "1234"),
        ("5-3", "3"),
        ("costs 3.50 dollars", "3.50"),
        ("2\\,5", "5"),  # a thin space before fewer than 3 digits is not a thousands separator
        ("12{,}34", "34"),  # neither is a braced comma before 2 digits
        ("no numbers", None),
    ],
)
def test_latex_numbers_are_read_as_numbers(text, expected):
    assert extract_last_number(text) == expected
    assert parse_gsm8k_response(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3{,}000", Decimal(3000)),
        ("3,\\!000", Decimal(3000)),
        ("3\\,000", Decimal(3000)),
        (".25", Decimal("0.25")),
        ("-.5", Decimal("-0.5")),
        ("1,234", Decimal(1234)),
        ("3\\,00", None),
        ("$5", None),
    ],
)
def test_to_decimal_reads_latex_numbers(text, expected):
    assert to_decimal(text) == expected


def test_latex_numbers_in_rewards():
    assert gsm8k_reward_fn("\\boxed{3,\\!000}", "3000")["reward"] == 1.0
    assert gsm8k_reward_fn("so the total is 12{,}345.", "12345")["reward"] == 1.0
    assert gsm8k_reward_fn("half: .5", "0.5")["reward"] == 1.0
    assert gsm8k_reward_fn("that is .25", "25")["reward"] == 0.0  # .25 is a quarter, not 25
    assert math_reward_fn("\\boxed{3\\,000}", "3000")["reward"] == 1.0
    assert math_reward_fn("\\boxed{12{,}345}", "12345")["reward"] == 1.0
    assert math_reward_fn("\\boxed{3{,}000}", "3\\,000")["reward"] == 1.0  # both sides written the LaTeX way
    assert math_reward_fn("\\boxed{3{,}001}", "3000")["reward"] == 0.0
    assert math_reward_fn("\\boxed{\\$3\\,000}", "3000")["reward"] == 1.0  # math-verify gets "3,000", not 3*000
    assert r1_zero_reward_fn(" </think> <answer>12,\\!345</answer>", "12345")["reward"] == 1.0
    assert parse_gsm8k_ground_truth("... so\n#### 1{,}000") == "1000"
    assert parse_gsm8k_ground_truth("#### .5") == "0.5"
    assert normalize_number_text("x\\,y and 2\\,5") == "x\\,y and 2\\,5"  # nothing to rewrite


# ------------------------------------------------------------------------------------------ 2. MMLU letters
MMLU = {"options": ["Paris", "London", "Rome", "Berlin"]}


@pytest.mark.parametrize(
    "output, expected",
    [
        ("The answer is C. Option B is tempting but wrong.", "C"),  # a statement beats a later mention
        ("Option B is tempting, but the correct option is D.", "D"),
        ("The best choice is A; choice C is close.", "A"),
        ("I first thought the answer is A, but the answer is D", "D"),  # the last statement: a revision
        ("Answer: *D*", "D"),  # markdown emphasis
        ("**Answer:** **B**", "B"),
        ("Answer: _C_", "C"),
        ("Answer: `A`", "A"),
        ("Answer: \\(D\\)", "D"),  # LaTeX inline math
        ("Final answer: $D$", "D"),
        ("Answer: \\[ \\mathbf{C} \\]", "C"),
        ("The answer is $\\boxed{\\text{A}}$", "A"),
        ("The answer is [B].", "B"),
        ("I pick option C.", "C"),  # only a mention, of one letter
        ("Option A or option B?", None),  # mentions of two letters, no statement
        ("Either Paris or London.", None),
        ("I do not know.", None),
        ("The answer is E", None),
        ("The answer is Berlin", "D"),  # no letter, one option's text
    ],
)
def test_mmlu_letters(output, expected):
    assert parse_mmlu_response(MMLU, output) == expected


# ------------------------------------------------------------------------------------- 3. several boxes
@pytest.mark.parametrize(
    "text, parts, others",
    [
        ("The solutions are $\\boxed{2}$ and $\\boxed{4}$.", ["2", "4"], 0),
        ("$\\boxed{1}$, $\\boxed{2}$, and $\\boxed{3}$", ["1", "2", "3"], 0),
        ("\\boxed{x=1} \\text{ or } \\boxed{x=-1}", ["x=1", "x=-1"], 0),
        ("$x = \\boxed{2}$ and $x = \\boxed{4}$", ["2", "4"], 0),  # the unknown named before each box
        ("$x_1 = \\boxed{2}$, $x_2 = \\boxed{4}$", ["2", "4"], 0),
        ("$\\boxed{2}\\quad\\boxed{4}$", ["2", "4"], 0),
        ("First guess $\\boxed{3}$ is wrong; the answer is $\\boxed{4}$.", ["4"], 1),  # retracted: other box
        ("So $x = \\boxed{5}$, and the area is $\\boxed{25}$.", ["25"], 1),  # boxed intermediate result
        ("\\boxed{\\boxed{3}}", ["3"], 0),  # a box around a box
        ("\\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"], 0),
        ("\\boxed{2} and \\boxed{4", [], 0),  # truncated: the last box never closes
        ("no box", [], 0),
    ],
)
def test_extract_boxed_parts(text, parts, others):
    assert extract_boxed_parts(text) == (parts, others)
    assert extract_boxed_answer(text) == (", ".join(parts) if parts else None)


def test_several_boxes_are_graded_as_one_answer():
    truth = extract_boxed_answer("The solutions are $\\boxed{2}$ and $\\boxed{4}$.")
    assert truth == "2, 4"
    right = ["\\boxed{2, 4}", "\\boxed{4, 2}", "$\\boxed{2}$ and $\\boxed{4}$", "\\boxed{\\{2, 4\\}}"]
    wrong = ["\\boxed{4}", "\\boxed{2}", "\\boxed{2, 5}", "\\boxed{2, 4, 6}"]
    assert [math_reward_fn(r, truth)["reward"] for r in right] == [1.0] * len(right)
    assert [math_reward_fn(r, truth)["reward"] for r in wrong] == [0.0] * len(wrong)


def test_math_loader_joins_boxes_and_warns_once_about_ambiguous_rows(tmp_path):
    rows = [
        {"problem": "Roots of x^2-6x+8?", "solution": "They are $\\boxed{2}$ and $\\boxed{4}$."},
        {"problem": "p", "solution": "Guess $\\boxed{3}$ fails; the answer is $\\boxed{4}$."},
        {"problem": "q", "solution": "Side $\\boxed{5}$, so the area is $\\boxed{25}$."},
        {"problem": "r", "solution": "Just $\\boxed{7}$."},
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(
        UserWarning, match=r"2 row\(s\) of 4 have other \\boxed\{\} before the final answer.*row 1"
    ) as record:
        ds = load_math_dataset(path, template="question_only")
    assert len([w for w in record if "boxed" in str(w.message)]) == 1  # once, with the count
    assert ds["answer"] == ["2, 4", "4", "25", "7"]


# ------------------------------------------------------------------------------------ 7. bounded grading
DEGENERATE = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{(10^{10^{10}})!}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{\\binom{10^{10}}{10^{5}}}",
    "\\boxed{(x+1)^{100000}}",
    "\\boxed{\\Gamma(10^{12})}",
    "\\boxed{\\prod_{k=1}^{10^{7}} k}",  # passes the size bound; stopped by the wall-clock limit
]


def _grade_all(responses, out):
    for response in responses:
        start = time.perf_counter()
        out.append((math_reward_fn(response, "3")["reward"], time.perf_counter() - start))


def test_degenerate_answers_are_graded_zero_quickly_in_any_thread(capfd):
    assert math_reward_fn("\\boxed{0.5}", "\\frac{1}{2}")["reward"] == 1.0  # worker started (not timed)
    before = verify_worker.timeouts()
    main: list = []
    _grade_all(DEGENERATE, main)
    other: list = []
    thread = threading.Thread(target=_grade_all, args=(DEGENERATE, other), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "grading hung outside the main thread"
    for results in (main, other):
        assert [reward for reward, _ in results] == [0.0] * len(DEGENERATE)
        slowest = max(seconds for _, seconds in results)
        assert slowest < 2.5, f"a degenerate answer took {slowest:.2f} s (limit about 1 s)"
    assert verify_worker.timeouts() - before >= 2  # the product hit the wall-clock limit in both threads
    # ordinary answers keep their grades after workers were killed, and nothing was printed per call
    assert math_reward_fn("\\boxed{2^{2^{2^{2}}}}", "65536")["reward"] == 1.0  # a small tower is a number
    assert math_reward_fn("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")["reward"] == 1.0
    assert math_reward_fn("\\boxed{10^{100}}", "1" + "0" * 100)["reward"] == 1.0
    assert grade_math_answer("9^{9^{9^{9}}}", "9^{9^{9^{9}}}")  # the same string needs no evaluation
    captured = capfd.readouterr()
    assert "Timeout is disabled" not in captured.out + captured.err


def test_verify_worker_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout=0; expected seconds > 0"):
        verify_worker.verify_in_worker("1", "1", 0)


# ------------------------------------------------------------------- 8. grading from forks, threads and pools
# 40 answers that only math-verify can settle (a fraction against a decimal), verdicts known by hand: k/4 written as
# a decimal is right, (k+1)/4 is wrong; interleaved so that a verdict read by the wrong caller shows.
FORK_CASES = [
    case
    for k in range(1, 21)
    for case in ((f"\\frac{{{k}}}{{4}}", str(k / 4), True), (f"\\frac{{{k}}}{{4}}", str((k + 1) / 4), False))
]


def _grade_cases(shift: int) -> list[bool]:
    """Grade FORK_CASES starting at ``shift`` (so processes grading at once ask different questions); return
    whether each verdict was right, in FORK_CASES order."""
    order = [(i + shift) % len(FORK_CASES) for i in range(len(FORK_CASES))]
    right = {}
    for i in order:
        answer, truth, expected = FORK_CASES[i]
        right[i] = grade_math_answer(answer, truth) == expected
    return [right[i] for i in range(len(FORK_CASES))]


def test_fork_cases_are_graded_by_math_verify():
    from trl_ext.rewards import to_decimal as as_number

    assert sum(expected for _, _, expected in FORK_CASES) == 20
    assert FORK_CASES[6] == ("\\frac{4}{4}", "1.0", True) and FORK_CASES[7] == ("\\frac{4}{4}", "1.25", False)
    assert all(as_number(answer) is None for answer, _, _ in FORK_CASES)  # no shortcut settles them


def test_fork_pool_after_the_parent_graded_gets_right_verdicts_in_children_and_parent():
    import multiprocessing

    assert grade_math_answer("\\frac{1}{2}", "0.5")  # the parent now has a zygote and an idle worker to inherit
    parent_workers = {w.pid for w in verify_worker._idle}
    assert parent_workers
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_grade_cases, [0, 7, 13, 29])
    for shift, right in zip([0, 7, 13, 29], results):
        assert all(right), f"child grading from shift {shift}: {right.count(False)} of 40 verdicts wrong"
    assert all(_grade_cases(3)), "the parent's verdicts went wrong after the children graded"
    assert {w.pid for w in verify_worker._idle} & parent_workers  # the parent kept its own workers


def test_spawned_pool_gets_right_verdicts():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        verdicts = pool.starmap(grade_math_answer, [(a, t) for a, t, _ in FORK_CASES[:10]])
    assert verdicts == [expected for _, _, expected in FORK_CASES[:10]]


def test_thread_pool_gets_right_verdicts():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(_grade_cases, range(0, 40, 5)))
    assert [right.count(False) for right in results] == [0] * 8


def test_a_fork_that_skipped_the_fork_hook_drops_the_inherited_workers(monkeypatch):
    # A fork() from C runs no os.register_at_fork hook; the pid check catches it. Simulated here by making this
    # process look like a child of another: its workers count as inherited and must not be used (nor killed).
    assert grade_math_answer("\\frac{1}{2}", "0.5")
    inherited = list(verify_worker._idle)
    monkeypatch.setattr(verify_worker, "_owner_pid", -1)
    assert all(_grade_cases(0))
    assert not {w.pid for w in verify_worker._idle} & {w.pid for w in inherited}
    assert all(w.sock.fileno() == -1 for w in inherited)  # closed in this process, without a flush or a kill


def test_killed_workers_and_zygote_are_replaced_within_the_time_limit(monkeypatch):
    import os
    import signal

    assert grade_math_answer("\\frac{1}{2}", "0.5")
    # killed while idle: noticed before use
    for worker in list(verify_worker._idle):
        os.kill(worker.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert all(_grade_cases(0))
    # the zygote killed too: a new one is started
    os.kill(verify_worker._zygote.proc.pid, signal.SIGKILL)
    for worker in list(verify_worker._idle):
        os.kill(worker.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert all(_grade_cases(11))
    # killed while grading (simulated: the worker handed out is already dead): the answer goes to a fresh worker
    dead = verify_worker._idle_worker()
    os.kill(dead.pid, signal.SIGKILL)
    time.sleep(0.2)
    handed_out = [dead]
    real_idle_worker = verify_worker._idle_worker
    monkeypatch.setattr(verify_worker, "_idle_worker", lambda: handed_out.pop() if handed_out else real_idle_worker())
    assert verify_worker.verify_in_worker("\\frac{3}{4}", "0.75", 1.0) is True
    assert not handed_out and dead.sock.fileno() == -1
    # and the time limit still holds on a degenerate answer
    start = time.perf_counter()
    assert math_reward_fn("\\boxed{\\prod_{k=1}^{10^{7}} k}", "3")["reward"] == 0.0
    assert time.perf_counter() - start < 2.5


# --------------------------------------------------------------------------------- 9. scientific notation
@pytest.mark.parametrize(
    "text, expected",
    [
        ("The total is 1.5e3.", "1500"),  # 1.5 * 1000
        ("The total is 1.5E3", "1500"),
        ("so $1.5 \\times 10^{3}$", "1500"),
        ("about 2.5 × 10^3 km", "2500"),
        ("2.5x10^3", "2500"),
        ("2.5 X 10^3", "2500"),
        ("$1.5\\cdot 10^{3}$", "1500"),
        ("$1.5 \\, \\times \\, 10^{3}$", "1500"),  # LaTeX spaces around the sign
        ("3*10**4", "30000"),
        ("6.02·10²³ atoms", "602000000000000000000000"),  # superscript exponent: 6.02 * 10^23
        ("2 × 10⁻³", "0.002"),
        ("it is 3e-4", "0.0003"),  # 3 / 10000
        ("it is 4.2E+2", "420"),
        ("x = -2.5e-3", "-0.0025"),
        ("$-1.2 \\times 10^{-2}$", "-0.012"),
        ("5 \\times 10^{-1}", "0.5"),
        ("1,500e3", "1500000"),  # 1500 * 1000
        ("it is 10^3", "1000"),  # a power of ten alone is a number too
        ("$10^{-2}$", "0.01"),
        ("-10^3", "-1000"),
        ("1e500", "1e+500"),  # 501 digits stay in E notation
        # not scientific: the last plain number, as before
        ("the3e5", "5"),  # the mantissa follows a letter
        ("hash 3e5a", "5"),  # a letter follows the exponent
        ("3eggs", "3"),
        ("3e", "3"),
        ("x1.5e3", "3"),
        ("2^10", "10"),  # only powers of ten are evaluated
        ("2 x 10 = 20", "20"),
        ("10^3.5", "3.5"),
        ("3\n* 10^2 boxes", "100"),  # a bullet on the next line is not a multiplication sign
        ("2024-01-05", "05"),
    ],
)
def test_scientific_notation_is_read_as_one_number(text, expected):
    assert extract_last_number(text) == expected
    assert parse_gsm8k_response(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("1.5e3", Decimal(1500)),
        ("1.5 \\times 10^{3}", Decimal(1500)),
        ("2.5 × 10^3", Decimal(2500)),
        ("2.5e-3", Decimal("0.0025")),
        ("10^{3}", Decimal(1000)),
        ("1e500", Decimal(10) ** 500),
        ("1.5e3 apples", None),
        ("3e", None),
        ("2^{10}", None),
    ],
)
def test_to_decimal_reads_scientific_notation(text, value):
    assert to_decimal(text) == value


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("The answer is 1.5e3", "1500", 1.0),
        ("The answer is 2.5 × 10^3", "2500", 1.0),
        ("The answer is 2.5 × 10^3", "3", 0.0),  # the 3 of the exponent is no longer read
        ("The answer is 1.5e3", "3", 0.0),
        ("The answer is 5e-1", "0.5", 1.0),
        ("#### 1.5e3", "1500", 1.0),
    ],
)
def test_gsm8k_reward_grades_scientific_notation(response, truth, reward):
    assert gsm8k_reward_fn(response, truth)["reward"] == reward


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("\\boxed{1.5e3}", "1500", 1.0),
        ("\\boxed{1.5E3}", "1500", 1.0),
        ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
        ("\\boxed{2.5 × 10^3}", "2500", 1.0),
        ("\\boxed{1500}", "1.5 \\times 10^{3}", 1.0),
        ("\\boxed{3 \\cdot 10^{-2}}", "0.03", 1.0),
        ("\\boxed{1.5e3}", "150", 0.0),
        ("\\boxed{1.5e3}", "\\frac{3000}{2}", 1.0),  # math-verify is given 1500, not 1.5 * e * 3
        ("\\boxed{1.5e3}", "4.5e", 0.0),  # ... so it is not 4.5 * e
        ("\\boxed{1e500}", "10^{500}", 1.0),
        ("\\boxed{2e500}", "2 \\cdot 10^{500} + 1", 0.0),
        ("\\boxed{2e500}", "\\frac{4 \\cdot 10^{500}}{2}", 1.0),
    ],
)
def test_math_reward_grades_scientific_notation(response, truth, reward):
    assert math_reward_fn(response, truth)["reward"] == reward
    assert r1_zero_reward_fn(f"x </think> <answer>{response}</answer>", truth)["reward"] == reward


def test_gsm8k_ground_truth_in_scientific_notation_is_written_out():
    assert parse_gsm8k_ground_truth("so 15 * 100 = 1500\n#### 1.5e3") == "1500"
