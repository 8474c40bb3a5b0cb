"""Every task option is used by the task or refused in one line naming the flag, before any model loads (issue 37,
item 5): the product of every kind of task and every option of trl_ext.tasks.TaskArguments, read from the one table
the check reads (trl_ext.tasks.options.TASK_OPTIONS). "Used" is observed: the task's rows, name, description or
batch size change when the option is set."""

from __future__ import annotations

import json

import datasets
import pytest

from trl_ext import cli, tasks
from trl_ext.data import math_datasets
from trl_ext.errors import RecipeError
from trl_ext.tasks.options import TASK_KINDS, TASK_OPTION_NAMES, TASK_OPTIONS, UNUSED_WHEN

HUB = "test-org/questions"
"""A Hub id that the loader reaches as a local dataset repository (configs main/alt, splits train/test/other), read
by the real datasets.load_dataset: this machine has no network."""

FACTORY = """
from datasets import Dataset
from trl_ext.tasks import Task


def make(n=6):
    rows = Dataset.from_dict({"prompt": [f"double {i}" for i in range(n)], "x": list(range(n))})

    def score(response, row):
        right = float(response.strip() == str(2 * row["x"]))
        return {"reward": right, "format_reward": 1.0, "answer_reward": right}

    return Task(name="double", train=rows, test=rows, scorer=score, answer_column="x")
"""


