"""trl_ext.tasks: one judge per task that sees the whole row; the TRL reward and the held-out accuracy derived from it;
--task / --task_config; reasoning-gym generators scored by their own score_answer; a user's task by dotted path."""

from __future__ import annotations

import ast
import json
import operator
import sys

import pytest
from datasets import Dataset

from trl_ext import tasks
from trl_ext.errors import RecipeError
from trl_ext.eval import score_rows


def _within_tolerance(response, row):
    """A judge that needs the whole row: the response's number must be within the row's own tolerance of its target;
    half credit within twice the tolerance."""
    try:
        value = float(response.strip())
    except ValueError:
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    gap = abs(value - row["target"])
    credit = 1.0 if gap <= row["tolerance"] else 0.5 if gap <= 2 * row["tolerance"] else 0.0
    return {"reward": credit, "format_reward": 1.0, "answer_reward": credit}


def _tolerance_task(**kw):
    rows = {"prompt": ["a", "b", "c"], "target": [10.0, 20.0, 30.0], "tolerance": [1.0, 5.0, 0.1]}
    return tasks.Task(
        name="tolerance", train=Dataset.from_dict(rows), test=Dataset.from_dict(rows), scorer=_within_tolerance, **kw
    )


def test_the_trl_reward_is_the_judge_on_the_whole_row():
    task = _tolerance_task()
    (reward,) = task.reward_funcs
    assert reward.__name__ == "tolerance_reward"
    columns = {"target": [10.0, 20.0, 30.0], "tolerance": [1.0, 5.0, 0.1]}
    logged = {}
    # 10.5 is within 1 of 10 (1.0); 29 is 9 from 20, within 2 x 5 (0.5); 30.15 is 0.15 from 30, within 2 x 0.1 (0.5)
    values = reward(
        prompts=["a", "b", "c"],
        completions=["10.5", "29", "30.15"],
        completion_ids=None,
        log_metric=lambda k, v: logged.__setitem__(k, v),
        **columns,
    )
    assert values == [1.0, 0.5, 0.5]
    assert logged == {"rewards/tolerance_reward/format_reward": 1.0, "rewards/tolerance_reward/answer_reward": 2 / 3}
    # conversational completions are read as their last message, as TRL passes them
    assert reward(prompts=[[]], completions=[[{"role": "assistant", "content": "10"}]], target=[10.0], tolerance=[1.0])
    with pytest.raises(ValueError, match="tolerance_reward: column 'target' has 2 entries but there are 1"):
        reward(prompts=["a"], completions=["1"], target=[1.0, 2.0], tolerance=[1.0])


def test_held_out_accuracy_is_the_mean_answer_reward_with_partial_credit():
    task = _tolerance_task(extractor=lambda response, row: response.strip())
    result = score_rows(
        list(task.test), ["10.5", "29", "x"], task.score, answer=lambda row: row["target"], extract=task.extract
    )
    assert result["accuracy"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert result["format_rate"] == pytest.approx(2 / 3)
    record = result["records"][1]
    assert (record["answer"], record["extracted"], record["answer_reward"], record["reward"]) == (20.0, "29", 0.5, 0.5)
    assert result["breakdown"] == {
        "format1_answer1": 2,
        "format1_answer0": 0,
        "format0_answer1": 0,
        "format0_answer0": 1,
    }


def test_a_scorer_that_fails_is_reported_before_any_model_loads():
    def broken(response, row):
        return {"reward": 1.0 / len(response)}  # no format/answer keys, and ZeroDivisionError on ""

    task = tasks.Task(
        name="mine", train=None, test=Dataset.from_dict({"prompt": ["p"], "answer": ["42"]}), scorer=broken
    )
    with pytest.raises(RecipeError, match=r"--task mine: the scorer failed on held-out row 0 with the response '42' "):
        task.probe()
    task = tasks.Task(name="mine", train=None, test=Dataset.from_dict({"q": ["p"]}), scorer=_within_tolerance)
    with pytest.raises(RecipeError, match=r"--task mine: held-out rows have columns \['q'\]; expected a 'prompt'"):
        task.probe()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(task="nope"), r"--task 'nope': expected one of \['arithmetic', 'gsm8k', 'math', 'sort'\]"),
        (dict(task="reasoning_gym:chainsum"), r"no such reasoning-gym dataset \(did you mean chain_sum"),
        (dict(task="arithmetic", task_config="{digits: 3}"), r"--task_config '\{digits: 3\}': not valid JSON"),
        (dict(task="arithmetic", task_config="[3]"), "--task_config '\\[3\\]': expected a JSON object"),
        (dict(task="arithmetic", task_config='{"digit": 3}'), r"--task_config: unknown key\(s\) \['digit'\]"),
        (dict(task="no_such_module_x:make"), "--task 'no_such_module_x:make': cannot import 'no_such_module_x'"),
        (dict(task="json:nothing_here"), "--task 'json:nothing_here': module 'json' has no 'nothing_here'"),
        (
            dict(task="reasoning_gym:chain_sum", task_config='{"min_terms": 5, "max_terms": 2}'),
            r"--task_config \{\"min_terms\": 5, \"max_terms\": 2\}: reasoning-gym's chain_sum refused it "
            r"\(AssertionError: max_terms must be >= min_terms\)",
        ),
        (
            dict(task="reasoning_gym:chain_sum", task_config='{"answer_format": "xml"}'),
            r"answer_format='xml'; expected one of \['auto', 'answer_tag', 'last_number', 'last_line'\]",
        ),
    ],
)
def test_a_bad_task_or_config_is_one_line_naming_the_flag(options, message):
    with pytest.raises(RecipeError, match=message):
        tasks.load_task(tasks.TaskArguments(num_train_problems=20, num_eval=5, **options), 20)


