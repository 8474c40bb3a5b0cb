"""Which options each kind of task uses, as data: the one table the checks and the tests read.

A recipe's task options (:class:`TaskArguments`: ``--dataset_name``, ``--test_file``, ``--template``, ``--reward``,
``--num_train_problems``, ...) mean something to some tasks only: generated arithmetic reads no file, a
reasoning-gym generator makes its own rows and is scored by its own ``score_answer``, a ``package.module:factory``
task is whatever the factory returns. An option the task does not use is refused, in one line naming the flag,
before any data is read or model loaded (:func:`option_problems`; ``trl_ext.cli.parse`` reports it with every other
problem, ``trl_ext.tasks.load_task`` checks again for callers from Python) -- never silently ignored.

* :data:`TASK_OPTIONS`: task kind (:func:`task_kind`) -> the options it uses;
* :data:`UNUSED_WHEN`: options that a setting of another option makes unused (a local file has no splits; a
  separate ``--test_file`` replaces the held-out split; only the chat template has a system turn);
* :data:`TASKS`: the task registry (``--task NAME``), each entry a :class:`TaskFactory` whose keyword parameters are
  its ``--task_config`` keys (:meth:`TaskFactory.config_problem`); ``trl_ext.tasks`` registers the built-ins and
  resolves ``--task`` (``trl_ext.tasks.resolve_task``).

An option counts as set when its value differs from the dataclass default and -- on the command line, where
``trl_ext.cli`` knows it -- the user set it (a flag or their ``--config`` file; a recipe's own default config does
not count).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import trl

from trl_ext.options import RecipeArguments
from trl_ext.registry import LiveText, Registry

LOADER_PARAMETERS = ("options", "max_new_tokens", "train", "template")
"""Parameters of a task factory that the loader fills, when the factory has them (every other keyword parameter is a
``--task_config`` key): ``options`` (the recipe's task options, a :class:`TaskArguments`), ``max_new_tokens`` (the
evaluation budget), ``train`` (False: held-out rows only), ``template`` (a template replacing ``--template``)."""


@dataclass(frozen=True)
class TaskFactory:
    """A registered task: ``make(**task_config) -> trl_ext.tasks.Task`` and the kind of task it is.

    ``make``'s keyword parameters are the task's ``--task_config`` keys (a ``**kwargs`` parameter takes any key);
    those named in :data:`LOADER_PARAMETERS` are filled by the loader instead. ``kind`` (:data:`TASK_KINDS`) decides
    which recipe options the task uses (:data:`TASK_OPTIONS`); ``"factory"`` (default): none but those every task
    has, the loader cutting the held-out rows to ``--num_eval`` and setting the evaluation batch and budget.

    The first task of a new kind declares, where it is registered, the options its kind uses (``options``: names of
    :data:`TASK_OPTION_NAMES`) and why it uses no others (``rows``, for the messages); :data:`TASK_OPTIONS` is filled
    from these declarations. ``family`` (e.g. ``"DATASET"``) makes the entry a family of tasks named
    ``--task NAME:DATASET``: ``make(member)`` checks the member and returns the member's factory function.
    """

    make: Callable[..., Any]
    kind: str = "factory"
    description: str = ""
    options: tuple[str, ...] | None = None
    rows: str = ""
    family: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.make(*args, **kwargs)

    def _parameters(self) -> list[inspect.Parameter]:
        return list(inspect.signature(self.make).parameters.values())

    def takes(self, name: str) -> bool:
        """Whether the loader passes the :data:`LOADER_PARAMETERS` entry ``name``."""
        return any(p.name == name and p.kind != p.VAR_KEYWORD for p in self._parameters())

    def settings(self) -> tuple[str, ...] | None:
        """The ``--task_config`` keys ``make`` takes, in signature order; None: any (it has ``**kwargs``)."""
        params = self._parameters()
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return None
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(p.name for p in params if p.kind in keyword and p.name not in LOADER_PARAMETERS)

    def config_problem(self, config: Mapping[str, Any], label: str) -> str | None:
        """Why ``config`` (``--task_config``) does not fit ``make``'s signature, in one line, or None: keys it does
        not take (naming the keys it takes, and the flag of a key that is a recipe option) or settings it needs.

        Args:
            config: the parsed ``--task_config``.
            label: the task, as the user named it (``"--task arithmetic"``).
        """
        keys = self.settings()
        takes = f"its keys: {', '.join(map(repr, keys))}" if keys else "it takes no settings"
        unknown = [k for k in config if keys is not None and k not in keys]
        if unknown:
            said = ", ".join(map(repr, unknown))
            flags = [k for k in unknown if k in TASK_OPTION_NAMES]
            hint = f"; {', '.join(f'--{k}' for k in flags)} {'is an option' if len(flags) == 1 else 'are options'}"
            hint = hint + ": pass it as a flag" if flags else ""
            if len(unknown) == 1:
                return f"--task_config key {said}: {label} takes no such setting ({takes}){hint}"
            return f"--task_config keys {said}: {label} takes no such settings ({takes}){hint}"
        needed = [
            p.name
            for p in self._parameters()
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in LOADER_PARAMETERS
            and p.name not in config
        ]
        if needed:
            return f"--task_config: {label} needs the setting(s) {', '.join(map(repr, needed))} ({takes})"
        return None


def as_task_factory(obj: Any, path: str = "") -> TaskFactory:
    """A registry entry or a user's function (by decorator or ``package.module:factory``) as a :class:`TaskFactory`
    (the registry's one loader, :meth:`~trl_ext.registry.Registry.load`).

    Raises:
        TypeError: ``obj`` is not callable.
    """
    return TASKS.load(obj, path)


def _declare_kind(name: str, entry: TaskFactory) -> None:
    """Record the options a new kind of task uses, as declared where its first task is registered."""
    if entry.options is None:
        if entry.kind not in TASK_OPTIONS:
            raise ValueError(
                f"task {name!r}: kind {entry.kind!r} is new; declare the options it uses (options=...), or use one of "
                f"{list(TASK_OPTIONS)}"
            )
        return
    unknown = [o for o in entry.options if o not in TASK_OPTION_NAMES]
    if unknown:
        raise ValueError(f"task {name!r}: options {unknown} are not task options (expected some of TASK_OPTION_NAMES)")
    if TASK_OPTIONS.get(entry.kind, entry.options) != tuple(entry.options):
        raise ValueError(f"task {name!r}: kind {entry.kind!r} already uses {TASK_OPTIONS[entry.kind]}")
    TASK_OPTIONS[entry.kind] = tuple(entry.options)
    KIND_ROWS[entry.kind] = entry.rows or KIND_ROWS.get(entry.kind, "")


TASKS: Registry[TaskFactory] = Registry(
    "task",
    "task",
    TaskFactory,
    wraps="make",
    expects="a function that returns a trl_ext.tasks.Task",
    check=_declare_kind,
)
"""The tasks by ``--task`` name (the built-ins are registered by the modules of ``trl_ext.tasks``;
``package.module:factory`` is imported by the registry). Register your own: ``@register_task("mine")`` above a
function returning a ``trl_ext.tasks.Task``."""

FAMILIES: Registry[TaskFactory] = Registry(
    "task", "task", TaskFactory, wraps="make", expects="a function of the member's name", check=_declare_kind
)
"""The families of tasks, ``--task NAME:MEMBER`` (``reasoning_gym:DATASET``): name -> the entry whose ``make(member)``
returns the member's factory function; registered with :func:`register_task` (``family=...``)."""


def families_said(described: bool = False) -> str:
    """The families as the user writes them, for messages and help: ``"'reasoning_gym:DATASET'"`` (with each
    one's description in parentheses when ``described``)."""
    return ", ".join(
        f"'{name}:{e.family}'" + (f" ({e.description})" if described else "") for name, e in FAMILIES.items()
    )


def register_task(
    name: str, kind: str = "factory", description: str = "", **declarations: Any
) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated task factory under ``name`` (``--task name``) as a :class:`TaskFactory` of
    ``kind``, with ``description`` (default: its docstring's first line) listed by ``--help``, and ``declarations``
    (``options``, ``rows``, ``family``: the first task of a new kind declares the options its kind uses); returns
    the function unchanged: ``TASKS.register(name, kind=kind, description=description, **declarations)``.

    Raises:
        ValueError: ``name`` is taken, empty, or contains ``:``; ``kind`` is new and declares no options, or its
            options differ from the kind's.
    """
    registry, other = (FAMILIES, TASKS) if declarations.get("family") else (TASKS, FAMILIES)
    if name in other:
        raise ValueError(
            f"a task named {name!r} is already registered (as a {'family' if other is FAMILIES else 'task'})"
        )
    return registry.register(name, kind=kind, description=description, **declarations)


@dataclass
class TaskArguments(trl.ScriptArguments, RecipeArguments):
    """A recipe's options for its task (``trl_ext.tasks.load_task``); which task uses which: :data:`TASK_OPTIONS`."""

    task: str | None = field(
        default=None,
        metadata={
            "help": LiveText(
                lambda: (
                    "The task: one of "
                    + TASKS.help().replace("%", "%%")
                    + f", {families_said(described=True)}"
                    + " or 'package.module:factory' (your own: factory(**task_config) returns a trl_ext.tasks.Task). "
                    "Without it: generated arithmetic, or with --dataset_name the kind its columns or --dataset_kind "
                    "say. Options a task does not use are refused (trl_ext.tasks.options.TASK_OPTIONS)."
                )
            )
        },
    )
    task_config: str | None = field(
        default=None,
        metadata={
            "help": "The task factory's keyword arguments as a JSON object, checked against its signature, e.g. "
            '\'{"digits": 3}\' for arithmetic, \'{"num_numbers": 4}\' for sort, \'{"min_terms": 2, "max_terms": 2}\' '
            "for reasoning_gym:chain_sum (reasoning_gym.create_dataset's, plus seed, answer_format, instruction)."
        },
    )
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
    test_file: str | None = field(
        default=None,
        metadata={
            "help": "A separate held-out file (same columns as --dataset_name), e.g. the course's "
            "data/gsm8k/test.jsonl: its first --num_eval rows are evaluated and --dataset_name trains whole."
        },
    )
    template: str = field(
        default="chat",
        metadata={
            "help": "Prompt template: 'chat' (instruct models), 'r1_zero', 'question_only', or a path to a "
            "template file holding {question} (e.g. the course's cs336_alignment/prompts/r1_zero.prompt)."
        },
    )
    instruction: str | None = field(
        default=None,
        metadata={
            "help": "Appended to each question. Unset: 'Answer with just the number.' for 'chat' and "
            "'question_only' on numeric tasks, none for 'r1_zero' and template files (their format asks for "
            "<answer> tags); '' for none."
        },
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message for 'chat'."})
    reward: str | None = field(
        default=None,
        metadata={
            "help": "The math grader: one of 'arithmetic', 'gsm8k', 'math', 'r1_zero' (default: r1_zero for the "
            "r1_zero template and template files, else by dataset kind), or 'package.module:function', a course "
            "reward_fn(response, ground_truth) -> {reward, format_reward, answer_reward}, e.g. the course's "
            "cs336_alignment.drgrpo_grader:r1_zero_reward_fn."
        },
    )
    num_train_problems: int = field(default=2000, metadata={"help": "Generated training problems (rows drawn)."})
    arithmetic_digits: int = field(default=2, metadata={"help": "Digits per operand of generated problems."})
    num_eval: int = field(
        default=200,
        metadata={
            "help": "Held-out problems evaluated (greedy) before and after; a single local file holds out its "
            "last rows (at most a fifth of it), a hub dataset uses dataset_test_split, --test_file its first rows."
        },
    )
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Drop malformed dataset rows with a warning."})
    stop: list[str] | None = field(
        default=None,
        metadata={
            "help": "Stop strings: rollouts and evaluation end a completion with the first of these it writes, kept "
            "in the completion (the course's vLLM stop=[...], include_stop_str_in_output=True), e.g. --stop "
            "'</answer>' or --stop A B. Unset: '</answer>' for the r1_zero template and template files whose "
            "format closes the answer with </answer>, none otherwise; '' for none."
        },
    )
    credit_truncated: bool | None = field(
        default=None,
        metadata={
            "help": "Whether a response the length limit cut (no EOS, no stop string) can earn reward and accuracy. "
            "Unset: false for tasks that read the answer from the end of the response (the last number: "
            "arithmetic, gsm8k; reasoning-gym's last_number, last_line and answer_tag_or_whole formats), true "
            "otherwise."
        },
    )


MathTaskArguments = TaskArguments
"""The name recipes and user scripts used before tasks other than math existed."""

TASK_OPTION_NAMES = tuple(
    f.name
    for f in fields(TaskArguments)
    if f.name != "task" and f.name not in {g.name for g in fields(RecipeArguments)}
)
"""Every option of :class:`TaskArguments` but ``--task`` itself (and the options every recipe has)."""

OPTION_ALIASES = {"dataset_split": "dataset_test_split"}
"""A recipe's own name of a task option -> the option (``recipes/eval_math.py``'s ``--dataset_split``)."""


# ------------------------------------------------------------------------------------------------------ the table
NO_CONFIG = ("num_eval", "eval_batch_size", "stop", "credit_truncated")
"""Options every task uses, but the ``--task_config`` a task without settings takes."""
EVERY_TASK = ("task_config", *NO_CONFIG)
"""Options every task uses (a ``package.module:factory`` task uses these only)."""
PROMPT = ("template", "instruction", "system_prompt")
"""The prompt's options."""
DATASET = (
    "dataset_name",
    "dataset_config",
    "dataset_kind",
    "dataset_train_split",
    "dataset_test_split",
    "test_file",
    "skip_bad_rows",
)
"""A dataset's options."""

TASK_OPTIONS: dict[str, tuple[str, ...]] = {"factory": EVERY_TASK}
"""Task kind (:func:`trl_ext.tasks.loader.task_kind`) -> the options of :data:`TASK_OPTION_NAMES` it uses; any other
one set is refused. Filled where each kind's first task is registered (its ``options`` declaration).
``dataset_streaming`` and ``ignore_bias_buffers`` (inherited from ``trl.ScriptArguments``) are used by no task. A
factory's held-out rows are its own: ``--num_eval`` keeps their first N and ``--eval_batch_size`` sets its
evaluation batch, when set."""

KIND_ROWS = {"factory": "the factory makes its rows and its scorer; pass its settings in --task_config"}
"""Why a kind does not use other options, for the messages (each kind's ``rows`` declaration)."""


def __getattr__(name: str) -> Any:
    if name == "TASK_KINDS":  # the kinds registered so far (built-ins: arithmetic, gsm8k, math, sort, reasoning_gym)
        return tuple(TASK_OPTIONS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _local_file(values: Mapping[str, Any]) -> bool:
    name = values.get("dataset_name")
    return isinstance(name, str) and Path(name).is_file()


UNUSED_WHEN: tuple[tuple[str, Callable[[Mapping[str, Any]], bool], str], ...] = (
    ("dataset_config", _local_file, "--dataset_name is a local file, read whole"),
    ("dataset_train_split", _local_file, "--dataset_name is a local file, read whole"),
    ("dataset_test_split", _local_file, "--dataset_name is a local file, read whole"),
    ("dataset_test_split", lambda v: bool(v.get("test_file")), "--test_file holds the held-out rows"),
    ("system_prompt", lambda v: v.get("template", "chat") != "chat", "only --template chat has a system turn"),
    ("num_train_problems", lambda v: v.get("_held_out_only", False), "only held-out rows are loaded"),
    ("dataset_train_split", lambda v: v.get("_held_out_only", False), "only held-out rows are loaded"),
)
"""(option, when, why): the option is not used when ``when(values)`` holds, whatever the task."""


def task_label(values: Mapping[str, Any]) -> str:
    """The task ``values`` name, for messages (``"--task sort"``, ``"generated arithmetic (no --task)"``)."""
    if values.get("task") is not None:
        return f"--task {values['task']}"
    return "a --dataset_name dataset (no --task)" if values.get("dataset_name") else "generated arithmetic (no --task)"


def option_defaults(cls: type = TaskArguments) -> dict[str, Any]:
    """The default value of each field of a task-arguments dataclass (a recipe's subclass may change some)."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out
