"""Math tasks: generated arithmetic, GSM8K and MATH, with their graders (:data:`GRADERS`) and templates."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trl_ext import rewards
from trl_ext.data import load_math_dataset, make_arithmetic_dataset
from trl_ext.data.math_datasets import infer_kind
from trl_ext.data.prompts import ANSWER_WITH_NUMBER, R1_ZERO_TEMPLATE, TEMPLATES, template_stop_strings
from trl_ext.errors import RecipeError, read_text, user_input
from trl_ext.registry import Registry
from trl_ext.tasks.base import Scorer, Task
from trl_ext.tasks.options import (
    DATASET,
    EVERY_TASK,
    NO_CONFIG,
    PROMPT,
    TaskArguments,
    register_task,
)


# ---------------------------------------------------------------------------------------------------- math tasks
def _r1_zero_answer(response: str) -> str | None:
    return rewards.extract_math_answer(response) if "</think> <answer>" in response else None


@dataclass(frozen=True)
class Grader:
    """How one kind of math answer is judged: ``reward_fn(response, ground_truth) -> {"reward", "format_reward",
    "answer_reward"}`` (the course shape), the answer it reads from a response (``extract``), and whether a response
    the length limit cut may earn credit (``credit_truncated``: not where the answer is read from the response's
    end, which a cut-off sentence also has)."""

    reward_fn: Callable[[str, str], dict[str, float]]
    extract: Callable[[str], str | None] | None = None
    credit_truncated: bool = True


GRADERS: Registry[Grader] = Registry(
    "grader",
    "reward",
    Grader,
    wraps="reward_fn",
    expects="a function reward_fn(response, ground_truth)",
    dotted_as_registered=False,
)
"""The math tasks' graders by ``--reward`` name (a :class:`~trl_ext.registry.Registry`: did-you-mean, and
``package.module:function`` for a course ``reward_fn``): ``arithmetic`` and ``gsm8k`` grade the last number of a
response (so a response the length limit cut earns nothing), ``math`` a ``\\boxed{}``/``<answer>`` with math-verify,
``r1_zero`` also needs the "</think> <answer> ... </answer>" format. The chosen grader is the task's scorer."""
GRADERS.register("arithmetic", extract=rewards.extract_last_number, credit_truncated=False)(rewards.gsm8k_reward_fn)
GRADERS.register("gsm8k", extract=rewards.extract_last_number, credit_truncated=False)(rewards.gsm8k_reward_fn)
GRADERS.register("math", extract=rewards.extract_math_answer)(rewards.math_reward_fn)
GRADERS.register("r1_zero", extract=_r1_zero_answer)(rewards.r1_zero_reward_fn)


def _grader(reward: str | None, template: str, kind: str) -> tuple[str, Grader]:
    """``--reward`` (a name of :data:`GRADERS` or a dotted course reward_fn), else ``r1_zero`` for the r1_zero
    template and template files, else ``kind``'s grader.

    Raises:
        RecipeError: an unknown ``--reward`` (with the closest names) or one that cannot be imported.
    """
    problem = GRADERS.problem(reward, flag=True) if reward is not None else None
    if problem:
        raise RecipeError(problem.replace("package.module:attr", "package.module:reward_fn"))
    if reward is not None:
        return reward.rpartition(":")[2].removesuffix("_fn"), GRADERS.get(reward)
    name = "r1_zero" if template not in ("chat", "question_only") else kind
    return name, GRADERS.get(name)


def resolve_template(template: str) -> str:
    """A template name of ``trl_ext.data.prompts.TEMPLATES`` as is, or the text of a template file (a path to a file
    holding ``{question}``), read by :func:`trl_ext.errors.read_text`: UTF-8 with a byte-order mark dropped (else
    every prompt would start with U+FEFF), UTF-16/UTF-32 with a byte-order mark decoded as such, Windows line ends
    read as ``\\n``.

    Raises:
        RecipeError: neither a name nor a readable file with ``{question}``, or a file in another encoding (cp1252,
            UTF-16 without a byte-order mark), naming ``--template`` and the file.
    """
    if template in TEMPLATES:
        return template
    path = Path(template)
    if not path.is_file():
        raise RecipeError(f"--template {template!r}: expected one of {list(TEMPLATES)} or a template file path")
    try:
        text = read_text(path)  # UTF-8 (a byte-order mark dropped, not put before every prompt); else one line
    except ValueError as err:
        raise RecipeError(f"--template {err}") from None
    if "{question}" not in text:
        raise RecipeError(f"--template {template}: the file has no {{question}} placeholder")
    return text


