"""Tasks: what a model trains on and is judged on, each in one object (after nanochat's ``tasks/gsm8k.py``).

A :class:`Task` owns its training prompts and held-out rows, the prompt template they were rendered with, the
reward that trains on them (TRL shape, ``(prompts, completions, **columns) -> list[float]``), the grader and answer
extractor that judge a response (course shape, ``reward_fn(response, ground_truth)``) and its evaluation (greedy,
through :func:`trl_ext.eval.evaluate_math`)::

    task = MathTask.from_args(script_args, max_new_tokens=20)    # data loaded and checked, no model needed
    task.check_fills_one_step(training_args)                     # refuse a set that cannot fill one step
    before = task.evaluate(model, tokenizer, "eval before")      # {"accuracy", "format_rate", "records", ...}
    trainer = trl_ext.GRPOTrainer(model=model, reward_funcs=task.reward_funcs, train_dataset=task.train, ...)

* :class:`MathTask`: GSM8K, MATH (local file or Hub) or generated arithmetic; the grader by dataset kind or
  ``--reward`` (:data:`GRADERS`). Used by ``recipes/grpo_math.py``, ``eval_math.py`` (held-out rows only),
  ``compare_upstream.py``, ``grpo_ablations.py`` (also one task per prompt template) and ``expert_iteration.py``.
* :class:`SortingTask`: the lecture's toy task (sort N numbers), trained on a shaped and an all-or-nothing reward
  and judged by exact match. Used by ``recipes/grpo_sort.py``.

``trl_ext.compare.run_comparison`` trains its arms on a task (and an arm on another task by name).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trl

from trl_ext import rewards
from trl_ext.data import load_math_dataset, make_arithmetic_dataset
from trl_ext.data.math_datasets import infer_kind
from trl_ext.data.sorting import SORT_INSTRUCTION, make_sorting_dataset
from trl_ext.errors import RecipeError, user_input
from trl_ext.eval import evaluate_math
from trl_ext.options import RecipeArguments, check_fills_one_step


def _r1_zero_answer(response: str) -> str | None:
    return rewards.extract_math_answer(response) if "</think> <answer>" in response else None


@dataclass(frozen=True)
class Grader:
    """How one kind of answer is rewarded and judged.

    Attributes:
        reward: TRL reward function, for training.
        reward_fn: course ``reward_fn(response, ground_truth) -> {"reward", "format_reward", "answer_reward"}``,
            for evaluation.
        extract: the answer ``reward_fn`` reads from a response (recorded as ``extracted`` per held-out problem).
    """

    reward: Callable[..., list[float]]
    reward_fn: Callable[[str, str], dict[str, float]]
    extract: Callable[[str], str | None]


GRADERS = {
    "arithmetic": Grader(rewards.arithmetic_reward, rewards.gsm8k_reward_fn, rewards.extract_last_number),
    "gsm8k": Grader(rewards.gsm8k_reward, rewards.gsm8k_reward_fn, rewards.extract_last_number),
    "math": Grader(rewards.math_reward, rewards.math_reward_fn, rewards.extract_math_answer),
    "r1_zero": Grader(rewards.r1_zero_reward, rewards.r1_zero_reward_fn, _r1_zero_answer),
}
"""Grader by ``--reward`` name: ``arithmetic`` and ``gsm8k`` grade the last number of a response, ``math`` a
``\\boxed{}``/``<answer>`` with math-verify, ``r1_zero`` also needs the "</think> <answer> ... </answer>" format."""


@dataclass
class Task:
    """Data, reward and evaluation of one task (see the module docstring).

    Attributes:
        name: the grader's name (``"arithmetic"``, ``"gsm8k"``, ``"math"``, ``"r1_zero"``, ``"sort"``).
        train: training prompts (``prompt`` and the columns the reward reads), or None for an evaluation-only task.
        test: held-out rows (``prompt``, ``answer``).
        reward_funcs: TRL reward function(s) for ``train``.
        reward_fn: course grader of a response against a held-out ``answer``.
        extract: the answer ``reward_fn`` reads (recorded per held-out problem), or None.
        dataset: what the data is, for reports (``"generated arithmetic"``, a file name, a Hub id).
        source: where the training prompts come from, in the user's flags (for messages).
        description: one line for reports (``"chat prompt, arithmetic reward"``).
        template: the prompt template the rows were rendered with.
        max_new_tokens: generation budget of an evaluation.
        batch_size: prompts per ``generate`` call of an evaluation.
    """

    name: str
    train: Any
    test: Any
    reward_funcs: Any
    reward_fn: Callable[[str, str], dict[str, float]]
    extract: Callable[[str], str | None] | None
    dataset: str
    source: str
    description: str
    template: str = "chat"
    max_new_tokens: int = 20
    batch_size: int = 50

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
        """Greedy accuracy of ``model`` on :attr:`test` (:func:`trl_ext.eval.evaluate_math`: ``accuracy``,
        ``format_rate``, ``records``, ``examples``, ...)."""
        return evaluate_math(
            model,
            tokenizer,
            self.test,
            self.reward_fn,
            self.max_new_tokens,
            self.batch_size,
            desc,
            num_examples,
            jsonl_path=jsonl_path,
            disable_progress=not progress,
            extract_fn=self.extract,
        )

    def fingerprint(self) -> dict[str, Any]:
        """What an evaluation's result depends on besides the model: the held-out rows (sha256), the budget, the
        grader and the template (``trl_ext.run.RecipeRun.reuse_or_compute`` keys)."""
        held_out = hashlib.sha256(
            json.dumps([self.test["prompt"], self.test["answer"]], default=str).encode()
        ).hexdigest()
        return {
            "held_out_sha256": held_out,
            "max_new_tokens": self.max_new_tokens,
            "reward": self.name,
            "template": self.template,
        }

    def check_fills_one_step(self, training_args: Any, what: str = "") -> None:
        """Refuse, before any model work, a training set that cannot fill one generation batch of ``training_args``
        (:func:`trl_ext.options.check_fills_one_step`); ``what`` is added to the source (``", arm course"``)."""
        check_fills_one_step(len(self.train), training_args, self.source + what, "prompts")


# ------------------------------------------------------------------------------------------------------------ math
@dataclass
class MathTaskArguments(trl.ScriptArguments, RecipeArguments):
    """A recipe's options for a :class:`MathTask`; ``dataset_name`` None means generated arithmetic."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A local .jsonl/.json/.parquet file (GSM8K columns question/answer, MATH columns "
            "problem/solution or answer) or a Hugging Face Hub dataset id; unset = generated arithmetic."
        },
    )
    dataset_kind: str | None = field(
        default=None,
        metadata={
            "help": "'gsm8k', 'math' or 'arithmetic' (question + integer answer); inferred from the columns when unset."
        },
    )
    template: str = field(
        default="chat", metadata={"help": "Prompt template: 'chat' (instruct models), 'r1_zero' or 'question_only'."}
    )
    instruction: str | None = field(
        default="Answer with just the number.", metadata={"help": "Appended to each question; empty for none."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message for 'chat'."})
    reward: str | None = field(
        default=None,
        metadata={"help": f"One of {sorted(GRADERS)}; default: r1_zero for that template, else by dataset kind."},
    )
    num_train_problems: int = field(default=2000, metadata={"help": "Generated arithmetic training problems."})
    arithmetic_digits: int = field(default=2, metadata={"help": "Digits per operand of generated problems."})
    num_eval: int = field(
        default=200,
        metadata={
            "help": "Held-out problems evaluated (greedy) before and after; a single local file holds out its "
            "last rows (at most a fifth of it), a hub dataset uses dataset_test_split."
        },
    )
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Drop malformed dataset rows with a warning."})


class MathTask(Task):
    """GSM8K, MATH or generated arithmetic (see :class:`Task`); built by :meth:`from_args` or :meth:`held_out`."""

    @staticmethod
    def grader_name(reward: str | None, template: str, kind: str) -> str:
        """``--reward`` when given (must be in :data:`GRADERS`), else ``r1_zero`` for that template, else ``kind``.

        Raises:
            RecipeError: an unknown ``--reward``.
        """
        if reward is not None and reward not in GRADERS:
            raise RecipeError(f"--reward {reward!r} is not supported; expected one of {sorted(GRADERS)}")
        return reward or ("r1_zero" if template == "r1_zero" else kind)

    @classmethod
    def from_args(cls, args: MathTaskArguments, max_new_tokens: int, template: str | None = None) -> MathTask:
        """Train and held-out rows from a recipe's options.

        ``--dataset_name`` unset: generated arithmetic (``num_train_problems`` training, ``num_eval`` held out).
        A local .jsonl/.json/.parquet file: its last rows are held out (at most a fifth). Anything else: a Hub
        dataset, held out = ``--dataset_test_split`` (its first ``num_eval`` rows). ``template`` replaces the
        options' template (and their ``--reward``: the grader follows the template), for experiments that compare
        prompts.

        Raises:
            RecipeError: an unknown ``--reward`` (before any data is read), or data that cannot be used, naming
                ``--dataset_name`` and the file, row and problem.
        """
        if template is not None:
            args = replace(args, template=template, reward=None)
        cls.grader_name(args.reward, args.template, "gsm8k")  # an unknown --reward fails before any data is read
        common = dict(template=args.template, system_prompt=args.system_prompt, instruction=args.instruction or None)
        with user_input("--dataset_name: " if args.dataset_name else ""):
            if args.dataset_name is None:
                gen = dict(digits=args.arithmetic_digits, **common)
                train = make_arithmetic_dataset(args.num_train_problems, seed=0, split="train", **gen)
                test = make_arithmetic_dataset(args.num_eval, seed=1, split="test", **gen)
                kind, source = "arithmetic", f"--num_train_problems {args.num_train_problems}"
            else:
                load = dict(
                    kind=args.dataset_kind, config_name=args.dataset_config, skip_bad_rows=args.skip_bad_rows, **common
                )
                train = load_math_dataset(args.dataset_name, split=args.dataset_train_split, **load)
                if Path(args.dataset_name).is_file():  # one local file: hold out its last rows (at most a fifth)
                    if len(train) < 2:
                        raise RecipeError(
                            f"--dataset_name {args.dataset_name}: {len(train)} usable row(s); need at "
                            "least 2 (training rows plus held-out rows)"
                        )
                    held_out = max(1, min(args.num_eval, len(train) // 5))
                    cut = len(train) - held_out
                    test, train = train.select(range(cut, len(train))), train.select(range(cut))
                    rows = f"{len(test)} row{'s' if len(test) != 1 else ''}"
                    source = f"--dataset_name {args.dataset_name} (its last {rows} held out for evaluation)"
                else:
                    test = load_math_dataset(
                        args.dataset_name, split=args.dataset_test_split, max_rows=args.num_eval, **load
                    )
                    source = f"--dataset_name {args.dataset_name} (split {args.dataset_train_split})"
                kind = "math" if "problem" in train.column_names else "gsm8k"
        name = cls.grader_name(args.reward, args.template, kind)
        grader = GRADERS[name]
        return cls(
            name=name,
            train=train,
            test=test,
            reward_funcs=grader.reward,
            reward_fn=grader.reward_fn,
            extract=grader.extract,
            dataset=args.dataset_name or "generated arithmetic",
            source=source,
            description=f"{args.template} prompt, {name} reward",
            template=args.template,
            max_new_tokens=max_new_tokens,
            batch_size=args.eval_batch_size,
        )

    @classmethod
    def held_out(
        cls,
        dataset_name: str | None = None,
        *,
        split: str = "test",
        kind: str | None = None,
        config_name: str | None = None,
        template: str = "chat",
        instruction: str | None = "Answer with just the number.",
        system_prompt: str | None = None,
        reward: str | None = None,
        num_eval: int = 200,
        arithmetic_digits: int = 2,
        skip_bad_rows: bool = False,
        max_new_tokens: int = 24,
        batch_size: int = 50,
    ) -> MathTask:
        """An evaluation-only task (no training rows): the first ``num_eval`` rows of ``split`` of a local file or
        Hub dataset (a local file is read whole), or ``num_eval`` generated ``arithmetic_digits``-digit additions
        (graded as GSM8K: the last number). Used by ``recipes/eval_math.py``.

        Raises:
            RecipeError: an unknown ``reward`` or unusable data (naming ``--dataset_name``).
        """
        cls.grader_name(reward, template, "gsm8k")
        common = dict(template=template, system_prompt=system_prompt, instruction=instruction or None)
        with user_input("--dataset_name: " if dataset_name else ""):
            if dataset_name is None:
                data = make_arithmetic_dataset(num_eval, seed=1, split="test", digits=arithmetic_digits, **common)
                kind = "gsm8k"
            else:
                data = load_math_dataset(
                    dataset_name,
                    split=split,
                    kind=kind,
                    config_name=config_name,
                    skip_bad_rows=skip_bad_rows,
                    max_rows=num_eval,
                    **common,
                )
                kind = "math" if (kind or infer_kind(data.column_names)) == "math" else "gsm8k"
        name = cls.grader_name(reward, template, kind)
        grader = GRADERS[name]
        return cls(
            name=name,
            train=None,
            test=data,
            reward_funcs=grader.reward,
            reward_fn=grader.reward_fn,
            extract=grader.extract,
            dataset=dataset_name or f"generated {arithmetic_digits}-digit addition",
            source=f"--dataset_name {dataset_name}" if dataset_name else f"--num_eval {num_eval}",
            description=f"{template} prompt, {name} reward",
            template=template,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
        )


# --------------------------------------------------------------------------------------------------------- sorting
@dataclass
class SortingTaskArguments(RecipeArguments):
    """A recipe's options for a :class:`SortingTask`."""

    num_numbers: int = field(default=3, metadata={"help": "N, numbers per prompt."})
    max_number: int = field(default=99, metadata={"help": "Numbers are drawn from 0..max_number (distinct)."})
    num_train_problems: int = field(default=1000, metadata={"help": "Training prompts."})
    num_eval: int = field(default=50, metadata={"help": "Held-out prompts evaluated greedily."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    instruction: str = field(default=SORT_INSTRUCTION, metadata={"help": "Appended to each question."})


class SortingTask(Task):
    """Sort N distinct numbers (the lecture's toy task): trained on ``sort_shaped_reward`` (inclusion plus ordering,
    at most 2N-1) and ``sort_exact_reward`` (all or nothing), judged by exact match (``sort_shaped_reward_fn``'s
    ``answer_reward``)."""

    @classmethod
    def from_args(cls, args: SortingTaskArguments, max_new_tokens: int) -> SortingTask:
        data = dict(num_numbers=args.num_numbers, high=args.max_number, instruction=args.instruction)
        return cls(
            name="sort",
            train=make_sorting_dataset(args.num_train_problems, seed=0, split="train", **data),
            test=make_sorting_dataset(args.num_eval, seed=1, split="test", **data),
            reward_funcs=[rewards.sort_shaped_reward, rewards.sort_exact_reward],
            reward_fn=rewards.sort_shaped_reward_fn,
            extract=None,
            dataset=f"sort {args.num_numbers} distinct numbers from 0..{args.max_number}",
            source=f"--num_train_problems {args.num_train_problems}",
            description=f"sort {args.num_numbers} numbers, shaped + exact rewards",
            max_new_tokens=max_new_tokens,
            batch_size=args.eval_batch_size,
        )
