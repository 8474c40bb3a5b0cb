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
        (
            dict(task="nope"),
            r"^--task nope: no such task; expected one of 'arithmetic', 'gsm8k', 'math', 'sort', "
            r"'reasoning_gym:DATASET' or 'package.module:factory'$",
        ),
        (dict(task="sortt"), r"^--task sortt: no such task \(did you mean 'sort'\?\); expected one of 'arithmetic'"),
        (dict(task="reasoning_gym:chainsum"), r"no such reasoning-gym dataset \(did you mean chain_sum"),
        (dict(task="arithmetic", task_config="{digits: 3}"), r"--task_config '\{digits: 3\}': not valid JSON"),
        (dict(task="arithmetic", task_config="[3]"), "--task_config '\\[3\\]': expected a JSON object"),
        (
            dict(task="arithmetic", task_config='{"digit": 3}'),
            r"^--task_config key 'digit': --task arithmetic takes no such setting \(its keys: 'digits'\)$",
        ),
        (dict(task="no_such_module_x:make"), "^--task no_such_module_x:make: cannot import no_such_module_x "),
        (dict(task="json:nothing_here"), "^--task json:nothing_here: json has no attribute 'nothing_here'$"),
        (dict(task="json:__name__"), "^--task json:__name__: json:__name__ is a str; expected a function that "),
        (
            dict(task="reasoning_gym:chain_sum", task_config='{"min_terms": 5, "max_terms": 2}'),
            r"--task_config \{\"min_terms\": 5, \"max_terms\": 2\}: reasoning-gym's chain_sum refused it "
            r"\(AssertionError: max_terms must be >= min_terms\)",
        ),
        (
            dict(task="reasoning_gym:chain_sum", task_config='{"answer_format": "xml"}'),
            r"answer_format='xml'; expected one of \['auto', 'answer_tag', 'answer_tag_or_whole', 'last_number', "
            r"'last_line'\]",
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
    with pytest.raises(RecipeError) as err:  # checked against the factory's signature, before it runs
        tasks.load_task(tasks.TaskArguments(task="my_tasks:make", task_config='{"m": 1}'), 12)
    assert (
        str(err.value) == "--task_config key 'm': --task my_tasks:make takes no such setting (its keys: 'n', 'offset')"
    )


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


# ------------------------------------------------------------------------------------- the row TRL hands over
RESERVED = ("completion", "completion_ids", "prompts", "completions", "trainer_state", "log_extra", "log_metric")
"""Every column name TRL 1.16's GRPOTrainer keeps from reward functions (read in trl/trainer/grpo_trainer.py,
_calculate_rewards): removed (completion, completion_ids), passed by TRL itself (prompts, completions,
completion_ids: a column of that name fails the call) or overwritten (trainer_state, log_extra, log_metric; and
environments, which only an environment_factory sets, checked without a trainer below)."""


def _reference_scorer(response, row):
    """A user's scorer that keeps its references under TRL's names: full credit when every reserved column holds what
    the row's prompt says it should (so a dropped or overwritten column scores 0), plus a response-dependent part."""
    i = int(row["prompt"].split()[1])
    intact = all(row.get(c) == f"{c}-{i}" for c in (*RESERVED, "environments")) and row["x"] == i
    value = float(intact) * (1 + len(response) % 3)
    return {"reward": value, "format_reward": 1.0, "answer_reward": float(intact)}


def _reference_rows(n=4):
    rows = {"prompt": [f"row {i} says" for i in range(n)], "x": list(range(n))}
    rows.update({c: [f"{c}-{i}" for i in range(n)] for c in (*RESERVED, "environments")})
    return rows


def _reference_task(n=4):
    rows = _reference_rows(n)
    return tasks.Task(
        name="references", train=Dataset.from_dict(rows), test=Dataset.from_dict(rows), scorer=_reference_scorer
    )


@pytest.mark.parametrize("upstream", [False, True], ids=["trl_ext", "upstream"])
def test_a_task_whose_columns_use_trls_names_scores_the_same_row_in_training(upstream, tiny_model, tokenizer, tmp_path):
    """unslothai/unsloth-zoo#832, huggingface/trl#2644: a reference in a column named `completion` (or any name TRL
    takes for itself) scored 1.0 in evaluation and 0.0 (or failed) in training. One real GRPO step: every reward TRL
    records equals the scorer's formula on the completion and the user's original row."""
    import trl
    from tiny import tiny_grpo_trainer

    import trl_ext

    task = _reference_task()
    original = {row["prompt"]: row for row in Dataset.from_dict(_reference_rows())}  # the user's rows, as written
    assert all(f"trl_ext.{c}" in task.train.column_names for c in RESERVED)  # carried under a name TRL passes on
    recorded = []

    def recording(func):
        def reward(prompts, completions, **kwargs):
            values = func(prompts=prompts, completions=completions, **kwargs)
            recorded.extend(zip(prompts, completions, values))
            return values

        reward.__name__ = func.__name__
        return reward

    classes = (trl.GRPOTrainer, trl.GRPOConfig) if upstream else (trl_ext.GRPOTrainer, trl_ext.GRPOConfig)
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_steps=1)
    settings.update(bf16=None)  # TRL's default
    rewards = [recording(f) for f in task.reward_funcs]
    trainer = tiny_grpo_trainer(tiny_model, tokenizer, tmp_path, task.train, rewards, *classes, **settings)
    tok = trainer.processing_class  # the left-padding copy it trained with
    trainer.train()
    assert len(recorded) == 4
    for prompt, completion, value in recorded:
        assert value == 1 + len(completion) % 3  # the formula on the user's row: every column arrived intact
        assert value == _reference_scorer(completion, original[prompt])["reward"]
    # evaluation scores the same rows the same way
    result = task.evaluate(tiny_model, tok, progress=False)
    for record in result["records"]:
        assert record["reward"] == 1 + len(record["response"]) % 3 and record["answer_reward"] == 1.0


