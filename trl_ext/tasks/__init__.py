"""Tasks: what a model trains on and is judged on, each in one object (after nanochat's ``tasks/gsm8k.py``).

A :class:`Task` owns its training rows and held-out rows and **one judge**: ``score(response, row) -> {"reward",
"format_reward", "answer_reward"}`` (the course's ``reward_fn`` shape), which sees the whole row (metadata
included), not only an answer string. Everything else is derived from that judge, so training and evaluation can
never judge differently:

* the TRL reward function(s) it trains with (:attr:`Task.reward_funcs`; TRL hands a row's columns to reward
  functions, :func:`trl_ext.rewards.as_trl_row_reward` rebuilds the row);
* held-out accuracy: the mean of the task's own ``answer_reward`` over the held-out rows (partial credit counts as
  the scorer gives it), with per-row records of the row's answer, the extracted answer and the scores
  (:meth:`Task.evaluate`, :func:`trl_ext.eval.evaluate_rows`)::

    task = load_task(script_args, max_new_tokens=20)               # data loaded and the scorer probed, no model
    task.check_fills_one_step(training_args)                       # refuse a set that cannot fill one step
    before = task.evaluate(model, tokenizer, "eval before")        # {"accuracy", "format_rate", "records", ...}
    trainer = trl_ext.GRPOTrainer(model=model, reward_funcs=task.reward_funcs, train_dataset=task.train, ...)

Tasks are named (``--task NAME``), and one function reads the name (:func:`resolve_task`):

* the entries of the registry :data:`TASKS`: the built-ins ``arithmetic`` (generated additions; the default without
  ``--dataset_name``), ``gsm8k`` and ``math`` (a local file or a Hub dataset; with ``--dataset_name`` and no
  ``--task`` the kind is read from its columns), ``sort`` (the lecture's sorting toy task), and yours
  (:func:`register_task`);
* ``reasoning_gym:DATASET``: any generator of the ``reasoning-gym`` library (``uv sync --extra tasks``), scored by
  the generator's own ``score_answer(answer=..., entry=...)`` on the full entry (:func:`reasoning_gym_task`);
* ``package.module:factory``: a task of your own (in the spirit of TRL's dotted paths for reward functions).

``--task_config JSON`` is the factory's keyword arguments, checked against its signature
(:meth:`~trl_ext.tasks.options.TaskFactory.config_problem`); ``factory(**task_config)`` returns a :class:`Task`.

Every problem -- an unknown name, a bad ``--task_config``, a scorer that raises on a probe row -- is one line naming
the flag, before any model loads.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trl_ext import rewards
from trl_ext.data import load_math_dataset, make_arithmetic_dataset
from trl_ext.data.math_datasets import infer_kind
from trl_ext.data.prompts import ANSWER_WITH_NUMBER, R1_ZERO_TEMPLATE, TEMPLATES, format_prompt, template_stop_strings
from trl_ext.data.sorting import SORT_INSTRUCTION, make_sorting_dataset
from trl_ext.errors import RecipeError, read_text, user_input
from trl_ext.eval import evaluate_rows
from trl_ext.options import RecipeArguments, check_fills_one_step
from trl_ext.registry import Registry
from trl_ext.stop_strings import check_stop_strings
from trl_ext.tasks.options import (  # noqa: F401 -- TaskArguments, TASKS, register_task, ... are this module's API
    TASK_OPTIONS,
    TASKS,
    MathTaskArguments,
    TaskArguments,
    TaskFactory,
    as_task_factory,
    option_defaults,
    option_problems,
    register_task,
    task_kind,
    task_label,
)
from trl_ext.tasks.reasoning_gym import (  # noqa: F401 -- the answer formats are this module's API too
    ANSWER_FORMATS,
    REASONING_GYM_PREFIX,
    RG_INSTRUCTIONS,
    answer_extractor,
    choose_answer_format,
    distinct_entries,
    extract_last_line,
    generator_problem,
    import_reasoning_gym,
    seeded_global_generators,
)

Scorer = Callable[[str, Mapping[str, Any]], Mapping[str, float]]
"""``score(response, row) -> {"reward", "format_reward", "answer_reward"}``: a task's one judge."""


