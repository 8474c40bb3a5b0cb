"""Callbacks every GRPO recipe uses: held-out evaluation every N optimizer steps, logged at its step, and a few
rollouts of each step written to ``rollouts.jsonl`` (``--eval_every``, ``--rollouts``; ``trl_ext.run.RecipeRun``
attaches them, and ``trl_ext.compare.ArmMonitor`` times an arm on top of the first)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


class HeldOutEvaluation(TrainerCallback):
    """Held-out evaluation after chosen optimizer steps, logged at that step.

    Attach with :meth:`attach` after building the trainer. The evaluation runs in ``on_step_end``, on the main
    process, after the step's optimizer update. Its results are appended to ``trainer._metrics["train"]`` as
    ``<prefix>accuracy`` and ``<prefix>format_rate`` (default ``heldout/accuracy``, ``heldout/format_rate``), which
    TRL logs at this step next to its own metrics (every ``report_to`` logger and ``log_history``): an evaluated step
    is always logged, whatever ``logging_steps`` is, so its value is never averaged with a later one. Each result's
    numbers and first responses are kept in :attr:`evals` (:func:`eval_record`).

    Args:
        eval_fn: ``eval_fn(model) -> dict`` with at least ``accuracy`` (e.g. :func:`trl_ext.eval.evaluate_math`
            partially applied); None for no held-out evaluation.
        eval_steps: optimizer steps after which to evaluate (step 0 is not handled here: evaluate the initial model
            before training).
        eval_every: also evaluate after every step that is a multiple of it (None: only ``eval_steps``).
        skip_last: with ``eval_every``, leave out the run's last step (``state.max_steps``), which the caller
            evaluates after training itself.
        prefix: the logged names' prefix (``"eval_"`` logs ``eval_accuracy``, which TensorBoard shows as
            ``eval/accuracy``).

    Raises:
        ValueError: ``eval_every`` < 1.
    """

    def __init__(
        self,
        eval_fn: Callable[[Any], Mapping[str, Any]] | None = None,
        eval_steps: Sequence[int] = (),
        *,
        eval_every: int | None = None,
        skip_last: bool = False,
        prefix: str = "heldout/",
    ):
        if eval_every is not None and eval_every < 1:
            raise ValueError(f"eval_every={eval_every}; expected >= 1 or None")
        self.eval_fn = eval_fn
        self.eval_steps = set(eval_steps)
        self.eval_every, self.skip_last, self.prefix = eval_every, skip_last, prefix
        self.evals: list[dict[str, Any]] = []
        self.trainer: Any = None

    def attach(self, trainer: Any) -> HeldOutEvaluation:
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def due(self, step: int, max_steps: int) -> bool:
        """Whether the held-out evaluation runs after optimizer step ``step`` of ``max_steps``."""
        if self.eval_fn is None:
            return False
        every = self.eval_every is not None and step % self.eval_every == 0
        return step in self.eval_steps or (every and not (self.skip_last and step >= max_steps))

    def on_step_end(self, args, state, control, **kwargs):
        if not self.due(state.global_step, state.max_steps):
            return
        trainer = self.trainer
        if trainer.accelerator.is_main_process:
            result = self.eval_fn(trainer.accelerator.unwrap_model(trainer.model))
            self.evals.append(eval_record(state.global_step, result))
            trainer._metrics["train"][f"{self.prefix}accuracy"].append(float(result["accuracy"]))
            if "format_rate" in result:
                trainer._metrics["train"][f"{self.prefix}format_rate"].append(float(result["format_rate"]))
        trainer.accelerator.wait_for_everyone()
        if args.logging_strategy != "no":
            control.should_log = True  # logged at this step, not averaged into a later step's log
        return control


class RolloutLog(TrainerCallback):
    """Writes a few of each optimizer step's rollouts to a JSON-lines file (``rollouts.jsonl`` in a recipe's output
    folder), one object per sample: ``step``, ``prompt``, ``response``, the scores ``reward``, ``format_reward``,
    ``answer_reward`` and the row's ``answer`` (where the reward function logged them), each reward function's value
    under ``rewards``, and the ``advantage`` the loss used.

    It reads what TRL's ``GRPOTrainer`` keeps for its completions table (``trainer._logs``, TRL 1.16: the prompts,
    completions, per-function rewards and advantages of the latest generation batch, gathered from every process;
    trl_ext's trainer replaces the advantages with the course's) and the columns reward functions add to that table
    through TRL's ``log_extra`` (a task's reward function logs its three scores and the answer:
    :func:`trl_ext.rewards.as_trl_row_reward`). A step that generated nothing (its batch was generated at an earlier
    step: ``steps_per_generation`` > ``gradient_accumulation_steps``, ``num_iterations`` > 1) adds no rows; with
    dynamic sampling the rows come from the step's last generation round (the step trains on the informative groups
    of all its rounds). The
    samples are spread evenly over the batch (``samples`` of ``n``: rows ``i * n // samples``), so several groups are
    seen. Main process only; a run that resumes keeps the rows up to its checkpoint's step and drops the rest; a run
    that starts at step 0 starts the file anew. A trainer without that table (not a GRPO trainer) writes nothing and
    says so once.

    Args:
        path: the file.
        samples: rollouts kept per step (>= 1).
    """

    def __init__(self, path: str | os.PathLike, samples: int = 4):
        if samples < 1:
            raise ValueError(f"samples={samples}; expected >= 1")
        self.path, self.samples = Path(path), samples
        self.trainer: Any = None
        self._tokens_seen: int | None = None

    def attach(self, trainer: Any) -> RolloutLog:
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self._tokens_seen = state.num_input_tokens_seen
        if not state.is_world_process_zero:
            return
        if not isinstance(getattr(self.trainer, "_logs", None), Mapping):
            print(
                f"note: {type(self.trainer).__name__} keeps no completions table (trainer._logs): no {self.path.name}",
                file=sys.stderr,
            )
            self.trainer = None
            return
        kept = []
        if state.global_step > 0 and self.path.is_file():  # resumed: the rows up to the checkpoint's step
            kept = [
                line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= state.global_step
            ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in kept))

    def on_step_end(self, args, state, control, **kwargs):
        generated, self._tokens_seen = state.num_input_tokens_seen != self._tokens_seen, state.num_input_tokens_seen
        if self.trainer is None or not generated or not state.is_world_process_zero:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in self.rows(state.global_step))

    def rows(self, step: int) -> list[dict[str, Any]]:
        """The rows written for ``step``: :attr:`samples` of the latest generation batch in ``trainer._logs``."""
        from trl_ext.rewards import completion_text

        logs = self.trainer._logs
        prompts, completions = list(logs["prompt"]), list(logs["completion"])
        n = len(completions)
        picked = range(n) if n <= self.samples else [i * n // self.samples for i in range(self.samples)]
        extra = {k: list(v) for k, v in logs["extra"].items() if len(v) == n}
        rewards = {k: list(v) for k, v in logs["rewards"].items() if len(v) == n}
        advantages = list(logs["advantages"])
        rows = []
        for i in picked:
            row = {"step": step, "prompt": prompts[i], "response": completion_text(completions[i], row=i)}
            row.update(
                {k: json_number(extra[k][i]) for k in ("reward", "format_reward", "answer_reward") if k in extra}
            )
            if "answer" in extra:
                row["answer"] = extra["answer"][i]
            if "truncated" in extra:  # cut by the length limit: a task that does not credit it scored it 0
                row["truncated"] = bool(extra["truncated"][i])
            row["rewards"] = {name: json_number(values[i]) for name, values in rewards.items()}
            row["advantage"] = json_number(advantages[i]) if len(advantages) == n else None
            rows.append(row)
        return rows


def json_number(value: Any) -> float | None:
    """A float for JSON: None and NaN (TRL's "no score") as None."""
    return None if value is None or math.isnan(float(value)) else float(value)


EVAL_KEYS = ("accuracy", "format_rate", "reward", "n", "seconds", "examples_per_second")
"""The numbers of an evaluation result that :func:`eval_record` keeps."""


def eval_record(step: int, result: Mapping[str, Any], num_examples: int = 3) -> dict[str, Any]:
    """The numbers of an evaluation result plus its first responses (``records`` of trl_ext.eval.evaluate_math)."""
    record = {"step": step, **{k: result[k] for k in EVAL_KEYS if k in result}}
    if result.get("records"):
        record["examples"] = [
            {"response": r["response"], "answer": r["answer"]} for r in result["records"][:num_examples]
        ]
    return record