def test_trls_own_keywords_never_replace_a_carried_column():
    """The call TRL makes (its keywords beside the columns, `environments` too), without a trainer."""
    task = _reference_task(2)
    (reward,) = task.reward_funcs
    columns = {c: task.train[c] for c in task.train.column_names if c != "prompt"}
    values = reward(
        prompts=task.train["prompt"],
        completions=["ab", "abc"],
        completion_ids=[[1], [2]],
        trainer_state=object(),
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
        environments=[object(), object()],
        **columns,
    )
    assert values == [1 + 2 % 3, 1 + 3 % 3]
    # the scorer and the records see the user's names: a row of the training set, or of the held-out set
    assert task.score("ab", task.train[1]) == task.score("ab", task.test[1]) == _reference_scorer("ab", task.test[1])
    with pytest.raises(ValueError, match=r"columns 'completion' and 'trl_ext.completion': the first is a name TRL"):
        tasks.Task(
            name="both",
            train=Dataset.from_dict({"prompt": ["p"], "completion": ["a"], "trl_ext.completion": ["b"]}),
            test=None,
            scorer=_within_tolerance,
        )


def test_columns_trl_would_drop_are_refused_or_named(tmp_path):
    import trl_ext

    task = _tolerance_task()
    config = trl_ext.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        num_generations=3,
        remove_unused_columns=True,
        use_cpu=True,
        report_to="none",
    )
    with pytest.raises(RecipeError, match=r"--remove_unused_columns true: TRL would drop the columns \['target', "):
        task.check_fills_one_step(config)
    (reward,) = task.reward_funcs  # called as TRL calls it after dropping them
    with pytest.raises(ValueError, match=r"passed none of the rows' columns \['target', 'tolerance'\]: a trainer with"):
        reward(prompts=["a"], completions=["10"], completion_ids=None, trainer_state=None)