# ------------------------------------------------------------------------------------------------------------ Task
@dataclass
class Task:
    """Training rows, held-out rows and one judge (see the module docstring).

    Attributes:
        name: the task's name (``"arithmetic"``, ``"gsm8k"``, ``"reasoning_gym:chain_sum"``, ...).
        train: training rows, a ``datasets.Dataset`` (or ``IterableDataset``) with a ``prompt`` column and the
            columns the scorer reads; None for an evaluation-only task. A column TRL's ``GRPOTrainer`` would keep
            from reward functions (``completion``, ``completion_ids``, ``prompts``, ``completions``,
            ``trainer_state``, ``log_extra``, ``log_metric``, ``environments``:
            :data:`trl_ext.rewards.adapters.TRL_RESERVED_COLUMNS`) is carried under ``trl_ext.<name>`` here, and
            :meth:`score` renames it back, so the scorer sees the same row in training as in evaluation.
        test: held-out rows, a ``datasets.Dataset`` with ``prompt`` and the columns the scorer reads.
        scorer: ``scorer(response, row) -> {"reward", "format_reward", "answer_reward"}``; see :meth:`score`.
        extractor: ``extractor(response, row) -> str | None``, the answer the scorer reads from a response
            (recorded as ``extracted`` per held-out row); None when the task does not say.
        rewards: the TRL reward functions training uses, as ``(function name, score key)`` pairs; default one
            function ``<name>_reward`` returning ``reward`` (TRL logs it as ``rewards/<function name>/mean``).
        answer_column: the row's column recorded as its answer (default ``"answer"``).
        dataset: what the data is, for reports (``"generated arithmetic"``, a file, a Hub id, a generator).
        source: where the training rows come from, in the user's flags (for messages).
        description: one line for reports (``"chat prompt, arithmetic reward"``).
        template: the prompt template the rows were rendered with (a name, or the text of a template file).
        max_new_tokens: generation budget of an evaluation.
        batch_size: prompts per ``generate`` call of an evaluation.
        stop: stop strings: rollouts (``trl_ext.GRPOTrainer`` takes them from :attr:`reward_funcs` when its own
            ``stop_strings`` is unset) and evaluation end a completion with the first one it writes, kept in the
            completion (:mod:`trl_ext.stop_strings`); default none (``"</answer>"`` for the R1-Zero format).
        credit_truncated: False: a response the length limit cut (it ended neither with EOS nor at a stop string)
            earns no credit in training and evaluation (``trl_ext.rewards.without_credit``) -- for tasks that read
            the answer from the end of the response, where the last number of a cut-off sentence would count.
            Default True.
        held_out_note: what a report should say about the held-out rows beside their count (e.g. that the
            generator has fewer distinct questions than asked for); "" for nothing.
    """

    name: str
    train: Any
    test: Any
    scorer: Scorer
    extractor: Callable[[str, Mapping[str, Any]], str | None] | None = None
    rewards: tuple[tuple[str, str], ...] | None = None
    answer_column: str = "answer"
    dataset: str = ""
    source: str = ""
    description: str = ""
    template: str = "chat"
    max_new_tokens: int = 20
    batch_size: int = 50
    stop: tuple[str, ...] = ()
    credit_truncated: bool = True
    held_out_note: str = ""

    def __post_init__(self) -> None:
        self.stop = check_stop_strings(self.stop, f"task {self.name!r}: stop")
        if self.train is not None:
            self.train = rewards.carry_reserved_columns(self.train, f"task {self.name!r}: training rows")

    def score(self, response: str, row: Mapping[str, Any]) -> dict[str, float]:
        """The task's judgement of ``response`` against its whole ``row``: ``{"reward", "format_reward",
        "answer_reward"}`` as floats (``answer_reward`` is what held-out accuracy averages; ``format_reward`` may be
        NaN when the task does not measure a format). Columns carried under ``trl_ext.<name>`` (see :attr:`train`)
        reach the scorer under their own names.

        Raises:
            ValueError: the scorer raised (any exception: the task and the error are named, the exception is the
                ``__cause__``; the callers add the row), or returned something else (the task is named).
        """
        try:
            scores = self.scorer(response, rewards.restore_carried_columns(row))
        except Exception as err:  # noqa: BLE001 -- a user's scorer: whatever it raises is named with its task
            detail = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
            raise ValueError(f"task {self.name!r}: the scorer raised {detail}") from err
        missing = [k for k in rewards.REWARD_KEYS if k not in (scores or {})]
        if missing:
            raise ValueError(f"task {self.name!r}: its scorer returned {scores!r}; missing keys {missing}")
        return {k: float(scores[k]) for k in rewards.REWARD_KEYS}

    def extract(self, response: str, row: Mapping[str, Any]) -> str | None:
        """The answer the scorer reads from ``response`` (None: nothing found, or the task does not say)."""
        return None if self.extractor is None else self.extractor(response, rewards.restore_carried_columns(row))

    def answer(self, row: Mapping[str, Any]) -> Any:
        """The row's reference answer, as recorded with each evaluation."""
        return rewards.restore_carried_columns(row).get(self.answer_column)

    @property
    def reward_keys(self) -> tuple[str, ...]:
        """The scores training rewards (``"reward"`` by default; the sort task adds ``"answer_reward"``)."""
        return tuple(key for _, key in self.rewards) if self.rewards else ("reward",)

    @property
    def reward_funcs(self) -> list[Callable[..., list[float]]]:
        """The TRL reward functions of :attr:`rewards`, each derived from :meth:`score` (one per pair). Each fails,
        naming the cause, when TRL passes none of the training rows' columns (``remove_unused_columns=True``)."""
        pairs = self.rewards or ((f"{self.name.split(':')[-1]}_reward", "reward"),)
        columns = [c for c in rewards.dataset_columns(self.train) if c != "prompt"] if self.train is not None else []
        return [  # the first also adds each completion's scores and answer to TRL's completions table
            rewards.as_trl_row_reward(
                self.score,
                key=key,
                name=name,
                expected_columns=columns,
                log_scores=i == 0,
                answer=self.answer,
                credit_truncated=self.credit_truncated,
                stop_strings=self.stop,
            )
            for i, (name, key) in enumerate(pairs)
        ]

    def evaluate(
        self,
        model: Any,
        tokenizer: Any,
        desc: str = "eval",
        *,
        progress: bool = True,
        num_examples: int = 3,
        jsonl_path: str | Path | None = None,
    ) -> dict[str, Any]:
        """Greedy accuracy of ``model`` on :attr:`test`: the mean ``answer_reward`` of :meth:`score`
        (:func:`trl_ext.eval.evaluate_rows`: ``accuracy``, ``exact_accuracy``, ``format_rate``, ``reward``,
        ``distinct_prompts``, ``num_truncated``, ``records``, ...), generation ending at :attr:`stop` and a cut
        response credited as :attr:`credit_truncated` says; ``held_out_note`` is :attr:`held_out_note`."""
        result = evaluate_rows(
            model,
            tokenizer,
            self.test,
            self.score,
            self.max_new_tokens,
            self.batch_size,
            desc,
            num_examples,
            jsonl_path=jsonl_path,
            disable_progress=not progress,
            answer=self.answer,
            extract=self.extract if self.extractor is not None else None,
            stop_strings=self.stop,
            credit_truncated=self.credit_truncated,
        )
        result["held_out_note"] = self.held_out_note
        return result

    def fingerprint(self) -> dict[str, Any]:
        """What an evaluation's result depends on besides the model: the held-out rows (sha256 of every column),
        the budget, the task and its scorer, the template, the stop strings and the truncation rule
        (``trl_ext.run.RecipeRun.reuse_or_compute`` keys)."""
        rows = [dict(row) for row in self.test]
        held_out = hashlib.sha256(json.dumps(rows, default=str, sort_keys=True).encode()).hexdigest()
        scorer = getattr(self.scorer, "__qualname__", type(self.scorer).__name__)
        template = self.template if self.template in TEMPLATES else hashlib.sha256(self.template.encode()).hexdigest()
        return {
            "held_out_sha256": held_out,
            "max_new_tokens": self.max_new_tokens,
            "reward": self.name,
            "scorer": scorer,
            "template": template,
            "stop": list(self.stop),
            "credit_truncated": self.credit_truncated,
        }

    def check_fills_one_step(self, training_args: Any, what: str = "") -> None:
        """Refuse, before any model work, training rows that would train nothing under ``training_args``: too few to
        fill one generation batch (:func:`trl_ext.options.check_fills_one_step`; TRL would train 0 steps and exit 0),
        or -- with ``remove_unused_columns=True`` -- columns TRL would drop before the scorer sees them. ``what`` is
        added to the source (``", arm course"``).

        A streaming training set (no length) is counted up to the rows one step needs (its first rows are read
        once): a stream with fewer rows than one generation batch is refused as a dataset is (upstream TRL trains 0
        steps on it, with or without dynamic sampling, and only transformers' log says so).

        Raises:
            RecipeError: naming the numbers and the flags that change them, or the columns and the flag.
        """
        if self.train is None:
            return
        columns = [c for c in rewards.dataset_columns(self.train) if c not in ("prompt", "image", "images")]
        if getattr(training_args, "remove_unused_columns", False) and columns:
            raise RecipeError(
                f"--remove_unused_columns true: TRL would drop the columns {columns} of {self.source + what} before "
                f"the task's scorer sees them; pass --remove_unused_columns false (GRPO's default)"
            )
        if hasattr(self.train, "__len__"):
            rows = len(self.train)
        else:  # a stream: count what one step needs, at most (a bound on check_fills_one_step's need)
            steps = getattr(training_args, "steps_per_generation", None) or training_args.gradient_accumulation_steps
            enough = training_args.per_device_train_batch_size * int(os.environ.get("WORLD_SIZE", "1")) * steps
            rows = sum(1 for _ in itertools.islice(iter(self.train), enough))
            if rows >= enough:
                return
        check_fills_one_step(rows, training_args, self.source + what, "prompts")

    def probe(self, flag: str = "--task") -> None:
        """Score the first held-out row with its own answer and with an empty response: a scorer that raises or
        returns something else is reported now, in one line naming ``flag``, not in the middle of training.

        Raises:
            RecipeError: no held-out row, a row without ``prompt``, or the scorer failing on the probe.
        """
        if self.test is None or len(self.test) == 0:
            raise RecipeError(f"{flag} {self.name}: the task has no held-out rows; expected at least one")
        row = dict(self.test[0])
        if "prompt" not in row:
            raise RecipeError(f"{flag} {self.name}: held-out rows have columns {sorted(row)}; expected a 'prompt'")
        for response in (str(self.answer(row) or ""), ""):
            try:
                self.score(response, row)
            except Exception as err:  # noqa: BLE001 -- any failure of a user's scorer is reported, named
                raise RecipeError(
                    f"{flag} {self.name}: the scorer failed on held-out row 0 with the response {response!r} "
                    f"({type(err).__name__}: {err})"
                ) from None


