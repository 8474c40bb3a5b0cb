"""The one loader of tasks: ``--task`` read in one place (:func:`resolve_task`), options a task does not use
refused (:func:`option_problems`), rows loaded and the scorer probed (:func:`load_task`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, is_dataclass, replace
from typing import Any

from trl_ext.errors import RecipeError
from trl_ext.stop_strings import check_stop_strings
from trl_ext.tasks.base import Task
from trl_ext.tasks.math import math_task
from trl_ext.tasks.options import (
    FAMILIES,
    KIND_ROWS,
    OPTION_ALIASES,
    TASK_OPTION_NAMES,
    TASK_OPTIONS,
    TASKS,
    UNUSED_WHEN,
    TaskFactory,
    as_task_factory,
    families_said,
    option_defaults,
    task_label,
)


def _dataset_task(options: Any, max_new_tokens: int, train: bool = True, template: str | None = None) -> Task:
    """A --dataset_name without --task: the kind its columns (or --dataset_kind) say."""
    return math_task(options, max_new_tokens, None, template=template, train=train)


def _named(values: Mapping[str, Any]) -> tuple[TaskFactory | None, str]:
    """The one dispatch on a task's name: ``(entry, member)`` for ``values``' ``--task`` -- a registered name, a
    family's ``NAME:MEMBER`` (the member after the colon), or, unset, generated arithmetic or a ``--dataset_name``
    dataset (``math`` when ``--dataset_kind math``, else ``gsm8k``: both use the same options) -- else ``(None,
    "")`` (a ``package.module:factory`` path, or no task)."""
    name = values.get("task")
    if name is None:
        if not values.get("dataset_name"):
            return TASKS.get("arithmetic"), ""
        kind = "math" if values.get("dataset_kind") == "math" else "gsm8k"
        return TaskFactory(_dataset_task, kind, _dataset_task.__doc__), ""
    if not isinstance(name, str):
        return None, ""
    family, colon, member = name.partition(":")
    if family in FAMILIES and (colon or name == family):
        return FAMILIES.get(family), member
    return (TASKS.get(name), "") if name in TASKS else (None, "")


def task_kind(values: Mapping[str, Any]) -> str | None:
    """The kind of task (:data:`~trl_ext.tasks.options.TASK_OPTIONS`' keys) that ``values`` (``--task``,
    ``--dataset_name``, ``--dataset_kind``) name -- ``"factory"`` for a ``package.module:factory`` path -- or None
    for a name that is none of them (nothing is imported)."""
    entry, _ = _named(values)
    if entry is not None:
        return entry.kind
    name = values.get("task")
    return "factory" if isinstance(name, str) and ":" in name else None


def resolve_task(values: Mapping[str, Any]) -> TaskFactory:
    """The one resolver of ``--task``: the :class:`~trl_ext.tasks.options.TaskFactory` that ``values`` name.

    ``--task`` is a name of :data:`TASKS` (the built-ins, and tasks registered with :func:`register_task`), a
    family's ``NAME:MEMBER`` (``reasoning_gym:DATASET``: :func:`~trl_ext.tasks.reasoning_gym.reasoning_gym_task`
    for that generator) or ``package.module:factory`` (imported once by the registry); unset, generated arithmetic,
    or with ``--dataset_name`` the math kind its columns say.

    Raises:
        RecipeError: one line naming ``--task``: an unknown name (with the closest registered names), a family
            without its member (or reasoning-gym missing, or without that generator), a dotted path that does not
            import or names no function.
    """
    name = values.get("task")
    entry, member = _named(values)
    if entry is not None and entry.family:
        if not member:
            raise RecipeError(f"--task {name!r}: expected {name}:{entry.family}")
        return replace(entry, make=entry.make(member), description=f"{entry.description}: {member}", family="")
    if entry is not None:
        return entry
    if not isinstance(name, str):
        raise RecipeError(f"--task {name!r}: expected a task name, {families_said()} or 'package.module:factory'")
    problem = TASKS.problem(name, flag=True)
    if problem:
        own = f", {families_said()} or 'package.module:factory'"
        raise RecipeError(problem.replace(", or a package.module:attr of your own", own))
    return as_task_factory(TASKS.get(name))


def option_problems(
    values: Mapping[str, Any] | Any,
    given: Mapping[str, str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    held_out_only: bool = False,
) -> list[str]:
    """Every task option that is set but that the task does not use (:data:`TASK_OPTIONS`, :data:`UNUSED_WHEN`), one
    line each, naming the flag, its value, the task and what the task takes. (The ``--task_config`` keys are checked
    against the task factory's signature by ``trl_ext.tasks.task_problem``.)

    Args:
        values: the parsed options (``{name: value}``, or a :class:`TaskArguments`).
        given: option name -> where the user set it (``""`` for the command line, else the ``--config`` file); None
            (callers from Python): every option counts as given.
        defaults: each option's default (default: ``values``' own dataclass defaults, else :class:`TaskArguments`');
            an option at its default is not set.
        held_out_only: only held-out rows will be loaded (``recipes/eval_math.py``).

    Returns:
        The problems (empty when every option set is used, or when ``--task`` names no known kind: that is
        ``trl_ext.tasks.task_problem``'s to report).
    """
    if not isinstance(values, Mapping):
        defaults = defaults if defaults is not None else option_defaults(type(values))
        values = vars(values) if is_dataclass(values) else dict(values)
    defaults = defaults if defaults is not None else option_defaults()
    kind = task_kind(values)
    if kind is None:
        return []
    used, problems = TASK_OPTIONS[kind], []
    context = {**values, "_held_out_only": held_out_only}

    def is_set(name: str) -> bool:
        return name in values and (given is None or name in given) and values[name] != defaults.get(name, MISSING)

    def where(name: str) -> str:
        return f" (set in {given[name]})" if given and given.get(name) else ""

    for name in [n for n in values if n in TASK_OPTION_NAMES or n in OPTION_ALIASES]:
        option = OPTION_ALIASES.get(name, name)
        if not is_set(name):
            continue
        shown = f"--{name} {values[name]!r}{where(name)}"
        if option not in used:
            takes = ", ".join(f"--{o}" for o in used)
            label = task_label(values)
            problems.append(f"{shown}: not used by {label} ({KIND_ROWS[kind]}; it takes {takes}); remove it")
            continue
        why = next((why for o, when, why in UNUSED_WHEN if o == option and when(context)), None)
        if why:
            problems.append(f"{shown}: not used ({why}); remove it")
    return problems


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
