"""The lecture's sorting task: sort N numbers, scored with shaped and exact rewards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl_ext import rewards
from trl_ext.data.sorting import SORT_INSTRUCTION, make_sorting_dataset
from trl_ext.errors import user_input
from trl_ext.options import RecipeArguments
from trl_ext.tasks.base import Task
from trl_ext.tasks.math import answer_scorer
from trl_ext.tasks.options import (
    EVERY_TASK,
    register_task,
)


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


@register_task(
    "sort",
    "sort",
    "the lecture's toy task: sort N numbers, shaped + exact rewards",
    options=(*EVERY_TASK, "instruction", "system_prompt", "num_train_problems"),
    rows="it generates its problems and scores them with the sorting reward",
)
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
        scorer=answer_scorer(rewards.sort_shaped_reward_fn),
        rewards=(("sort_shaped_reward", "reward"), ("sort_exact_reward", "answer_reward")),
        dataset=f"sort {data['num_numbers']} distinct numbers from 0..{data['high']}",
        source=f"--num_train_problems {args.num_train_problems}",
        description=f"sort {data['num_numbers']} numbers, shaped + exact rewards",
        max_new_tokens=max_new_tokens,
        batch_size=args.eval_batch_size,
    )