def nothing_to_learn(
    result: Mapping[str, Any], keys: tuple[str, ...] = ("reward",), where: str = "eval_before.jsonl"
) -> str | None:
    """The line to print before training when no reward varies over an evaluation's held-out rows, or None.

    GRPO learns only from groups whose rewards differ, and a NaN reward (TRL's "no score") is left out of a group's
    baseline with advantage 0; so the rule is "nothing to learn: no reward varies": every score of ``keys`` (the
    ones training rewards, :attr:`Task.reward_keys`) has at most one value over the rows, NaN rows aside -- 0
    everywhere, -1 everywhere, NaN everywhere, or 1 everywhere (already solved) alike. A greedy evaluation is a
    proxy for sampled groups (sampling may still find other rewards), hence a warning, not a refusal.

    Args:
        result: an evaluation (:meth:`Task.evaluate`), its ``records`` holding each row's scores.
        keys: the scores training rewards (default ``("reward",)``).
        where: the file holding the evaluation's records, named in the line (written before training).
    """
    records = result.get("records") or []
    if not records:
        return None
    constant = {}
    for key in keys:
        values = {float(r[key]) for r in records if not math.isnan(float(r[key]))}
        if len(values) > 1:
            return None
        constant[key] = f"{values.pop():g}" if values else "NaN (no score)"
    fmt = result.get("format_rate")
    fmt = "" if fmt is None or (isinstance(fmt, float) and math.isnan(fmt)) else f", format rate {fmt:.0%}"
    value = (
        constant["reward"] if list(constant) == ["reward"] else " and ".join(f"{k} {v}" for k, v in constant.items())
    )
    return (
        f"the reward was {value} on all {len(records)} held-out rows before training{fmt}: GRPO learns only from "
        "groups whose rewards differ, so unless sampling finds other rewards this run will not learn (check the "
        f"prompt template and the answer format the scorer expects, e.g. in {where})"
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
    extract: Callable[[str], str | None] | None
    credit_truncated: bool = True


def _dotted_grader(obj: Any, path: str) -> Grader:
    """``--reward package.module:function``: a course ``reward_fn(response, ground_truth)`` as a :class:`Grader`."""
    if isinstance(obj, Grader):
        return obj
    if not callable(obj):
        raise TypeError(f"{path} is a {type(obj).__name__}; expected a function reward_fn(response, ground_truth)")
    return Grader(obj, None)


GRADERS: Registry[Grader] = Registry("grader", "reward", load=_dotted_grader)
"""The math tasks' graders by ``--reward`` name (a :class:`~trl_ext.registry.Registry`: did-you-mean, and
``package.module:function`` for a course ``reward_fn``): ``arithmetic`` and ``gsm8k`` grade the last number of a
response (so a response the length limit cut earns nothing), ``math`` a ``\\boxed{}``/``<answer>`` with math-verify,
``r1_zero`` also needs the "</think> <answer> ... </answer>" format. The chosen grader is the task's scorer."""
GRADERS.register("arithmetic", Grader(rewards.gsm8k_reward_fn, rewards.extract_last_number, credit_truncated=False))
GRADERS.register("gsm8k", Grader(rewards.gsm8k_reward_fn, rewards.extract_last_number, credit_truncated=False))
GRADERS.register("math", Grader(rewards.math_reward_fn, rewards.extract_math_answer))
GRADERS.register("r1_zero", Grader(rewards.r1_zero_reward_fn, _r1_zero_answer))


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
        scorer=_answer_scorer(
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


def _answer_scorer(reward_fn: Callable[[str, str], Mapping[str, float]]) -> Scorer:
    """A row scorer from a course ``reward_fn(response, ground_truth)``: it reads the row's ``answer``."""

    def score(response: str, row: Mapping[str, Any]) -> Mapping[str, float]:
        return reward_fn(response, str(row["answer"]))

    score.__qualname__ = getattr(reward_fn, "__qualname__", "reward_fn")
    return score


# --------------------------------------------------------------------------------------------------------- sorting
@dataclass
class SortingTaskArguments(RecipeArguments):
    """A recipe's options for the sorting task (:func:`sorting_task`)."""

    num_numbers: int = field(default=3, metadata={"help": "N, numbers per prompt."})
    max_number: int = field(default=99, metadata={"help": "Numbers are drawn from 0..max_number (distinct)."})
    num_train_problems: int = field(default=1000, metadata={"help": "Training prompts."})
    num_eval: int = field(default=50, metadata={"help": "Held-out prompts evaluated greedily."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    instruction: str = field(default=SORT_INSTRUCTION, metadata={"help": "Appended to each question ('' for none)."})


def sorting_task(
    options: Any,
    max_new_tokens: int,
    num_numbers: int | None = None,
    max_number: int | None = None,
    instruction: str | None = None,
    system_prompt: str | None = None,
) -> Task:
    """Sort N distinct numbers (the lecture's toy task), judged by ``sort_shaped_reward_fn``: trained on its
    ``reward`` (inclusion plus ordering, at most 2N-1) as ``sort_shaped_reward`` and on its ``answer_reward``
    (exact match, all or nothing) as ``sort_exact_reward``; held-out accuracy is the exact-match rate.

    ``options`` has ``num_train_problems``, ``num_eval``, ``eval_batch_size`` and may have ``num_numbers``,
    ``max_number``, ``instruction`` (unset: :data:`SORT_INSTRUCTION`; ``""``: none) and ``system_prompt``
    (:class:`SortingTaskArguments`); the keyword arguments (``--task_config``), where given, replace them. The prompt
    is a chat conversation.
    """
    config = dict(num_numbers=num_numbers, max_number=max_number, instruction=instruction, system_prompt=system_prompt)
    config = {k: v for k, v in config.items() if v is not None}
    settings = {k: getattr(options, k, None) for k in ("num_numbers", "max_number", "instruction", "system_prompt")}
    settings = {**{"num_numbers": 3, "max_number": 99}, **{k: v for k, v in settings.items() if v is not None}}
    settings.update(config)
    args = options
    instruction = settings.get("instruction")
    data = dict(
        num_numbers=settings["num_numbers"],
        high=settings["max_number"],
        instruction=SORT_INSTRUCTION if instruction is None else instruction or None,
        system_prompt=settings.get("system_prompt"),
    )
    with user_input("--task_config: " if config else ""):
        train = make_sorting_dataset(args.num_train_problems, seed=0, split="train", **data)
        test = make_sorting_dataset(args.num_eval, seed=1, split="test", **data)
    return Task(
        name="sort",
        train=train,
        test=test,
        scorer=_answer_scorer(rewards.sort_shaped_reward_fn),
        rewards=(("sort_shaped_reward", "reward"), ("sort_exact_reward", "answer_reward")),
        dataset=f"sort {data['num_numbers']} distinct numbers from 0..{data['high']}",
        source=f"--num_train_problems {args.num_train_problems}",
        description=f"sort {data['num_numbers']} numbers, shaped + exact rewards",
        max_new_tokens=max_new_tokens,
        batch_size=args.eval_batch_size,
    )


# --------------------------------------------------------------------------------------------------- reasoning-gym
def reasoning_gym_task(
    dataset_name: str,
    options: Any,
    max_new_tokens: int,
    train: bool = True,
    template: str | None = None,
    **config: Any,
) -> Task:
    """A ``reasoning-gym`` generator as a task, scored by the generator's own ``score_answer(answer=...,
    entry=...)`` on the full entry (question, answer and metadata).

    Rows: ``--num_train_problems`` training entries drawn with ``seed`` (default 0) and ``--num_eval`` held-out
    entries with distinct questions drawn with ``seed + 1`` (more are drawn while questions repeat,
    :func:`distinct_entries`; a generator with fewer distinct questions gives fewer held-out rows, and the task's
    ``held_out_note`` says so); training entries whose question is also a held-out question are dropped, so the
    two are disjoint (the source says how many). Each row holds ``prompt`` (the question, plus the answer-format
    instruction, in the ``--template``: a chat conversation by default), ``answer``, ``question``, ``entry_id`` and
    ``entry`` (the whole entry as JSON, for records and for your inspection); the scorer finds the generator's own
    entry by ``entry_id`` (so metadata keeps its types), else decodes ``entry``.

    ``options`` are the recipe's task options (``template`` replaces ``--template``). ``config``
    (``--task_config``) goes to ``reasoning_gym.create_dataset`` except trl_ext's keys:

    * ``seed`` (default 0): the training rows' seed; held-out rows use ``seed + 1``;
    * ``answer_format``: how the answer is read from a response -- ``"last_number"``, ``"last_line"``
      (:func:`extract_last_line`), ``"answer_tag"`` (reasoning-gym's ``<answer>...</answer>`` convention,
      ``reasoning_gym.utils.extract_answer``; no tags, no answer), ``"answer_tag_or_whole"`` (the tags' content, else
      the whole response: a response that is only the answer needs no tags), or ``"auto"`` (default), chosen per
      generator by :func:`choose_answer_format` so that every row's gold answer gets the credit ``score_answer``
      gives it: ``answer_tag`` under the ``r1_zero`` template and template files (their text asks for tags); else the
      first of ``last_number`` (numeric answers), ``last_line`` and ``answer_tag_or_whole`` that reads every gold
      answer of this run's rows -- written alone and written as the instruction asks -- back to its full credit
      (multi-line grids and move lists, sentences whose final period counts, take ``answer_tag_or_whole``);
    * ``instruction``: replaces the answer-format instruction (default: :data:`RG_INSTRUCTIONS` of the format:
      "Answer with just the number." / "Answer with just the answer, on one line." / "If you write anything besides
      the answer, put the answer inside <answer> </answer> tags." / "Put the final answer inside <answer> </answer>
      tags."; none under the ``r1_zero`` template and template files, which say how to answer).

    Rewards: ``format_reward`` is 1 when an answer was found, ``answer_reward`` is ``score_answer``'s value (partial
    credit where the generator gives it; evaluation reports the exact answers beside it), ``reward`` =
    ``answer_reward``. Under every format but ``answer_tag`` the answer is read from the end of the response, so a
    response the length limit cut earns nothing (``credit_truncated=False``; ``--credit_truncated true`` to credit
    it); under the ``r1_zero`` template and template files that close the answer with ``</answer>``, generation stops
    there.

    Raises:
        RecipeError: reasoning-gym missing (naming the ``tasks`` extra), an unknown generator (naming ``--task``), a
            configuration the generator refuses (naming ``--task_config``).
    """
    args = replace(options, template=template) if template is not None else options
    rg = import_reasoning_gym()
    problem = generator_problem(rg, dataset_name)
    if problem:
        raise RecipeError(problem)
    config = dict(config)
    seed = config.pop("seed", 0)
    answer_format = config.pop("answer_format", "auto")
    instruction = config.pop("instruction", None)
    if answer_format not in ANSWER_FORMATS:
        raise RecipeError(f"--task_config: answer_format={answer_format!r}; expected one of {list(ANSWER_FORMATS)}")
    try:  # entries are drawn when indexed; some generators draw from Python's global generator (list_functions)
        test_data, test_entries, drawn = distinct_entries(rg, dataset_name, args.num_eval, seed + 1, config)
        with seeded_global_generators(seed):
            train_data = (
                rg.create_dataset(dataset_name, size=args.num_train_problems, seed=seed, **config) if train else None
            )
            train_entries = [train_data[i] for i in range(len(train_data))] if train else []
    except Exception as err:  # noqa: BLE001 -- the generator validates its own configuration
        raise RecipeError(
            f"--task_config {json.dumps(dict(config))}: reasoning-gym's {dataset_name} refused it "
            f"({type(err).__name__}: {err})"
        ) from None
    text = resolve_template(getattr(args, "template", "chat"))
    if answer_format == "auto":
        answer_format = choose_answer_format(test_entries + train_entries, test_data.score_answer, text)
    if instruction is None:
        given = getattr(args, "instruction", None)
        instruction = given if given is not None else RG_INSTRUCTIONS[answer_format]
        if text not in ("chat", "question_only") and given is None:
            instruction = None  # the template's text says how to answer
    extract = answer_extractor(answer_format)
    entries: dict[str, Mapping[str, Any]] = {}
    held_out_note = ""
    if len(test_entries) < args.num_eval:
        held_out_note = (
            f"{len(test_entries)} distinct questions, not --num_eval {args.num_eval}: {drawn} entries of "
            f"reasoning-gym's {dataset_name}" + (f" {json.dumps(dict(config))}" if config else "") + " held no more"
        )

    def rows(split: str, split_entries: list[Mapping[str, Any]], skip: set[str]) -> list[dict[str, Any]]:
        out = []
        for i, entry in enumerate(split_entries):
            if entry["question"] in skip:
                continue
            entry_id = f"{split}:{i}"
            entries[entry_id] = entry
            prompt = format_prompt(
                entry["question"],
                text,
                system_prompt=getattr(args, "system_prompt", None),
                instruction=instruction or None,
            )
            out.append(
                {
                    "prompt": prompt,
                    "answer": str(entry["answer"]),
                    "question": entry["question"],
                    "entry_id": entry_id,
                    "entry": json.dumps(entry, default=str),
                }
            )
        return out

    from datasets import Dataset

    held_out = rows("test", test_entries, set())
    questions = {e["question"] for e in test_entries}
    train_rows = rows("train", train_entries, questions) if train else None
    dropped = len(train_entries) - len(train_rows) if train else 0

    def score(response: str, row: Mapping[str, Any]) -> dict[str, float]:
        entry = entries.get(row.get("entry_id")) or json.loads(row["entry"])
        answer = extract(response)
        value = float(test_data.score_answer(answer=answer, entry=entry)) if answer is not None else 0.0
        return {"reward": value, "format_reward": float(answer is not None), "answer_reward": value}

    score.__qualname__ = f"reasoning_gym.{dataset_name}.score_answer"
    source = f"--task {REASONING_GYM_PREFIX}{dataset_name} --num_train_problems {args.num_train_problems}"
    if dropped:
        source += f" ({dropped} training rows dropped: their question is held out)"
    return Task(
        name=f"{REASONING_GYM_PREFIX}{dataset_name}",
        train=Dataset.from_list(train_rows) if train else None,
        test=Dataset.from_list(held_out),
        scorer=score,
        extractor=lambda response, row: extract(response),
        rewards=((f"{dataset_name}_reward", "reward"),),
        dataset=f"reasoning-gym {dataset_name}" + (f" {json.dumps(dict(config))}" if config else ""),
        source=source,
        description=f"{template_label(text)} prompt, {answer_format}, reasoning-gym score_answer",
        template=text,
        max_new_tokens=max_new_tokens,
        batch_size=getattr(args, "eval_batch_size", 50),
        stop=template_stop_strings(text),
        credit_truncated=answer_format == "answer_tag",  # the other formats read the end of the response
        held_out_note=held_out_note,
    )


# ------------------------------------------------------------------------------------------------------ registry
@register_task("arithmetic", "arithmetic", "generated additions; the default without --dataset_name")
def arithmetic_task(
    options: Any, max_new_tokens: int, train: bool = True, template: str | None = None, digits: int | None = None
) -> Task:
    """Generated arithmetic (:func:`math_task`); ``digits`` replaces ``--arithmetic_digits``."""
    options = replace(options, arithmetic_digits=digits) if digits is not None else options
    return math_task(options, max_new_tokens, "arithmetic", template=template, train=train)


@register_task("gsm8k", "gsm8k", "a --dataset_name file or Hub dataset, default openai/gsm8k; last-number grader")
def gsm8k_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """GSM8K-style rows (:func:`math_task`)."""
    return math_task(options, max_new_tokens, "gsm8k", template=template, train=train)


@register_task("math", "math", "a --dataset_name file or Hub dataset, default MATH-500; math-verify grader")
def competition_math_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """MATH-style rows (:func:`math_task`)."""
    return math_task(options, max_new_tokens, "math", template=template, train=train)


register_task("sort", "sort", "the lecture's toy task: sort N numbers, shaped + exact rewards")(sorting_task)


def _dataset_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """A --dataset_name without --task: the kind its columns (or --dataset_kind) say."""
    return math_task(options, max_new_tokens, None, template=template, train=train)


def resolve_task(values: Mapping[str, Any]) -> TaskFactory:
    """The one resolver of ``--task``: the :class:`~trl_ext.tasks.options.TaskFactory` that ``values`` name.

    ``--task`` is a name of :data:`TASKS` (the built-ins, and tasks registered with :func:`register_task`),
    ``reasoning_gym:DATASET`` (:func:`reasoning_gym_task` for that generator) or ``package.module:factory`` (imported
    once by the registry); unset, generated arithmetic, or with ``--dataset_name`` the math kind its columns say.

    Raises:
        RecipeError: one line naming ``--task``: an unknown name (with the closest registered names), reasoning-gym
            missing or without that generator, a dotted path that does not import or names no function.
    """
    name = values.get("task")
    if name is None:
        if not values.get("dataset_name"):
            return as_task_factory(TASKS.get("arithmetic"))
        return TaskFactory(_dataset_task, task_kind(values), _dataset_task.__doc__)
    if not isinstance(name, str):
        raise RecipeError(f"--task {name!r}: expected a task name, 'reasoning_gym:DATASET' or 'package.module:factory'")
    if name.startswith(REASONING_GYM_PREFIX):
        dataset_name = name[len(REASONING_GYM_PREFIX) :]
        problem = generator_problem(import_reasoning_gym(), dataset_name)
        if problem:
            raise RecipeError(problem)
        make = functools.partial(reasoning_gym_task, dataset_name)
        return TaskFactory(make, "reasoning_gym", f"reasoning-gym's {dataset_name}")
    problem = TASKS.problem(name, flag=True)
    if problem:
        own = ", 'reasoning_gym:DATASET' or 'package.module:factory'"
        raise RecipeError(problem.replace(", or a package.module:attr of your own", own))
    return as_task_factory(TASKS.get(name))


def parse_task_config(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--task_config``'s JSON object as a dict ({} when unset).

    Raises:
        RecipeError: not valid JSON, or not an object (naming ``--task_config``).
    """
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecipeError(f"--task_config {text!r}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise RecipeError(f"--task_config {text!r}: expected a JSON object of settings, got {type(value).__name__}")
    return value


def _resolved(values: Mapping[str, Any]) -> tuple[TaskFactory, dict[str, Any]]:
    """``(factory, task_config)`` of ``values``, the config checked against the factory's signature (RecipeError)."""
    factory = resolve_task(values)
    config = parse_task_config(values.get("task_config"))
    takes_config = "task_config" in TASK_OPTIONS[factory.kind]  # else option_problems refuses --task_config
    problem = factory.config_problem(config, task_label(values)) if config and takes_config else None
    if problem:
        raise RecipeError(problem)
    return factory, config


def task_problem(values: Mapping[str, Any]) -> str | None:
    """What is wrong with ``--task``/``--task_config`` before any data is read (for ``trl_ext.cli.parse``, which
    reports every problem at once), or None: whatever :func:`resolve_task` refuses, a config that is not a JSON
    object, or a key the task's factory does not take (naming the keys it takes). A ``--task_config`` given to a task
    that takes none is :func:`option_problems`' to report."""
    try:
        _resolved(values)
    except RecipeError as err:
        return str(err)
    return None


def load_task(
    args: Any, max_new_tokens: int, *, template: str | None = None, train: bool = True, task: str | None = None
) -> Task:
    """The task a recipe's options name (``--task``, ``--task_config``), its rows loaded and its scorer probed.

    Args:
        args: the recipe's :class:`TaskArguments` (or options with the fields a task reads).
        max_new_tokens: generation budget of an evaluation.
        template: replaces ``--template`` (math tasks; the experiment that compares prompts).
        train: False loads the held-out rows only (``recipes/eval_math.py``).
        task: the task, for a recipe whose options have no ``--task`` (``recipes/grpo_sort.py``: ``"sort"``).

    ``--task`` is resolved by :func:`resolve_task` and ``--task_config`` passed as the factory's keyword arguments
    (checked against its signature); every option set that the task does not use is refused
    (:func:`trl_ext.tasks.options.option_problems`; an option counts as set here when it differs from its dataclass
    default), so is a ``template`` for a task that takes none.

    Raises:
        RecipeError: whatever :func:`task_problem` finds, an option the task does not use, a task that cannot load
            its data, a factory that does not return a :class:`Task`, or a scorer that fails on a probe row -- one
            line naming the flag.
    """
    values = dict(args) if isinstance(args, Mapping) else vars(args)
    defaults = option_defaults() if isinstance(args, Mapping) else option_defaults(type(args))
    if task is not None:
        values = {**values, "task": task}
    factory, config = _resolved(values)
    problems = option_problems(values, defaults=defaults, held_out_only=not train)
    name = values.get("task")
    if template is not None and "template" not in TASK_OPTIONS[factory.kind]:
        problems.append(f"--task {name}: takes no --template, so its prompts cannot be compared across templates")
    if problems:
        raise RecipeError(problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems))
    given = {"options": args, "max_new_tokens": max_new_tokens, "train": train, "template": template}
    result = factory(**{k: v for k, v in given.items() if factory.takes(k)}, **config)
    if not isinstance(result, Task):
        raise RecipeError(f"--task {name}: returned a {type(result).__name__}; expected a trl_ext.tasks.Task")
    if not factory.takes("options"):  # a factory's own rows: --num_eval, --eval_batch_size and the budget applied
        result = _with_evaluation_options(result, values, defaults, max_new_tokens)
    result = _with_generation_options(result, args)
    result.probe()
    return result


def _with_generation_options(task: Task, args: Any) -> Task:
    """``task`` with ``--stop`` and ``--credit_truncated`` applied where given (``--stop ''``: no stop string).

    Raises:
        RecipeError: a ``--stop`` entry that is empty beside others.
    """
    changes: dict[str, Any] = {}
    stop = getattr(args, "stop", None)
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stop == [""] or not stop:
            changes["stop"] = ()
        else:
            try:
                changes["stop"] = check_stop_strings(stop, "--stop")
            except ValueError as err:
                raise RecipeError(str(err).replace("--stop=", "--stop ") + " (--stop '' alone: none)") from None
    if getattr(args, "credit_truncated", None) is not None:
        changes["credit_truncated"] = bool(args.credit_truncated)
    return replace(task, **changes) if changes else task


def _with_evaluation_options(
    task: Task, values: Mapping[str, Any], defaults: Mapping[str, Any], max_new_tokens: int
) -> Task:
    """A factory's task with the evaluation budget set, its held-out rows cut to ``--num_eval`` and its evaluation
    batch set to ``--eval_batch_size`` when those are set (differ from their defaults)."""
    changes: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    num_eval, batch_size = values.get("num_eval"), values.get("eval_batch_size")
    if num_eval is not None and num_eval != defaults.get("num_eval") and task.test is not None:
        keep = min(num_eval, len(task.test))
        changes["test"] = task.test.select(range(keep)) if hasattr(task.test, "select") else task.test[:keep]
    if batch_size is not None and batch_size != defaults.get("eval_batch_size"):
        changes["batch_size"] = batch_size
    return replace(task, **changes)
