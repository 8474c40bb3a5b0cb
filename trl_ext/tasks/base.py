"""The task: training rows, held-out rows and one judge (:class:`Task`); what the other task modules build."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl_ext import rewards
from trl_ext.data.prompts import TEMPLATES
from trl_ext.errors import RecipeError
from trl_ext.eval import evaluate_rows
from trl_ext.options import check_fills_one_step
from trl_ext.stop_strings import check_stop_strings

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