# ---------------------------------------------------------------- decided and documented: README "Your own task"
def _raises_on_row_3(response, row):
    if row["x"] == 3:
        return {"reward": 1.0, "format_reward": 1.0, "answer_reward": row["missing"]}  # KeyError, as a typo would
    return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}


def test_a_scorer_that_raises_is_named_with_its_task_and_row_in_training_and_evaluation():
    rows = Dataset.from_dict({"prompt": [f"p{i}" for i in range(5)], "x": list(range(5))})
    task = tasks.Task(name="mine", train=rows, test=rows, scorer=_raises_on_row_3)
    (reward,) = task.reward_funcs
    with pytest.raises(
        ValueError, match=r"^mine_reward: row 3 \(0-based\): task 'mine': the scorer raised KeyError: "
    ) as err:
        reward(prompts=rows["prompt"], completions=["a"] * 5, x=rows["x"])
    assert "'p3'" in str(err.value) and isinstance(err.value.__cause__, ValueError)
    assert isinstance(err.value.__cause__.__cause__, KeyError)  # the original exception stays the cause
    with pytest.raises(
        ValueError, match=r"^held-out row 3 \(0-based\): task 'mine': the scorer raised KeyError: 'missing'"
    ):
        score_rows(list(rows), ["a"] * 5, task.score)


@pytest.mark.parametrize(
    "values, said",
    [
        ([0.0, 0.0, 0.0], "the reward was 0 on all 3 held-out rows"),
        ([-1.0, -1.0, -1.0], "the reward was -1 on all 3 held-out rows"),
        ([float("nan")] * 3, "the reward was NaN (no score) on all 3 held-out rows"),
        ([float("nan"), 0.5, 0.5], "the reward was 0.5 on all 3 held-out rows"),  # NaN rows have advantage 0
        ([1.0, 1.0, 1.0], "the reward was 1 on all 3 held-out rows"),
        ([0.0, 1.0, 0.0], None),
        ([-1.0, float("nan"), 0.0], None),
    ],
)
def test_nothing_to_learn_when_no_reward_varies(values, said):
    result = {"records": [{"reward": v, "answer_reward": v} for v in values], "format_rate": float("nan")}
    line = tasks.nothing_to_learn(result)
    assert (line is None) if said is None else line.startswith(said + " before training: GRPO learns only")


def test_nothing_to_learn_reads_every_reward_training_uses():
    """sort trains on its shaped reward and its exact reward: one of them varying is something to learn."""
    sort = tasks.load_task(tasks.TaskArguments(task="sort", num_train_problems=20, num_eval=5), 20)
    assert sort.reward_keys == ("reward", "answer_reward")
    result = {"records": [{"reward": 5.0, "answer_reward": a} for a in (1.0, 0.0)]}
    assert tasks.nothing_to_learn(result) is not None  # the shaped reward alone is constant
    assert tasks.nothing_to_learn(result, sort.reward_keys) is None
    result = {"records": [{"reward": 5.0, "answer_reward": 1.0}] * 2}
    assert tasks.nothing_to_learn(result, sort.reward_keys).startswith("the reward was reward 5 and answer_reward 1")


def test_a_stream_too_short_for_one_generation_batch_is_refused_like_a_dataset(tmp_path):
    """A 1-row stream trains 0 steps in TRL (transformers only logs "There seems not to be a single sample"), with or
    without dynamic sampling: refused before any model, as a dataset of one row is."""
    from datasets import IterableDataset

    import trl_ext

    def stream(n):
        def rows():
            yield from ({"prompt": f"p{i}", "target": 1.0, "tolerance": 1.0} for i in range(n))

        return IterableDataset.from_generator(rows)

    config = trl_ext.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        dynamic_sampling=True,
        use_cpu=True,
        report_to="none",
    )  # 8 completions in groups of 4: 2 prompts per generation batch
    for n, refused in ((1, True), (2, False), (50, False)):
        task = tasks.Task(name="streamed", train=stream(n), test=None, scorer=_within_tolerance, source="my stream")
        if refused:
            with pytest.raises(
                RecipeError, match=r"my stream: 1 training prompt cannot fill one generation batch of 2"
            ):
                task.check_fills_one_step(config)
        else:
            task.check_fills_one_step(config)