def template_label(template: str) -> str:
    """A template's name for reports: the name, or ``template file`` for a file's text."""
    return template if template in TEMPLATES else "template file"


def default_instruction(template: str, numeric: bool = True) -> str | None:
    """The instruction appended when ``--instruction`` is unset: "Answer with just the number." for ``chat`` and
    ``question_only`` on numeric tasks; none for ``r1_zero`` and template files, whose text asks for ``<answer>``
    tags (appending it would contradict them)."""
    return ANSWER_WITH_NUMBER if numeric and template in ("chat", "question_only") else None


def _instruction(args: TaskArguments, template: str, numeric: bool = True) -> str | None:
    if args.instruction is None:
        return default_instruction(template, numeric)
    return args.instruction or None


def math_task(
    args: TaskArguments, max_new_tokens: int, kind: str | None = None, template: str | None = None, train: bool = True
) -> Task:
    """Generated arithmetic, GSM8K or MATH (a local file or a Hub dataset), graded by :data:`GRADERS` or
    ``--reward``.

    ``kind`` ``"arithmetic"`` without ``--dataset_name``: generated problems (``num_train_problems`` training,
    ``num_eval`` held out, disjoint by construction). A local .jsonl/.json/.parquet file: its last rows are held out
    (at most a fifth), or ``--test_file``'s first ``num_eval`` rows. A Hub dataset: held out =
    ``--dataset_test_split`` (its first ``num_eval`` rows), or ``--test_file``. ``gsm8k`` and ``math`` without
    ``--dataset_name`` read ``openai/gsm8k`` (config ``main``) and ``HuggingFaceH4/MATH-500`` (held out only:
    train from your own file). ``template`` replaces the options' template and their ``--reward`` (the grader
    follows the template), for experiments that compare prompts. ``train=False`` loads the held-out rows only.

    Raises:
        RecipeError: an unknown ``--reward`` or template (before any data is read), or data that cannot be used,
            naming ``--dataset_name``/``--test_file`` and the file, row and problem.
    """
    if template is not None:
        args = replace(args, template=template, reward=None)
    text = resolve_template(args.template)
    _grader(args.reward, text, "gsm8k")  # an unknown --reward fails before any data is read
    common = dict(template=text, system_prompt=args.system_prompt, instruction=_instruction(args, text))
    kind = kind or ("arithmetic" if args.dataset_name is None else None)
    dataset_name = args.dataset_name or {"gsm8k": "openai/gsm8k", "math": "HuggingFaceH4/MATH-500"}.get(kind)
    config_name = args.dataset_config or ("main" if dataset_name == "openai/gsm8k" else None)
    train_rows = None
    if dataset_name is None:  # generated arithmetic
        gen = dict(digits=args.arithmetic_digits, **common)
        with user_input():
            train_rows = (
                make_arithmetic_dataset(args.num_train_problems, seed=0, split="train", **gen) if train else None
            )
            test = make_arithmetic_dataset(args.num_eval, seed=1, split="test", **gen)
        kind, source, dataset = "arithmetic", f"--num_train_problems {args.num_train_problems}", "generated arithmetic"
    else:
        load = dict(
            kind=args.dataset_kind or (kind if kind != "arithmetic" else None), skip_bad_rows=args.skip_bad_rows
        )
        load.update(common)
        if train:
            with user_input("--dataset_name: "):
                train_rows = load_math_dataset(
                    dataset_name, split=args.dataset_train_split, config_name=config_name, **load
                )
        if args.test_file:
            with user_input("--test_file: "):
                test = load_math_dataset(args.test_file, max_rows=args.num_eval, **load)
            source = f"--dataset_name {dataset_name} (held out: --test_file {args.test_file})"
        elif Path(dataset_name).is_file() and train:  # one local file: hold out its last rows (at most a fifth)
            if len(train_rows) < 2:
                raise RecipeError(
                    f"--dataset_name {dataset_name}: {len(train_rows)} usable row(s); need at "
                    "least 2 (training rows plus held-out rows), or a separate --test_file"
                )
            held_out = max(1, min(args.num_eval, len(train_rows) // 5))
            cut = len(train_rows) - held_out
            test, train_rows = train_rows.select(range(cut, len(train_rows))), train_rows.select(range(cut))
            rows = f"{len(test)} row{'s' if len(test) != 1 else ''}"
            source = f"--dataset_name {dataset_name} (its last {rows} held out for evaluation)"
        else:  # a Hub dataset's test split, or (held-out rows only) a whole local file
            split = args.dataset_test_split
            with user_input("--dataset_name: "):
                test = load_math_dataset(
                    dataset_name, split=split, config_name=config_name, max_rows=args.num_eval, **load
                )
            source = f"--dataset_name {dataset_name} (split {args.dataset_train_split})"
        columns = (train_rows if train_rows is not None else test).column_names
        kind = "math" if (load["kind"] or infer_kind(columns)) == "math" else "gsm8k"
        dataset = dataset_name
    name, grader = _grader(args.reward, text, kind)
    task = Task(
        name=name,
        train=train_rows,
        test=test,
        # a response that repeats the template's own "<answer> answer here </answer>" has no format
        scorer=answer_scorer(
            rewards.without_copied_format(grader.reward_fn, R1_ZERO_TEMPLATE if text == "r1_zero" else text)
        ),
        extractor=None if grader.extract is None else (lambda response, row, fn=grader.extract: fn(response)),
        rewards=((f"{name}_reward", "reward"),),
        dataset=dataset,
        source=source,
        description=f"{template_label(text)} prompt, {name} reward",
        template=text,
        max_new_tokens=max_new_tokens,
        batch_size=args.eval_batch_size,
        stop=template_stop_strings(text),
        credit_truncated=grader.credit_truncated,
    )
    return task


def answer_scorer(reward_fn: Callable[[str, str], Mapping[str, float]]) -> Scorer:
    """A row scorer from a course ``reward_fn(response, ground_truth)``: it reads the row's ``answer``."""

    def score(response: str, row: Mapping[str, Any]) -> Mapping[str, float]:
        return reward_fn(response, str(row["answer"]))

    score.__qualname__ = getattr(reward_fn, "__qualname__", "reward_fn")
    return score


@register_task(
    "arithmetic",
    "arithmetic",
    "generated additions; the default without --dataset_name",
    options=(*EVERY_TASK, *PROMPT, "reward", "num_train_problems", "arithmetic_digits"),
    rows="it generates its problems",
)
def arithmetic_task(
    options: Any, max_new_tokens: int, train: bool = True, template: str | None = None, digits: int | None = None
) -> Task:
    """Generated arithmetic (:func:`math_task`); ``digits`` replaces ``--arithmetic_digits``."""
    options = replace(options, arithmetic_digits=digits) if digits is not None else options
    return math_task(options, max_new_tokens, "arithmetic", template=template, train=train)


DATASET_KIND = {"options": (*NO_CONFIG, *PROMPT, "reward", *DATASET), "rows": "its rows are a dataset's"}
"""What the two dataset kinds (``gsm8k``, ``math``) declare: the same options."""


@register_task(
    "gsm8k", "gsm8k", "a --dataset_name file or Hub dataset, default openai/gsm8k; last-number grader", **DATASET_KIND
)
def gsm8k_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """GSM8K-style rows (:func:`math_task`)."""
    return math_task(options, max_new_tokens, "gsm8k", template=template, train=train)


@register_task(
    "math", "math", "a --dataset_name file or Hub dataset, default MATH-500; math-verify grader", **DATASET_KIND
)
def competition_math_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """MATH-style rows (:func:`math_task`)."""
    return math_task(options, max_new_tokens, "math", template=template, train=train)
