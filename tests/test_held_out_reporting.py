"""What an evaluation says about its held-out rows (issue 40): how many questions differ (reasoning-gym held-out rows
are drawn distinct), how much of the accuracy is partial credit, how many responses the length limit cut; each task's
stop strings and truncation rule; the prompt experiment's arms with the course's prompt file."""

import json
from types import SimpleNamespace

import pytest

from trl_ext import report, tasks
from trl_ext.compare.ablations import PROMPT_TEMPLATES, experiment_arms, prompt_arm_name
from trl_ext.data.prompts import R1_ZERO_TEMPLATE, format_prompt, template_stop_strings
from trl_ext.errors import RecipeError
from trl_ext.eval import score_rows

# DeepSeek-AI, "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via Reinforcement Learning" (2025), Table 1,
# typed from the paper (its last line, "User: prompt. Assistant:", is laid out as the course lays it out)
PAPER_TABLE_1 = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


def test_r1_zero_is_the_papers_prompt_in_the_courses_layout():
    assert R1_ZERO_TEMPLATE == PAPER_TABLE_1 + "\nUser: {question}\nAssistant: <think>"
    assert format_prompt("What is 2 + 2?", "r1_zero") == PAPER_TABLE_1 + "\nUser: What is 2 + 2?\nAssistant: <think>"


def test_template_stop_strings():
    course_like = "A conversation ... <answer> answer here </answer>.\nUser: {question}\nAssistant: <think>"
    assert template_stop_strings("r1_zero") == ("</answer>",) == template_stop_strings(course_like)
    assert template_stop_strings("chat") == template_stop_strings("question_only") == ()
    assert template_stop_strings("Q: {question}\nA:") == ()


def test_score_rows_counts_exact_answers_partial_credit_distinct_prompts_and_cut_responses():
    rows = [{"prompt": p, "answer": "x"} for p in ("a", "b", "a", "c")]
    scores = iter([1.0, 0.5, 0.25, 0.0])

    def score(response, row):
        value = next(scores)
        return {"reward": value, "format_reward": 1.0, "answer_reward": value}

    result = score_rows(rows, ["r"] * 4, score, truncated=[False, True, False, False], credit_truncated=False)
    # the cut row's 0.5 becomes 0: mean (1 + 0 + 0.25 + 0) / 4; exact answers 1 of 4; partial credit: the 0.25 only
    assert result["accuracy"] == pytest.approx(1.25 / 4)
    assert result["exact_accuracy"] == 0.25 and result["partial_credit_rows"] == 1
    assert result["distinct_prompts"] == 3 and result["num_truncated"] == 1
    assert [r["truncated"] for r in result["records"]] == [False, True, False, False]
    assert result["records"][1]["format_reward"] == 1.0
    plain = score_rows(rows, ["r"] * 4, lambda r, row: {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0})
    assert plain["num_truncated"] is None and "truncated" not in plain["records"][0]


def test_accuracy_table_shows_exact_answers_and_cut_responses_only_when_there_are_some():
    base = {"format_rate": 1.0, "examples_per_second": 1.0}
    before = {**base, "accuracy": 0.13, "exact_accuracy": 0.01, "n": 100, "distinct_prompts": 63,
              "partial_credit_rows": 24, "num_truncated": 0}  # fmt: skip
    after = {**before, "accuracy": 0.2, "exact_accuracy": 0.05, "num_truncated": 7}
    caption, columns, rows = report.accuracy_table("GRPO on lcm", before, after)
    assert caption == "GRPO on lcm (100 held-out problems, 63 distinct, greedy)"
    assert columns == ("", "accuracy", "exact", "format rate", "cut")
    assert rows == [("before", "13.0%", "1.0%", "100.0%", 0), ("after", "20.0%", "5.0%", "100.0%", 7)]
    whole = {**base, "accuracy": 0.5, "exact_accuracy": 0.5, "n": 2, "distinct_prompts": 2, "partial_credit_rows": 0}
    caption, columns, _ = report.accuracy_table("x", whole, whole)
    assert caption == "x (2 held-out problems, greedy)" and columns == ("", "accuracy", "format rate")
    metrics = report.held_out_metrics(before, after)
    assert metrics["n_eval_distinct"] == 63 and metrics["exact_accuracy_after"] == 0.05
    assert metrics["truncated_before"] == 0 and metrics["truncated_after"] == 7