# ------------------------------------------------------------------- reasoning-gym: a perfect answer gets its credit
def _generators():
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


NOT_BUILT = {"composite": "builds only with its datasets named in --task_config (reasoning-gym refuses {})"}
"""reasoning-gym generators that do not build with an empty --task_config, with the reason."""


@pytest.mark.parametrize("name", _generators())
def test_a_response_that_is_the_gold_answer_gets_what_score_answer_gives_it(name):
    """open-thought/reasoning-gym#443, NovaSky-AI/SkyRL#160: with the chat template 15 generators gave the gold answer
    0 (multi-line grids and move lists cut to their last line, under an instruction to answer on one line), 0.05
    (arc_agi, rearc), 0.75/0.01 (sentences that lost their final period). The gold answer, alone, as the instruction
    asks, and after some reasoning, must get what the generator's own score_answer(gold, entry) gives it. Entries
    without a gold answer (answer None: boxnet, graph_color, ... verify a solution instead) are skipped."""
    import reasoning_gym

    if name in NOT_BUILT:
        pytest.skip(NOT_BUILT[name])
    task = tasks.load_task(tasks.TaskArguments(task=f"reasoning_gym:{name}", num_train_problems=3, num_eval=3), 64)
    oracle = reasoning_gym.create_dataset(name, size=3, seed=1)  # the held-out entries, drawn independently
    answer_format = task.description.split(", ")[1]
    for row, entry in zip(task.test, (oracle[i] for i in range(len(oracle)))):
        if row["question"] != entry["question"]:  # list_functions draws from Python's global generator: the row's own
            entry = json.loads(row["entry"])
        instruction = row["prompt"][-1]["content"].removeprefix(entry["question"].strip())
        assert instruction == "\n" + tasks.RG_INSTRUCTIONS[answer_format]
        if entry["answer"] is None:
            continue
        gold = str(entry["answer"])
        assert not ("\n" in gold and "one line" in instruction)  # the instruction does not contradict the question
        expected = oracle.score_answer(answer=entry["answer"], entry=entry)
        instructed = f"<answer>{gold}</answer>" if answer_format.startswith("answer_tag") else gold
        for response in (gold, instructed, "Let me think it through.\n" + instructed):
            assert task.score(response, row)["answer_reward"] == expected, (answer_format, response)


def test_generators_that_draw_from_pythons_global_generator_give_the_same_rows_and_leave_it_alone():
    """reasoning-gym's list_functions calls random.randint: its rows depended on what ran before, and loading the
    task moved the user's generator."""
    import random

    args = tasks.TaskArguments(task="reasoning_gym:list_functions", num_train_problems=4, num_eval=3)
    random.seed(123)
    first = tasks.load_task(args, 20)
    after = random.random()
    random.seed(456)
    second = tasks.load_task(args, 20)
    random.seed(123)
    assert random.random() == after  # loading drew nothing from the user's generator
    assert first.test["question"] == second.test["question"] and first.train["question"] == second.train["question"]


def test_multi_line_and_sentence_answers_take_tags_or_the_whole_response():
    expected = {"sudoku": "answer_tag_or_whole", "sentence_reordering": "answer_tag_or_whole"}
    expected.update(chain_sum="last_number", spell_backward="last_line")
    for name, answer_format in expected.items():
        args = tasks.TaskArguments(task=f"reasoning_gym:{name}", num_train_problems=20, num_eval=5)
        assert tasks.load_task(args, 20).description.split(", ")[1] == answer_format
    task = tasks.load_task(tasks.TaskArguments(task="reasoning_gym:sudoku", num_train_problems=2, num_eval=2), 20)
    row = task.test[0]
    assert task.extract(f"I solved it.\n<answer>\n{row['answer']}\n</answer>", row) == row["answer"]
    assert task.score(row["answer"].replace("\n", " "), row)["answer_reward"] == 0.0  # one line is not the grid
    assert task.score("", row)["format_reward"] == 0.0