def _rows(tag, n=8):
    return [
        {
            "question": f"{tag} question {i}: what is {i} + {i}?",
            "answer": f"add them\n#### {2 * i}",
            "problem": f"{tag} problem {i}: compute {i} + {i}.",
            "solution": f"so $\\boxed{{{2 * i}}}$",
        }
        for i in range(n)
    ]


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    card = ["---", "configs:"]
    for config in ("main", "alt"):
        card += [f"- config_name: {config}"] + (["  default: true"] if config == "main" else []) + ["  data_files:"]
        for split in ("train", "test", "other"):
            _write(repo / config / f"{split}.jsonl", _rows(f"{config}-{split}"))
            card += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (repo / "README.md").write_text("\n".join(card + ["---", ""]))
    real = datasets.load_dataset

    def load_dataset(name, config=None, split=None):
        assert name == HUB, name
        return real(str(repo), config, split=split)

    monkeypatch.setattr(math_datasets, "load_dataset", load_dataset)
    (tmp_path / "opt_tasks.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = _rows("bad") + [{"question": "no answer here"}]
    return {
        "file": _write(tmp_path / "a.jsonl", _rows("file")),
        "test_file": _write(tmp_path / "test.jsonl", _rows("held-out")),
        "bad_file": _write(tmp_path / "bad.jsonl", bad),
    }


BASELINES = {  # each kind with the options it needs to load here, all of them used by it
    "arithmetic": {"task": "arithmetic", "num_train_problems": 12},
    "gsm8k": {"task": "gsm8k", "dataset_name": HUB},
    "math": {"task": "math", "dataset_name": HUB},
    "sort": {"task": "sort", "num_train_problems": 12},
    "reasoning_gym": {"task": "reasoning_gym:chain_sum", "num_train_problems": 12},
    "factory": {"task": "opt_tasks:make"},
}

TASK_CONFIGS = {
    "arithmetic": '{"digits": 3}',
    "gsm8k": '{"num_eval": 2}',
    "math": '{"num_eval": 2}',
    "sort": '{"num_numbers": 4}',
    "reasoning_gym": '{"min_terms": 2, "max_terms": 2}',
    "factory": '{"n": 5}',
}


def _probe(option, kind, data):
    """A value of ``option`` other than its default (for the task kinds that use it, one that changes something)."""
    return {
        "dataset_name": data["file"],
        "dataset_config": "alt",
        "dataset_train_split": "other",
        "dataset_test_split": "other",
        "dataset_streaming": True,
        "ignore_bias_buffers": True,
        "task_config": TASK_CONFIGS[kind],
        "dataset_kind": "gsm8k" if kind == "math" else "math",
        "test_file": data["test_file"],
        "template": "r1_zero",
        "instruction": "Think first.",
        "system_prompt": "Be brief.",
        "reward": "gsm8k" if kind == "math" else "math",
        "num_train_problems": 7,
        "arithmetic_digits": 3,
        "num_eval": 2,
        "eval_batch_size": 7,
        "skip_bad_rows": True,
        "stop": ["\n\n"],
        "credit_truncated": kind in ("arithmetic", "gsm8k", "reasoning_gym"),  # the opposite of the kind's default
    }[option]


def _context(option, kind, data):
    """What else an option needs to show its effect: skip_bad_rows a file with a bad row (where a file is read)."""
    if option == "skip_bad_rows" and "dataset_name" in TASK_OPTIONS[kind]:
        return {"dataset_name": data["bad_file"]}
    return {}


def _observe(options):
    """What a user can see of the task these options load: its rows, name, description and evaluation batch, or the
    refusal."""
    try:
        task = tasks.load_task(tasks.TaskArguments(**{"num_eval": 4, **options}), 8)
    except RecipeError as err:
        return ("refused", str(err))
    rows = [[(json.dumps(r["prompt"]), str(task.answer(r))) for r in split] for split in (task.train, task.test)]
    return (task.name, task.description, task.batch_size, rows, task.stop, task.credit_truncated)


def test_the_table_covers_every_kind_and_option():
    assert set(TASK_OPTIONS) == set(TASK_KINDS)
    assert all(set(used) <= set(TASK_OPTION_NAMES) for used in TASK_OPTIONS.values())
    assert {o for o, _, _ in UNUSED_WHEN} <= set(TASK_OPTION_NAMES)
    import dataclasses

    fields = {f.name for f in dataclasses.fields(tasks.TaskArguments)}
    assert fields - set(TASK_OPTION_NAMES) == {"task", "overwrite_output_dir"}  # --task itself, every recipe's own


@pytest.mark.parametrize("option", TASK_OPTION_NAMES)
@pytest.mark.parametrize("kind", TASK_KINDS)
def test_every_task_option_is_used_or_refused_naming_the_flag(kind, option, data):
    base = {**BASELINES[kind], **_context(option, kind, data)}
    value = _probe(option, kind, data)
    without, with_option = _observe(base), _observe({**base, option: value})
    if option in TASK_OPTIONS[kind]:
        assert with_option[0] != "refused", with_option
        assert with_option != without  # an observable effect
        assert without[0] != "refused" or option == "skip_bad_rows"  # the bad row refuses the file without it
    else:
        assert with_option[0] == "refused"
        assert with_option[1].startswith(f"--{option} {value!r}: not used by --task {BASELINES[kind]['task']} (")
        assert with_option[1].endswith("; remove it") and "\n" not in with_option[1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dataset_name": "FILE", "dataset_config": "alt"}, "--dataset_config 'alt': not used (--dataset_name is a "),
        (
            {"dataset_name": "FILE", "dataset_train_split": "x"},
            "--dataset_train_split 'x': not used (--dataset_name ",
        ),
        ({"dataset_name": "FILE", "dataset_test_split": "x"}, "--dataset_test_split 'x': not used (--dataset_name "),
        (
            {"dataset_name": HUB, "test_file": "TEST_FILE", "dataset_test_split": "other"},
            "--dataset_test_split 'other': not used (--test_file holds the held-out rows); remove it",
        ),
        (
            {"task": "reasoning_gym:chain_sum", "template": "r1_zero", "system_prompt": "Hi."},
            "--system_prompt 'Hi.': not used (only --template chat has a system turn); remove it",
        ),
        (  # a math dataset's factory takes no settings: its options are flags
            {"task": "gsm8k", "dataset_name": HUB, "task_config": '{"num_eval": 2}'},
            "--task_config '{\"num_eval\": 2}': not used by --task gsm8k (its rows are a dataset's; it takes "
            "--num_eval, ",
        ),
        (  # an option given as a setting: refused, naming its flag
            {"task": "arithmetic", "task_config": '{"arithmetic_digits": 3}'},
            "--task_config key 'arithmetic_digits': --task arithmetic takes no such setting (its keys: 'digits'); "
            "--arithmetic_digits is an option: pass it as a flag",
        ),
        (
            {"task": "sort", "task_config": '{"num_number": 4}'},
            "--task_config key 'num_number': --task sort takes no such setting (its keys: 'num_numbers', 'max_number', "
            "'instruction', 'system_prompt')",
        ),
        (
            {"dataset_kind": "gsm8k"},
            "--dataset_kind 'gsm8k': not used by generated arithmetic (no --task) (it generates its problems; ",
        ),
    ],
)
def test_a_setting_that_makes_another_unused_refuses_it(options, message, data):
    files = {"FILE": data["file"], "TEST_FILE": data["test_file"]}
    options = {k: files.get(v, v) for k, v in options.items()}
    with pytest.raises(RecipeError) as err:
        tasks.load_task(tasks.TaskArguments(num_eval=3, **options), 8)
    assert str(err.value).startswith(message)


def test_held_out_rows_only_refuse_the_training_options():
    args = tasks.TaskArguments(task="reasoning_gym:chain_sum", num_train_problems=50, num_eval=3)
    assert len(tasks.load_task(args, 8).train) > 0
    with pytest.raises(RecipeError, match=r"^--num_train_problems 50: not used \(only held-out rows are loaded\)"):
        tasks.load_task(args, 8, train=False)  # recipes/eval_math.py


def test_the_prompt_experiment_needs_a_task_with_templates(data):
    rg = tasks.load_task(tasks.TaskArguments(task="reasoning_gym:chain_sum", num_train_problems=5, num_eval=2), 8)
    rg_r1 = tasks.load_task(
        tasks.TaskArguments(task="reasoning_gym:chain_sum", num_train_problems=5, num_eval=2), 8, template="r1_zero"
    )
    assert isinstance(rg.test[0]["prompt"], list) and rg_r1.test[0]["prompt"].endswith("Assistant: <think>")
    for name in ("sort", "opt_tasks:make"):
        with pytest.raises(
            RecipeError, match=rf"^--task {name}: takes no --template, so its prompts cannot be compared"
        ):
            tasks.load_task(tasks.TaskArguments(task=name, num_eval=2), 8, template="r1_zero")


def test_the_command_line_counts_what_the_user_set_and_names_where(tmp_path):
    """Before any data or model: a flag or the user's --config file is refused; the recipe's own defaults are not
    the user's doing and do not count; a recipe's alias (eval_math's --dataset_split) is named as typed."""
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text("template: r1_zero\n")
    mine = tmp_path / "mine.yaml"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("{}\n")
    mine.write_text(f"test_file: {held_out}\nnum_eval: 3\n")

    def parse(*argv, default_config=None):
        return cli.parse((tasks.TaskArguments,), default_config, list(argv))

    (script_args,) = parse("--task", "sort", default_config=defaults)  # the recipe's default, not the user's
    assert script_args.template == "r1_zero"
    with pytest.raises(RecipeError) as err:
        parse("--task", "sort", "--template", "r1_zero")
    assert str(err.value).startswith("--template 'r1_zero': not used by --task sort (it generates its problems")
    with pytest.raises(RecipeError) as err:
        parse("--config", str(mine), "--task", "reasoning_gym:chain_sum", "--reward", "math")
    lines = str(err.value).splitlines()
    assert lines[0] == "2 problems with the options (found before loading any model):"
    assert lines[1].startswith(f"  --test_file '{held_out}' (set in {mine}): not used by --task reasoning_gym:")
    assert lines[2].startswith("  --reward 'math': not used by --task reasoning_gym:chain_sum (the generator makes")

    from conftest import load_recipe

    eval_math = load_recipe("eval_math")
    with pytest.raises(RecipeError, match=r"^--dataset_split 'validation': not used by --task reasoning_gym:chain_sum"):
        eval_math.main.parse_args(["--task", "reasoning_gym:chain_sum", "--dataset_split", "validation"])