def test_reasoning_gym_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as when the extra is not installed
    assert tasks.task_problem({"task": "reasoning_gym:chain_sum"}) == (
        "--task: reasoning-gym is not installed: `uv sync --extra tasks` (or `pip install reasoning-gym`)"
    )
    assert tasks.task_problem({"task": "arithmetic"}) is None  # the other tasks never import it


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub}


def _value(node):
    """An independent oracle for chain_sum: the integer value of '+'/'-' expressions, read by Python's parser."""
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand)
    return node.value


def test_reasoning_gym_chain_sum_rows_scores_and_records(tiny_model, tokenizer):
    config = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    args = tasks.TaskArguments(
        task="reasoning_gym:chain_sum", task_config=json.dumps(config), num_train_problems=200, num_eval=30
    )
    task = tasks.load_task(args, 8)
    train_questions, test_questions = set(task.train["question"]), set(task.test["question"])
    assert not train_questions & test_questions  # disjoint
    assert len(task.test) == 30 and 0 < len(task.train) <= 200
    dropped = 200 - len(task.train)
    assert (f"({dropped} training rows dropped" in task.source) == (dropped > 0)
    for row in task.test:
        entry = json.loads(row["entry"])
        expected = _value(ast.parse(entry["metadata"]["expression"], mode="eval").body)
        assert int(row["answer"]) == expected
        assert row["prompt"][-1]["content"] == f"{entry['question']}\nAnswer with just the number."
        # last-number extraction, then the generator's own score_answer
        assert task.score(f"So the answer is {expected}.", row) == {
            "reward": 1.0,
            "format_reward": 1.0,
            "answer_reward": 1.0,
        }
        assert task.score(f"{expected} + 1 = {expected + 1}", row)["answer_reward"] == 0.0
        assert task.score("no number here", row) == {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    result = task.evaluate(tiny_model, tokenizer, progress=False)
    for record, row in zip(result["records"], task.test):
        assert record["answer"] == row["answer"]
        truth = _value(ast.parse(json.loads(row["entry"])["metadata"]["expression"], mode="eval").body)
        extracted = record["extracted"]
        right = extracted is not None and float(extracted) == truth
        assert record["answer_reward"] == float(right)


def test_reasoning_gym_text_answers_read_the_last_line():
    args = tasks.TaskArguments(task="reasoning_gym:spell_backward", num_train_problems=10, num_eval=5)
    task = tasks.load_task(args, 20)
    row = task.test[0]
    assert row["prompt"][-1]["content"].endswith("\nAnswer with just the answer, on one line.")
    assert task.score(f"Sure.\nThe answer is: {row['answer']}.", row)["answer_reward"] == 1.0
    assert task.extract(f'"{row["answer"]}"', row) == row["answer"]
    assert task.score(row["answer"][::-1] + "x", row)["answer_reward"] < 1.0


def test_answer_tags_under_the_r1_zero_template():
    args = tasks.TaskArguments(task="reasoning_gym:chain_sum", template="r1_zero", num_train_problems=10, num_eval=3)
    task = tasks.load_task(args, 20)
    row = task.test[0]
    assert row["prompt"].endswith("Assistant: <think>") and "Answer with just" not in row["prompt"]
    assert task.score(f"add </think> <answer>{row['answer']}</answer>", row)["answer_reward"] == 1.0
    assert task.score(f"the sum is {row['answer']}", row)["format_reward"] == 0.0  # no tags: no answer


MY_TASK = """
from datasets import Dataset
from trl_ext.tasks import Task


def make(n=3, offset=0):
    rows = Dataset.from_dict({"prompt": [f"double {i}" for i in range(n)], "x": [i + offset for i in range(n)]})

    def score(response, row):
        right = float(response.strip() == str(2 * row["x"]))
        return {"reward": right, "format_reward": 1.0, "answer_reward": right}

    return Task(name="double", train=rows, test=rows, scorer=score, answer_column="x")


def not_a_task():
    return {"prompt": []}


def course_reward_fn(response, ground_truth):
    right = float(response.strip().endswith(ground_truth))
    return {"reward": right, "format_reward": 1.0, "answer_reward": right}
"""


def test_a_users_task_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(MY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tasks.load_task(tasks.TaskArguments(task="my_tasks:make", task_config='{"n": 4, "offset": 1}'), 12)
    assert (task.name, len(task.train), task.max_new_tokens) == ("double", 4, 12)
    assert task.score("6", task.test[2])["answer_reward"] == 1.0  # x = 3
    assert task.answer(task.test[2]) == 3
    with pytest.raises(
        RecipeError, match=r"--task my_tasks:not_a_task: returned a dict; expected a trl_ext.tasks.Task"
    ):
        tasks.load_task(tasks.TaskArguments(task="my_tasks:not_a_task"), 12)
    with pytest.raises(RecipeError, match=r"--task_config \{\"m\": 1\}: my_tasks:make does not take it"):
        tasks.load_task(tasks.TaskArguments(task="my_tasks:make", task_config='{"m": 1}'), 12)


def test_the_course_students_path(tmp_path, monkeypatch):
    """The course's prompt file, its grader by dotted path and its separate held-out file; no contradictory
    instruction after the template's own answer format."""
    prompt = tmp_path / "r1_zero.prompt"
    prompt.write_text("A conversation {x}.\nUser: {question}\nAssistant: <think>")  # other braces kept as written
    rows = [{"question": f"What is {i} + {i}?", "answer": f"work\n#### {2 * i}"} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (tmp_path / "my_tasks.py").write_text(MY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = tasks.TaskArguments(
        dataset_name=str(tmp_path / "train.jsonl"),
        test_file=str(tmp_path / "test.jsonl"),
        template=str(prompt),
        reward="my_tasks:course_reward_fn",
        num_eval=2,
    )
    task = tasks.load_task(args, 16)
    assert len(task.train) == 10 and task.test["answer"] == ["0", "2"]  # the whole file trains, test.jsonl evaluates
    assert task.train[1]["prompt"] == "A conversation {x}.\nUser: What is 1 + 1?\nAssistant: <think>"
    assert (task.name, task.description) == ("course_reward", "template file prompt, course_reward reward")
    assert task.score("so 2", task.test[1])["reward"] == 1.0
    assert [f.__name__ for f in task.reward_funcs] == ["course_reward_reward"]
    # the default instruction follows the template: the chat template gets it, the r1_zero ones do not
    assert tasks.default_instruction("chat") == "Answer with just the number."
    assert tasks.default_instruction("r1_zero") is None and tasks.default_instruction(task.template) is None
    with pytest.raises(RecipeError, match="--template .*nope.prompt'?: expected one of"):
        tasks.load_task(tasks.TaskArguments(template=str(tmp_path / "nope.prompt")), 16)


def test_nothing_to_learn_is_said_when_every_held_out_reward_is_zero():
    zero = {"records": [{"reward": 0.0}, {"reward": 0.0}], "format_rate": 0.0}
    assert tasks.nothing_to_learn(zero).startswith(
        "the reward was 0 on all 2 held-out rows before training, format rate 0%"
    )
    assert tasks.nothing_to_learn({"records": [{"reward": 0.0}, {"reward": 0.5}], "format_rate": 1.0}) is None


def test_the_math_tasks_keep_their_rows_and_reward_names():
    from trl_ext.data import make_arithmetic_dataset

    task = tasks.load_task(tasks.TaskArguments(num_train_problems=50, num_eval=10), 20)
    expected = make_arithmetic_dataset(50, seed=0, split="train", digits=2, instruction="Answer with just the number.")
    assert task.name == "arithmetic" and task.train["prompt"] == expected["prompt"]
    assert [f.__name__ for f in task.reward_funcs] == ["arithmetic_reward"]
    row = task.test[0]
    assert task.score(f"{row['answer']}", row)["answer_reward"] == 1.0
    sort = tasks.load_task(tasks.TaskArguments(task="sort", num_train_problems=20, num_eval=5), 20)
    assert [f.__name__ for f in sort.reward_funcs] == ["sort_shaped_reward", "sort_exact_reward"]
    row = sort.test[0]
    # shaped: inclusion + ordering; exact: all or nothing, both from sort_shaped_reward_fn's one judgement
    shaped, exact = (
        f(prompts=[row["prompt"]], completions=[row["answer"]], answer=[row["answer"]]) for f in sort.reward_funcs
    )
    assert (shaped, exact) == ([5.0], [1.0])  # 3 numbers: 3 included + 2 ordered pairs