# ------------------------------------------------------------------------------------- one task registry (issue 39)
def test_one_resolver_for_every_kind_of_task_name(tmp_path, monkeypatch):
    """--task resolves through tasks.resolve_task alone: a built-in name, reasoning_gym:NAME, package.module:factory,
    and no --task (arithmetic, or the kind of a --dataset_name); each gives the kind the option table reads."""
    (tmp_path / "my_tasks.py").write_text(MY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    sort = tasks.resolve_task({"task": "sort"})
    assert (sort.kind, sort.make) == ("sort", tasks.sorting_task)
    assert sort.settings() == ("num_numbers", "max_number", "instruction", "system_prompt")
    assert tasks.resolve_task({}).kind == "arithmetic" and tasks.resolve_task({}).settings() == ("digits",)
    assert tasks.resolve_task({"dataset_name": "x.jsonl", "dataset_kind": "math"}).kind == "math"
    gym = tasks.resolve_task({"task": "reasoning_gym:chain_sum"})
    assert gym.kind == "reasoning_gym" and gym.settings() is None  # **create_dataset settings: the generator checks
    mine = tasks.resolve_task({"task": "my_tasks:make"})
    assert (mine.kind, mine.settings(), mine.takes("options")) == ("factory", ("n", "offset"), False)
    assert tasks.resolve_task({"task": "my_tasks:make"}).make is mine.make  # imported once
    assert tasks.task_problem({"task": "gsm8"}) == (
        "--task gsm8: no such task (did you mean 'gsm8k'?); expected one of 'arithmetic', 'gsm8k', 'math', 'sort', "
        "'reasoning_gym:DATASET' or 'package.module:factory'"
    )
    assert tasks.task_problem({"task": "reasoning_gym:chainsum"}).startswith(
        "--task reasoning_gym:chainsum: no such reasoning-gym dataset (did you mean chain_sum"
    )


NEEDS_TASK = """
from datasets import Dataset
from trl_ext.tasks import Task


def needs(n, *, scale=1.0, label="x"):
    rows = Dataset.from_dict({"prompt": [str(i) for i in range(n)], "answer": [str(i * scale) for i in range(n)]})
    return Task(name=label, train=rows, test=rows, scorer=lambda r, row: {"reward": 0.0, "format_reward": 0.0,
                                                                           "answer_reward": 0.0})
"""


def test_task_config_is_the_factorys_keyword_arguments_checked_against_its_signature(tmp_path, monkeypatch):
    (tmp_path / "needs_tasks.py").write_text(NEEDS_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))

    def problem(task, config):
        return tasks.task_problem({"task": task, "task_config": config})

    assert problem("needs_tasks:needs", '{"n": 3, "scale": 2}') is None
    assert problem("needs_tasks:needs", '{"n": 3, "scal": 2, "size": 1}') == (
        "--task_config keys 'scal', 'size': --task needs_tasks:needs takes no such settings (its keys: 'n', 'scale', "
        "'label')"
    )
    assert problem("needs_tasks:needs", '{"scale": 2}') == (
        "--task_config: --task needs_tasks:needs needs the setting(s) 'n' (its keys: 'n', 'scale', 'label')"
    )
    task = tasks.load_task(tasks.TaskArguments(task="needs_tasks:needs", task_config='{"n": 3, "scale": 1.5}'), 9)
    assert task.test["answer"] == ["0.0", "1.5", "3.0"] and task.max_new_tokens == 9
    # the built-ins take their settings the same way: the sort task's keywords, the arithmetic task's digits
    sort = tasks.load_task(tasks.TaskArguments(task="sort", task_config='{"num_numbers": 5}', num_eval=2), 20)
    assert [len(row["answer"].split()) for row in sort.test] == [5, 5]
    arith = tasks.load_task(tasks.TaskArguments(task_config='{"digits": 3}', num_train_problems=4, num_eval=2), 20)
    assert all(100 <= int(n) <= 999 for row in arith.test for n in row["question"].split("?")[0].split() if n.isdigit())
    assert problem("sort", '{"num_eval": 2}') == (
        "--task_config key 'num_eval': --task sort takes no such setting (its keys: 'num_numbers', 'max_number', "
        "'instruction', 'system_prompt'); --num_eval is an option: pass it as a flag"
    )