def _rg(num_eval, **config):
    args = tasks.TaskArguments(task="reasoning_gym:lcm", task_config=json.dumps(config), num_eval=num_eval)
    return tasks.load_task(args, 24, train=False)


def test_reasoning_gym_held_out_questions_are_distinct():
    pytest.importorskip("reasoning_gym")
    import reasoning_gym as rg

    # lcm of two numbers from 1..12: the first 100 entries of the held-out seed (1) hold 63 distinct questions
    drawn = rg.create_dataset("lcm", size=400, seed=1, max_value=12)
    questions = [drawn[i]["question"] for i in range(400)]
    assert len(set(questions[:100])) == 63
    first_distinct = list(dict.fromkeys(questions))[:100]
    task = _rg(100, max_value=12)
    assert list(task.test["question"]) == first_distinct and task.held_out_note == ""
    # 200 asked, but two numbers from 1..12 make at most 12 x 12 = 144 questions: fewer rows, and the report says so
    short = _rg(200, max_value=12)
    held = list(short.test["question"])
    assert len(set(held)) == len(held) and 140 <= len(held) <= 144
    assert short.held_out_note.startswith(f"{len(held)} distinct questions, not --num_eval 200: ")
    assert short.held_out_note.endswith(' entries of reasoning-gym\'s lcm {"max_value": 12} held no more')
    # a generator whose first entries already differ keeps exactly those
    wide = rg.create_dataset("lcm", size=20, seed=1, max_value=1000)
    assert list(_rg(20, max_value=1000).test["question"]) == [wide[i]["question"] for i in range(20)]


def test_each_task_kind_declares_its_stop_strings_and_its_truncation_rule(tmp_path):
    arithmetic = tasks.load_task(tasks.TaskArguments(num_train_problems=8, num_eval=2), 8)
    assert arithmetic.stop == () and arithmetic.credit_truncated is False  # the last number is read
    r1 = tasks.load_task(tasks.TaskArguments(num_train_problems=8, num_eval=2, template="r1_zero"), 8)
    assert r1.stop == ("</answer>",) and r1.credit_truncated is True  # the answer sits in tags
    course_like = tmp_path / "r1_zero.prompt"
    course_like.write_text("Think in <think> </think>, answer in <answer> </answer>.\nUser: {question}\nAssistant:")
    from_file = tasks.load_task(tasks.TaskArguments(num_train_problems=8, num_eval=2, template=str(course_like)), 8)
    assert from_file.stop == ("</answer>",) and from_file.reward_funcs[0].stop_strings == ("</answer>",)
    mine = tasks.TaskArguments(num_train_problems=8, num_eval=2, stop=["\n\n", "###"], credit_truncated=True)
    assert tasks.load_task(mine, 8).stop == ("\n\n", "###") and tasks.load_task(mine, 8).credit_truncated
    off = tasks.TaskArguments(num_train_problems=8, num_eval=2, template="r1_zero", stop=[""])
    assert tasks.load_task(off, 8).stop == ()
    with pytest.raises(RecipeError, match=r"--stop \['a', ''\]: every entry must be a non-empty string"):
        tasks.load_task(tasks.TaskArguments(num_train_problems=8, num_eval=2, stop=["a", ""]), 8)
    assert tasks.load_task(tasks.TaskArguments(task="sort", num_train_problems=8, num_eval=2), 8).credit_truncated


def test_the_prompt_experiment_takes_the_courses_prompt_file(tmp_path):
    course = tmp_path / "cs336_alignment" / "prompts" / "r1_zero.prompt"
    assert prompt_arm_name("r1_zero") == "r1_zero" and prompt_arm_name(str(course)) == "r1_zero.prompt"
    options = SimpleNamespace(prompt_templates=[str(course), "question_only"])
    arms = experiment_arms("prompt", options, SimpleNamespace())
    assert [(a["name"], a["task"]) for a in arms] == [
        ("r1_zero.prompt", str(course)),
        ("question_only", "question_only"),
    ]
    default = experiment_arms("prompt", SimpleNamespace(), SimpleNamespace())
    assert [a["task"] for a in default] == list(PROMPT_TEMPLATES)
