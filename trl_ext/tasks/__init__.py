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

# the task modules, bottom first: each registers its tasks in TASKS when imported
from trl_ext.tasks.base import (  # noqa: F401 -- this package's API
    Scorer,
    Task,
    nothing_to_learn,
)
from trl_ext.tasks.loader import (  # noqa: F401 -- this package's API
    load_task,
    option_problems,
    parse_task_config,
    resolve_task,
    task_kind,
    task_problem,
)
from trl_ext.tasks.math import (  # noqa: F401 -- this package's API
    GRADERS,
    Grader,
    arithmetic_task,
    competition_math_task,
    default_instruction,
    gsm8k_task,
    math_task,
    resolve_template,
    template_label,
)
from trl_ext.tasks.options import (  # noqa: F401 -- this package's API
    FAMILIES,
    TASK_OPTIONS,
    TASKS,
    MathTaskArguments,
    TaskArguments,
    TaskFactory,
    as_task_factory,
    option_defaults,
    register_task,
    task_label,
)
from trl_ext.tasks.reasoning_gym import (  # noqa: F401 -- this package's API
    ANSWER_FORMATS,
    REASONING_GYM_PREFIX,
    RG_INSTRUCTIONS,
    answer_extractor,
    choose_answer_format,
    distinct_entries,
    extract_last_line,
    generator_problem,
    import_reasoning_gym,
    reasoning_gym_task,
    seeded_global_generators,
)
from trl_ext.tasks.sort import (  # noqa: F401 -- this package's API
    SortingTaskArguments,
    sorting_task,
)