def test_a_users_task_registered_by_decorator_is_listed_and_loaded():
    from trl_ext.cli import build_parser

    @tasks.register_task("halve_it", description="halve an even number")
    def halve(n: int = 4):
        rows = Dataset.from_dict(
            {
                "prompt": [f"halve {2 * i}" for i in range(n)],
                "target": [float(i) for i in range(n)],
                "tolerance": [0.1] * n,
            }
        )
        return tasks.Task(name="halve_it", train=rows, test=rows, scorer=_within_tolerance, answer_column="target")

    try:
        help_text = " ".join(build_parser((tasks.TaskArguments,), None, None).format_help().split())
        assert (
            "'sort' (the lecture's toy task: sort N numbers, shaped + exact rewards), 'halve_it' (halve an even "
            in (help_text)
        )
        task = tasks.load_task(tasks.TaskArguments(task="halve_it", task_config='{"n": 6}', num_eval=2), 7)
        assert (len(task.train), task.test["target"], task.max_new_tokens) == (6, [0.0, 1.0], 7)  # --num_eval cuts
        assert tasks.task_problem({"task": "halve_ti"}).startswith(
            "--task halve_ti: no such task (did you mean 'halve_it'"
        )
        assert tasks.task_problem({"task": "halve_it", "task_config": '{"m": 1}'}) == (
            "--task_config key 'm': --task halve_it takes no such setting (its keys: 'n')"
        )
        refused = tasks.option_problems({"task": "halve_it", "template": "r1_zero"})  # a factory's kind: no template
        assert refused[0].startswith("--template 'r1_zero': not used by --task halve_it (the factory makes its rows")
    finally:
        tasks.TASKS.unregister("halve_it")
    assert "halve_it" not in str(tasks.TaskArguments.__dataclass_fields__["task"].metadata["help"])


def test_grpo_sort_loads_its_task_through_the_resolver(tmp_path, monkeypatch):
    from conftest import load_recipe

    module = load_recipe("grpo_sort")
    resolved, built = [], []
    real_resolve, real_load = tasks.resolve_task, tasks.load_task
    monkeypatch.setattr(
        tasks.loader, "resolve_task", lambda values: resolved.append(values.get("task")) or real_resolve(values)
    )
    monkeypatch.setattr(tasks, "load_task", lambda *a, **k: built.append(real_load(*a, **k)) or built[-1])

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(module.trl_ext.models, "load_tokenizer", stop)  # the task is built; no model is loaded
    args = ["--output_dir", str(tmp_path), "--num_numbers", "4", "--max_number", "30", "--num_eval", "3"]
    args += ["--num_train_problems", "20"]
    with pytest.raises(Stop):
        module.main(*module.main.parse_args(args))
    assert resolved == ["sort"]
    (task,) = built
    assert task.name == "sort" and [f.__name__ for f in task.reward_funcs] == [
        "sort_shaped_reward",
        "sort_exact_reward",
    ]
    for row in task.test:  # 4 distinct numbers from 0..30 per prompt, the answer sorted
        numbers = [int(n) for n in row["answer"].split()]
        assert len(numbers) == 4 and numbers == sorted(numbers) and max(numbers) <= 30
    assert len(task.test) == 3
