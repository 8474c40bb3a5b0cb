"""What every recipe's options share below the command line (a leaf beside :mod:`trl_ext.errors`).

:class:`RecipeArguments` holds the options every recipe has (mixed into each recipe's own arguments dataclass, and
into ``trl_ext.tasks``' task arguments); :func:`check_fills_one_step` refuses, before any model work, a training set
from which the trainer would take no batch. Both are used by :mod:`trl_ext.tasks` and by the recipes (through
:mod:`trl_ext.cli`, which re-exports them), so they sit below both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from trl_ext.errors import RecipeError


@dataclass
class RecipeArguments:
    """Options every recipe has (mixed into each recipe's own arguments dataclass)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace a finished run (metrics.json) or an unfinished run's checkpoints in --output_dir. "
            "Without it the recipe refuses, so results are never lost; --resume_from_checkpoint true continues an "
            "unfinished run instead."
        },
    )


def check_fills_one_step(rows: int, training_args: Any, source: str, unit: str = "rows") -> None:
    """Refuse, before any model work, a training set from which the trainer would take no batch (0 steps, exit 0).

    GRPO (``training_args`` has ``num_generations``): fewer prompts than one generation batch (``generation_batch_size /
    num_generations``, TRL drops an incomplete one). SFT, DPO, reward: only ``dataloader_drop_last`` with fewer rows
    than ``per_device_train_batch_size`` x processes. ``max_steps`` does not help.

    Args:
        rows: training examples (prompts for GRPO).
        training_args: the trainer's config.
        source: what the rows come from, as the user set it (``"--train_file x.jsonl"``).
        unit: what a row is called in the message (``"rows"``, ``"pairs"``, ``"prompts"``).

    Raises:
        RecipeError: naming the numbers and the flags that change them."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    batch = training_args.per_device_train_batch_size
    have = f"{rows} training {unit[:-1] if rows == 1 and unit.endswith('s') else unit}"
    if getattr(training_args, "num_generations", None):
        steps = training_args.steps_per_generation or training_args.gradient_accumulation_steps
        completions = batch * processes * steps
        needed = completions // training_args.num_generations
        if rows < needed:
            which = (
                "--gradient_accumulation_steps"
                if steps == training_args.gradient_accumulation_steps
                else "--steps_per_generation"
            )
            raise RecipeError(
                f"{source}: {have} cannot fill one generation batch of {needed} prompts ({completions} "
                f"completions = --per_device_train_batch_size {batch} x {processes} process(es) x {which} {steps}, in "
                f"groups of --num_generations {training_args.num_generations}), so TRL would train 0 steps; use at "
                f"least {needed} training prompts, or lower --per_device_train_batch_size or {which}"
            )
    elif training_args.dataloader_drop_last and rows < batch * processes:
        raise RecipeError(
            f"{source}: {have} cannot fill one batch of {batch * processes} (--per_device_train_batch_size "
            f"{batch} x {processes} process(es)) with --dataloader_drop_last true, so the trainer would train 0 steps; "
            f"use at least {batch * processes} training {unit}, lower --per_device_train_batch_size, or pass "
            "--dataloader_drop_last false"
        )
