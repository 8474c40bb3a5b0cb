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

    Attach with :meth:`attach`. Runs in ``on_step_end`` on the main process; results go to ``trainer._metrics["train"]``
    as ``<prefix>accuracy`` and ``<prefix>format_rate``, and an evaluated step is always logged. Each result is kept in
    :attr:`evals` (:func:`eval_record`).

    Args:
        eval_fn: ``eval_fn(model) -> dict`` with at least ``accuracy``; None for none.
        eval_steps: optimizer steps after which to evaluate (not step 0).
        eval_every: also every multiple of it (None: only ``eval_steps``).
        skip_last: with ``eval_every``, leave out the last step (the caller evaluates after training).
        prefix: the logged names' prefix (default ``"heldout/"``; ``"eval_"`` shows as ``eval/accuracy``).

    Raises:
        ValueError: ``eval_every`` < 1."""

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
    """Writes a few of each optimizer step's rollouts to a JSON-lines file, one object per sample: ``step``, ``prompt``,
    ``response``, ``reward``, ``format_reward``, ``answer_reward``, ``answer`` (where logged), ``rewards`` per function
    and the ``advantage`` the loss used.

    Reads TRL 1.16's completions table (``trainer._logs``, every process's latest generation batch, with the columns
    reward functions add through ``log_extra``). A step that generated nothing adds no rows; ``samples`` rows spread
    evenly over the batch. Main process only; a resumed run keeps the rows up to its checkpoint's step, a fresh one
    starts the file anew; a trainer without the table writes nothing and says so once.

    Args:
        path: the file.
        samples: rollouts kept per step (>= 1)."""

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
