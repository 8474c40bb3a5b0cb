"""The command line of a recipe: parse its config, check every option before any model loads, run it.

A recipe states what it is once, in :func:`recipe`, and its script ends with one call (recipes/grpo_math.py)::

    @cli.recipe("grpo_math", (tasks.MathTaskArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG)
    def main(run, script_args, training_args, model_args, speed=None):  # the run: output folder, resume, Ctrl-C
        ...                              # task -> model -> trainer -> evaluation -> report.finish(run, ...)

    if __name__ == "__main__":
        cli.main(main)                   # defaults YAML < --config FILE < flags; RecipeError -> one `error:` line

``main.parse_args(argv)`` parses the flags alone (tests, tools); the training config and the model config are found
among the configs by type (``transformers.TrainingArguments``, ``trl.ModelConfig``), never by position.

:func:`parse` checks everything that needs no model -- flag values and GRPO's grouping (:func:`flag_problems`), what
this machine cannot do (:func:`device_problems`: vLLM, bf16, 4/8-bit, flash-attention, liger), models, datasets and
files it cannot reach (:func:`source_problems`), and whatever a config class itself rejects -- and reports every
problem at once, each naming the flag that fixes it. :func:`check_fills_one_step` refuses a training set from which
the trainer would take no batch. The run itself (output folder, resume, signals) is :mod:`trl_ext.run`; the results
(metrics.json, experiment.md, plots, console table, model card) are :mod:`trl_ext.report`.

Choices (documented in docs/reference.md "Stopping and resuming" and in each recipe's ``--help``):

* ``--config FILE`` is layered over the recipe's default config: keys of FILE replace the defaults, keys it does
  not set keep the recipe's value, and command-line flags override both (TRL's own rule, file < flags, with the
  recipe's defaults underneath instead of the dataclasses' bare defaults). TRL's name of course settings counts as
  the settings its value decides (``GRPOConfig.UPSTREAM_OPTIONS`` / ``upstream_meaning``): ``--loss_type dr_grpo``
  replaces a file's ``length_normalization`` (and keeps its ``pg_loss_type``), ``--loss_type cispo`` replaces both,
  a file's ``scale_rewards`` replaces the defaults' ``normalize_by_std``; one layer that sets both must agree.
* transformers 5's deprecated option names (``gradient_checkpointing``) are read as their new names.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trl
import yaml
from transformers import TrainingArguments

# RecipeError, user_input, RecipeArguments and check_fills_one_step live in the leaves trl_ext.errors and
# trl_ext.options (trl_ext.tasks needs them too); a recipe reaches them as cli.RecipeError...
from trl_ext import machine, runtime, tasks
from trl_ext.data.math_datasets import dataset_source_problem
from trl_ext.errors import RecipeError as RecipeError
from trl_ext.errors import decode_text, read_text
from trl_ext.errors import user_input as user_input
from trl_ext.models import EMBEDDED_ALIAS, check_backend_available, model_source_problem
from trl_ext.objective import advantages, aggregations, losses, trl_names
from trl_ext.options import RecipeArguments as RecipeArguments
from trl_ext.options import check_fills_one_step as check_fills_one_step
from trl_ext.run import RecipeRun, command_line, install_interrupt_handler, is_main_process, refuse_resume
from trl_ext.tasks.options import TASK_OPTION_NAMES

MODEL_NAME_HELP = (
    f"A Hub id or a local folder. `{EMBEDDED_ALIAS}` (also `embedded:SmolLM2-135M-Instruct`; the default when no "
    "config names a model) selects the embedded SmolLM2-135M-Instruct, also over a --config file that names "
    "another model."
)
"""What every recipe's ``--help`` adds to ``--model_name_or_path`` (trl.ModelConfig's own help)."""


# ------------------------------------------------------------------------------------------- checks
# flag -> (test on the parsed value, what is expected); applied to whichever of these the recipe has, before any
# dataclass is built, so the message names the flag the user typed rather than a derived quantity
FLAG_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "learning_rate": (lambda v: v >= 0, ">= 0"),
    "max_completion_length": (lambda v: v is None or v >= 1, ">= 1"),
    "max_prompt_length": (lambda v: v is None or v >= 1, ">= 1"),
    "max_length": (lambda v: v is None or v >= 1, ">= 1"),
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "num_generations": (lambda v: v is None or v >= 2, ">= 2 (GRPO compares completions within a group)"),
    "per_device_train_batch_size": (lambda v: v >= 1, ">= 1"),
    "per_device_eval_batch_size": (lambda v: v >= 1, ">= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, ">= 1"),
    "num_train_epochs": (lambda v: v > 0, "> 0"),
    "temperature": (lambda v: v > 0, "> 0"),
    "beta": (lambda v: v >= 0, ">= 0"),
    "logging_steps": (lambda v: v > 0, "> 0"),
    "save_steps": (lambda v: v > 0, "> 0"),
    "num_eval": (lambda v: v >= 1, ">= 1"),
    "eval_batch_size": (lambda v: v >= 1, ">= 1"),
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "num_train_problems": (lambda v: v >= 1, ">= 1"),
    "eval_every": (lambda v: v >= 1, ">= 1"),
    "rollout_samples": (lambda v: v >= 0, ">= 0 (0: no rollouts.jsonl)"),
}


REGISTRIES = (losses.POLICY_LOSSES, aggregations.AGGREGATIONS, advantages.ADVANTAGE_ESTIMATORS)
"""The registries whose option (``Registry.option``: ``--pg_loss_type``, ``--length_normalization``,
``--advantage_estimator``) names an entry: a name that is none of theirs is refused before any model loads, with the
closest registered names (:meth:`trl_ext.registry.Registry.problem`); a ``package.module:attr`` is imported then."""


def flag_problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem of the parsed flag values (``{field name: value}``) against :data:`FLAG_CHECKS`,
    :data:`REGISTRIES` and GRPO's grouping rule, one message each, naming the flag, its value and what is expected
    (for GRPO's grouping, the flags that set the number of completions per generation step and which ones to
    change)."""
    problems = [
        f"--{name} {values[name]}: expected {expected}"
        for name, (ok, expected) in FLAG_CHECKS.items()
        if name in values and values[name] is not None and not ok(values[name])
    ]
    named = [  # a registry's unknown name does not stop the grouping rule below
        problem
        for registry in REGISTRIES
        if values.get(registry.option) is not None and (problem := registry.problem(values[registry.option], flag=True))
    ]
    if problems:  # the grouping rule below divides by values this list already refused
        return problems + named
    if values.get("num_generations") and "steps_per_generation" in values and "per_device_train_batch_size" in values:
        # the rule lives beside the seam check; imported here because trl_ext.trainers loads TRL's trainers (~13 s)
        from trl_ext.trainers.grpo.trainer import generation_grouping_problem

        problems += [p for p in [generation_grouping_problem(values, int(os.environ.get("WORLD_SIZE", "1")))] if p]
        if values.get("dynamic_sampling") and not problems:
            from trl_ext.trainers.grpo.dynamic_sampling import whole_groups_problem

            which = "steps_per_generation" if values.get("steps_per_generation") else "gradient_accumulation_steps"
            problem = whole_groups_problem(
                values["per_device_train_batch_size"],
                values.get(which) or 1,
                values["num_generations"],
                flags=True,
                steps_name=which,
            )
            if problem:
                problems.append(
                    f"--dynamic_sampling true keeps whole prompt groups on each process: {problem}; change "
                    "--per_device_train_batch_size or --num_generations, or pass --dynamic_sampling false"
                )
    return problems + named


def raise_problems(problems: Sequence[str]) -> None:
    """Nothing for no problems; else one :class:`RecipeError` holding them all: the problem itself when there is one,
    else a count and one indented line per problem (``main`` prints it after ``error:``)."""
    if len(problems) == 1:
        raise RecipeError(problems[0])
    if problems:
        raise RecipeError(
            f"{len(problems)} problems with the options (found before loading any model):\n"
            + "\n".join(f"  {p}" for p in problems)
        )


def device_problems(values: Mapping[str, Any]) -> list[str]:
    """What the options ask of this machine and it cannot do (:func:`trl_ext.machine.problem`), each naming the flag
    that fixes it: vLLM (``use_vllm``; its server mode without CUDA; on vLLM's CPU build a memory reservation it would
    refuse; eval_math's ``backend vllm``), Liger kernels, bf16 without a bf16 GPU (unless ``use_cpu``),
    flash-attention without its package or a CUDA GPU, 4/8-bit loading without bitsandbytes, and what the installed
    bitsandbytes cannot do on a CPU (:data:`trl_ext.machine.BITSANDBYTES_ON_CPU`: 4/8-bit loading at all, fp4, its
    optimizers)."""
    problems = []

    def need(name: str, option: str, off: str) -> None:
        problems.append(machine.problem(name, option, f"pass {off}"))

    if values.get("use_vllm"):
        if values.get("vllm_mode") == "server":
            need("vllm_server", "--use_vllm true --vllm_mode server", "`--vllm_mode colocate` or `--use_vllm false`")
        else:
            need("vllm", "--use_vllm true", "`--use_vllm false`")
            if machine.vllm_cpu_build() and machine.package_available("vllm"):
                fraction = values.get("vllm_gpu_memory_utilization", 0.3)  # TRL 1.16's default
                memory = machine.vllm_cpu_memory_problem(fraction)
                problems.append(memory and f"--vllm_gpu_memory_utilization {fraction}: {memory}")
    if values.get("backend") == "vllm":
        need("vllm", "--backend vllm", "`--backend hf`")
    if values.get("use_liger_kernel"):
        need("liger_kernel", "--use_liger_kernel true", "`--use_liger_kernel false`")
    if (values.get("bf16") or values.get("bf16_full_eval")) and not values.get("use_cpu"):
        flag = "--bf16 true" if values.get("bf16") else "--bf16_full_eval true"
        need("bf16", flag, "`--bf16 false` or `--use_cpu true`")
    if values.get("load_in_4bit") and values.get("load_in_8bit"):
        problems.append("--load_in_4bit true and --load_in_8bit true: set at most one")
    for bits in ("4", "8"):
        if values.get(f"load_in_{bits}bit"):
            need(f"load_in_{bits}bit", f"--load_in_{bits}bit true", f"`--load_in_{bits}bit false`")
    if (
        values.get("load_in_4bit")
        and values.get("bnb_4bit_quant_type") == "fp4"
        and machine.package_available("bitsandbytes")
    ):
        cpu = machine.bitsandbytes_cpu_problem("bnb_4bit_quant_type fp4")
        problems.append(cpu and f"--bnb_4bit_quant_type fp4: {cpu}; pass `--bnb_4bit_quant_type nf4`")
    optim = getattr(values.get("optim"), "value", values.get("optim"))  # transformers' OptimizerNames or a string
    if optim in machine.BITSANDBYTES_OPTIMIZERS:
        if not machine.package_available("bitsandbytes"):
            problems.append(
                f"--optim {optim}: bitsandbytes is not installed here; pass `--optim adamw_torch`, or "
                f"{machine.QLORA_EXTRA}"
            )
        else:
            cpu = machine.bitsandbytes_cpu_problem("bitsandbytes optimizers")
            problems.append(cpu and f"--optim {optim}: {cpu}; pass `--optim adamw_torch`")
    if values.get("attn_implementation") == "flash_attention_2":
        need("flash_attention_2", "--attn_implementation flash_attention_2", "`--attn_implementation sdpa`")
    return [p for p in problems if p]


def source_problems(values: Mapping[str, Any]) -> list[str]:
    """Where the options name models, datasets and files this machine cannot reach: ``model_name_or_path``
    (:func:`model_source_problem`), ``dataset_name`` (:func:`dataset_source_problem`), ``*_file`` (must exist),
    ``reward_model_path`` (a local folder) and a ``chat_template_path`` file TRL would misread
    (:func:`_read_by_trl_problem`)."""
    problems = [model_source_problem(values.get("model_name_or_path"))]
    if "dataset_name" in values:
        problems.append(dataset_source_problem(values.get("dataset_name")))
    for name, value in values.items():
        if name.endswith("_file") and isinstance(value, str) and value and not Path(value).is_file():
            problems.append(f"--{name} {value}: no such file")
    if values.get("reward_model_path") and not Path(values["reward_model_path"]).is_dir():
        problems.append(f"--reward_model_path {values['reward_model_path']}: no such folder")
    template = values.get("chat_template_path")
    if isinstance(template, str) and template.endswith((".jinja", ".j2")) and Path(template).is_file():
        problems.append(_read_by_trl_problem("--chat_template_path", template))
    return [p for p in problems if p]


def _read_by_trl_problem(flag: str, path: str) -> str | None:
    """What is wrong with a text file TRL itself reads as UTF-8 (``open(path, encoding="utf-8")``: SFT's and the
    reward trainer's ``chat_template_path``), or None: not UTF-8 (TRL would raise UnicodeDecodeError mid-setup), or a
    byte-order mark, which TRL would keep as U+FEFF at the start of the template, so before every prompt (trl_ext's
    own readers drop it, :func:`trl_ext.errors.read_text`; this file is read by TRL, so it is refused instead)."""
    data = Path(path).read_bytes()
    try:
        decode_text(data, path)
    except ValueError as err:
        return f"{flag} {err}"
    if data.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return (
            f"{flag} {path}: starts with a byte-order mark, which TRL reads into the chat template (U+FEFF before "
            "every prompt, or a UnicodeDecodeError for UTF-16); save it as UTF-8 without one"
        )
    return None


def check_model_source(name_or_path: str | None, flag: str = "--model_name_or_path") -> None:
    """Raise :func:`model_source_problem` as a :class:`RecipeError`, if any."""
    raise_problems([p for p in [model_source_problem(name_or_path, flag)] if p])


def check_model_options(model_args: Any) -> None:
    """Model checks that need no model: the backend options (4/8-bit, flash-attention: which extra is missing) and
    :func:`check_model_source`.

    Raises:
        RecipeError: with the message of ``trl_ext.models.check_backend_available`` or :func:`check_model_source`.
    """
    try:
        check_backend_available(
            load_in_4bit=model_args.load_in_4bit,
            load_in_8bit=model_args.load_in_8bit,
            attn_implementation=model_args.attn_implementation,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        )
    except (ImportError, RuntimeError, ValueError) as err:
        raise RecipeError(str(err)) from None
    check_model_source(model_args.model_name_or_path)


# ------------------------------------------------------------------------------------------- parsing
def _pop_configs(args: list[str]) -> tuple[list[str], list[str]]:
    """Remove every ``--config PATH`` / ``--config=PATH`` from ``args``; return (the rest, the paths)."""
    rest, paths, i = [], [], 0
    while i < len(args):
        if args[i] == "--config":
            if i + 1 >= len(args):
                raise RecipeError("--config needs a YAML file path")
            paths.append(args[i + 1])
            i += 2
        elif args[i].startswith("--config="):
            paths.append(args[i].split("=", 1)[1])
            i += 1
        else:
            rest.append(args[i])
            i += 1
    return rest, paths


def _flag_values(args: Sequence[str]) -> dict[str, str | None]:
    """``--name value`` and ``--name=value`` of a command line: name -> its text (None where no value follows)."""
    values: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, equals, value = arg[2:].partition("=")
            following = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            values[name] = value if equals else following
    return values


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"--config {path}: no such file")
    try:
        text = read_text(path)  # UTF-8, a byte-order mark dropped
    except ValueError as err:  # not UTF-8: the message starts with the path
        raise RecipeError(f"--config {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"--config {path}: not valid YAML ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"--config {path}: expected a YAML mapping of option: value, got {type(data).__name__}")
    return data


DEPRECATED_ALIASES = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}
"""transformers 5 option names kept as aliases -> their new names. transformers reads an alias only when the new
name is unset, so an alias in a ``--config`` file or on the command line would silently lose to the new name in the
recipe's defaults (``activation_checkpointing: false``); the parser reads each alias as its new name instead."""


def build_parser(
    dataclass_types: Sequence[type],
    default_config: str | Path | None,
    doc: str | None,
    help_overrides: Mapping[str, str] | None = None,
) -> trl.TrlParser:
    """A ``trl.TrlParser`` whose ``--help`` starts with the recipe's usage (``doc``), ``--config`` and the recipe's
    own options, and says where the TRL/transformers options that follow come from.

    ``help_overrides`` (option name -> help text) replaces the help of inherited options the recipe treats its own
    way (refuses, or sets from another option), so that ``--help`` describes the flags the recipe really takes. A
    recipe without ``--resume_from_checkpoint`` (or that overrides its help) gets an ``--overwrite_output_dir`` help
    that does not offer resuming."""
    import argparse

    # one help group per class, titled with its name (HfArgumentParser groups a class with _argument_group_name);
    # subclasses only for the help text: parse builds the original classes
    def title(i: int, t: type) -> str:  # the first class holds the recipe's own options (tasks' ones included)
        root = t.__module__.split(".")[0]
        return f"recipe options ({t.__qualname__})" if i == 0 else f"{root}.{t.__qualname__} options"

    grouped = [type(t.__name__, (t,), {"_argument_group_name": title(i, t)}) for i, t in enumerate(dataclass_types)]
    parser = trl.TrlParser(
        grouped,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--config FILE] [--OPTION VALUE ...]",
        epilog="The first group holds the recipe's own options; the others come from the classes in their titles, "
        "documented in full by TRL (https://huggingface.co/docs/trl) and transformers (TrainingArguments).",
        # a shortened flag (--learning_rat) is unknown, not read as the option it starts: the config layers read
        # flags by their full names, and a typo should be named, not guessed
        allow_abbrev=False,
    )
    if default_config:
        try:
            shown = os.path.relpath(default_config)
        except ValueError:
            shown = str(default_config)
    if default_config:
        config_help = (
            f"YAML file of option: value pairs, layered over the recipe's default config ({shown}): options "
            "the file sets replace the defaults, the others keep them; command-line flags override both."
        )
    else:
        config_help = "YAML file of option: value pairs (as in TRL scripts); command-line flags override it."
    parser.add_argument("--config", metavar="FILE", help=config_help)
    for action in parser._actions:  # trl.ModelConfig's help does not know the embedded model
        if action.dest == "model_name_or_path":
            action.help = f"{action.help} {MODEL_NAME_HELP}" if action.help else MODEL_NAME_HELP
    options = parser._option_string_actions
    overrides = dict(help_overrides or {})
    if "--overwrite_output_dir" in options and (
        "--resume_from_checkpoint" not in options or "resume_from_checkpoint" in overrides
    ):
        overrides.setdefault("overwrite_output_dir", OVERWRITE_HELP_NO_RESUME)
    for name, text in overrides.items():
        if f"--{name}" not in options:
            raise ValueError(f"help_overrides names --{name}, which this recipe does not have")
        options[f"--{name}"].help = text
    return parser


def _did_you_mean(names: Sequence[str], dashes: str) -> str:
    return f": did you mean {' or '.join(dashes + n for n in names)}?" if names else ""


def close_options(name: str, options: Mapping[str, Any]) -> list[str]:
    """The (at most two) option names closest to ``name``, an option the parser does not know (without dashes;
    ``-`` read as ``_``), among the parser's ``--`` options (``options``: its option strings, whose ``--a-b``
    spellings count as ``a_b``); difflib, cutoff 0.75. Empty when none is close."""
    known = sorted({option[2:].replace("-", "_") for option in options if option.startswith("--")})
    return difflib.get_close_matches(name.replace("-", "_"), known, n=2, cutoff=0.75)


OVERWRITE_HELP_NO_RESUME = (
    "Replace a finished run in --output_dir (delete its results first). Without it the recipe refuses, so results "
    "are never lost. This recipe cannot be resumed."
)


def parse(
    dataclass_types: Sequence[type],
    default_config: str | Path | None,
    argv: Sequence[str] | None = None,
    doc: str | None = None,
    help_overrides: Mapping[str, str] | None = None,
) -> tuple:
    """Parse a recipe's flags: recipe defaults (``default_config``) < ``--config`` file < command-line flags; then
    check everything that can be checked before a model loads and report every problem at once.

    The checks, each problem naming the flag that fixes it: options unknown to every class (naming the file), flag
    values out of range and GRPO's grouping (:func:`flag_problems`), what this machine cannot do (vLLM, bf16 without
    a bf16 GPU, 4/8-bit, flash-attention: :func:`device_problems`), models, datasets and files it cannot reach
    (:func:`source_problems`), the task's name and every task option the user set that the task does not use
    (:func:`trl_ext.tasks.task_problem`, :func:`trl_ext.tasks.options.option_problems`) and whatever a config class
    itself rejects (its ``__post_init__``; run with the
    options above switched off, so its own objections are found in the same pass).

    Args:
        dataclass_types: the recipe's argument classes, its own first (e.g. ``(ScriptArguments, GRPOConfig,
            ModelConfig)``).
        default_config: the recipe's default YAML (None: the dataclasses' defaults).
        argv: flags (default ``sys.argv[1:]``).
        doc: the recipe's usage text, shown first by ``--help`` (pass the module's ``__doc__``).
        help_overrides: see :func:`build_parser`.

    Returns:
        one instance per dataclass type, in order.

    Raises:
        RecipeError: a missing or malformed config file; else all the problems above together
            (:func:`raise_problems`).
        SystemExit: ``--help``, or argparse's own errors (unknown flag, wrong type), as in every TRL script.
    """
    args, paths = _pop_configs(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(dataclass_types, default_config, doc, help_overrides)
    options = parser._option_string_actions
    layers = _config_layers(dataclass_types, [default_config] if default_config else [], paths, options)
    layers.overridden_by(_flag_values(args))
    problems = []
    unknown = parser.set_defaults_with_config(**layers.merged)
    if unknown:
        keys = sorted({item[2:] for item in unknown[::2]})
        problems.append(
            "unknown option(s) "
            + ", ".join(f"{k!r} (from {layers.source[k]}{_did_you_mean(close_options(k, options), '')})" for k in keys)
            + "; see --help for the options of this recipe"
        )
    from_defaults = layers.source.get("use_cpu") == str(default_config)
    if paths and from_defaults and layers.merged.get("use_cpu") and "--use_cpu" not in args:
        if machine.cuda_available():
            print(
                f"note: use_cpu: true comes from the recipe's defaults ({default_config}); your --config does not "
                "set it, so this run stays on the CPU. Set use_cpu: false in your file to use the GPU.",
                file=sys.stderr,
            )
    for alias, name in DEPRECATED_ALIASES.items():  # the command line's aliases, read as their new names
        if f"--{name}" in options:
            args = [f"--{name}" if a == f"--{alias}" else a.replace(f"--{alias}=", f"--{name}=", 1) for a in args]
    # mirrors transformers.HfArgumentParser.parse_args_into_dataclasses, with the checks before construction
    namespace, remaining = parser.parse_known_args(args=args)
    if remaining:
        hints = "".join(
            f"; {arg.partition('=')[0]}{_did_you_mean(close, '--')}"
            for arg in remaining
            if arg.startswith("--") and (close := close_options(arg[2:].partition("=")[0], options))
        )
        parser.error(f"unrecognized arguments: {' '.join(remaining)}{hints}")
    values = vars(namespace)
    values.pop("config", None)
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and "use_cpu" in values and (values["use_cpu"] or not machine.cuda_available()) and is_main_process():
        print(
            "note: accelerate runs FSDP only on GPUs; on the CPU (use_cpu true, or no GPU) this launch trains with "
            "plain data parallelism, every process holding the whole model",
            file=sys.stderr,
        )
    flagged = flag_problems(values)
    devices = device_problems(values)
    problems += flagged + devices + source_problems(values)
    if "task" in values:  # --task and --task_config, and every option the task would not use, before any data is read
        problems += _task_problems(values, args, layers.source, str(default_config), dataclass_types)
    outputs = _construct(dataclass_types, values, devices, flagged, problems)
    raise_problems(problems)
    return tuple(outputs)


def _config_layers(
    dataclass_types: Sequence[type], defaults: list, paths: list, options: Mapping[str, Any]
) -> trl_names.OptionLayers:
    """The recipe's defaults and each ``--config`` file, merged in order (TRL's ``env:`` block set in the
    environment; deprecated names read as their new names; TRL's names of course settings by
    :class:`trl_ext.objective.trl_names.OptionLayers`)."""
    layers = trl_names.OptionLayers(any(hasattr(t, "UPSTREAM_OPTIONS") for t in dataclass_types))
    for path in defaults + paths:
        layer = _read_yaml(path)
        env = layer.pop("env", {}) or {}
        if not isinstance(env, dict):
            raise RecipeError(f"--config {path}: `env` must be a mapping of variable: value")
        for key, value in env.items():  # TRL's `env:` block
            os.environ[key] = str(value)
        layer = {
            DEPRECATED_ALIASES.get(k, k) if f"--{DEPRECATED_ALIASES.get(k, k)}" in options else k: v
            for k, v in layer.items()
        }
        layers.add(layer, str(path))
    return layers


def _task_problems(
    values: dict[str, Any], args: list[str], source: Mapping[str, str], defaults_path: str, dataclass_types: Sequence
) -> list[str]:
    """``--task``'s problems and every task option set that the task does not use (naming the flag or file).

    An option a ``--config`` file sets that the task does not use is refused as a flag is -- unless a flag replaced
    a task option the file sets: the flag then overrides part of the file (a GPU config's Hub dataset, whose
    dataset_config a local --dataset_name leaves unused), and what it leaves unused in the file is ignored with a
    warning (reset in ``values`` to its default), since no flag can unset a file's value."""
    problems = [p for p in [tasks.task_problem(values)] if p]
    flags = dict.fromkeys((a[2:].split("=", 1)[0] for a in args if a.startswith("--")), "")
    files = {k: src for k, src in source.items() if src != defaults_path and k not in flags}
    own = next(t for t in dataclass_types if any(f.name == "task" for f in dataclasses.fields(t)))
    defaults = tasks.option_defaults(own)
    file_set = {k for k, src in source.items() if src != defaults_path}
    if not any(name in TASK_OPTION_NAMES and name in file_set for name in flags):
        return problems + tasks.option_problems(values, {**files, **flags}, defaults=defaults)
    problems += tasks.option_problems(values, flags, defaults=defaults)
    for name, src in files.items():  # each unused file option is reset to its default: ignored for real
        for problem in tasks.option_problems(values, {name: src}, defaults=defaults):
            if is_main_process():
                print(f"warning: {problem.removesuffix('; remove it')}; ignored", file=sys.stderr, flush=True)
            if name in defaults:
                values[name] = defaults[name]
    return problems


def _construct(
    dataclass_types: Sequence[type], values: dict[str, Any], devices: list[str], flagged: list[str], problems: list
) -> list:
    """One instance per dataclass type, built with ``values``: the classes' own checks, with what
    :func:`device_problems` refused switched off (TRL would raise on it first); each objection appended to
    ``problems`` unless it objects to a value a flag problem already names."""
    constructed = dict(values)
    if devices:
        constructed.update(
            {
                k: False
                for k in ("use_vllm", "use_liger_kernel", "bf16", "bf16_full_eval", "load_in_4bit", "load_in_8bit")
                if k in values
            }
        )
        if values.get("backend") == "vllm":
            constructed["backend"] = "hf"
        if values.get("attn_implementation") == "flash_attention_2":
            constructed["attn_implementation"] = None
    outputs = []
    for dtype in dataclass_types:
        keys = {f.name for f in dataclasses.fields(dtype) if f.init}
        try:
            outputs.append(dtype(**{k: v for k, v in constructed.items() if k in keys}))
        except (ValueError, ImportError) as err:
            if not any(f"--{k} " in p for p in flagged for k in keys):  # else it objects to a value named above
                problems.append(f"invalid options for {dtype.__name__}: {err}")
    return outputs


COMPARISON_HELP = {
    "resume_from_checkpoint": "Refused: a comparison trains every arm from scratch, so there is nothing to resume "
    "(--overwrite_output_dir replaces an earlier comparison in the same --output_dir).",
    "max_steps": "Optimizer steps of every arm (>= 1: the arms are compared at one fixed step budget).",
}
"""``help_overrides`` of a comparison recipe (``recipe(..., comparison=True)``: compare_upstream, grpo_sort,
grpo_ablations): the inherited options it treats its own way."""

COMPARISON_NOT_RESUMABLE = ("a comparison trains every arm from scratch", "comparison")
"""Why a comparison refuses ``--resume_from_checkpoint`` (:func:`trl_ext.run.refuse_resume`)."""


# ------------------------------------------------------------------------------------------- running
def recipe(
    name: str,
    configs: Sequence[type],
    default_config: str | Path | None = None,
    *,
    help_overrides: Mapping[str, str] | None = None,
    result_file: str | Sequence[str] | Callable[..., str | Sequence[str]] | None = None,
    not_resumable: tuple[str, str] | None = None,
    comparison: bool = False,
):
    """Declare a recipe around its ``main(run, *configs, **kwargs)``: everything about it is stated here, once.

    The decorated ``main`` is called with the parsed configs (``main(*configs, **kwargs)``) and opens the run first:
    a :class:`trl_ext.run.RecipeRun` named ``name``, in the ``output_dir`` of the first config that has one, with
    ``--overwrite_output_dir`` from the recipe's :class:`RecipeArguments` and ``--resume_from_checkpoint`` from the
    config that has it; its configs are recorded under ``main``'s parameter names (``script_args``,
    ``training_args``, ...). Then the model options that need no model are checked (:func:`check_model_options`, for
    the ``trl.ModelConfig``). So the output folder, the checkpoint, the options a resume depends on and the model's
    backend are checked before ``main``'s first line, and every recipe does it the same way.

    ``main.parse_args(argv=None)`` parses the recipe's flags (:func:`parse` with ``configs``, ``default_config``,
    ``help_overrides`` and the recipe module's docstring as the usage ``--help`` shows first); :func:`main` runs it
    all from the command line.

    Args:
        name: the recipe's name, recorded in ``metrics.json``.
        configs: the recipe's argument classes, its own first (``(ScriptArguments, trl_ext.GRPOConfig,
            trl.ModelConfig)``); the training config and the model config are found among them by type.
        default_config: the recipe's default YAML (None: the dataclasses' defaults).
        help_overrides: option name -> help text of inherited options the recipe treats its own way
            (:func:`build_parser`).
        result_file: the file whose presence marks a finished run (default ``metrics.json``; ``comparison.json`` for
            a comparison), or several (any of them; ``--overwrite_output_dir`` deletes them all), or a function of
            the configs that returns them.
        not_resumable: for a recipe that cannot be resumed, (why, what ``--overwrite_output_dir`` replaces):
            ``--resume_from_checkpoint`` is refused with them (:func:`trl_ext.run.refuse_resume`).
        comparison: a comparison of arms: not resumable (:data:`COMPARISON_NOT_RESUMABLE`), its help says so
            (:data:`COMPARISON_HELP`), its result is ``comparison.json`` and ``--max_steps`` must be >= 1 (the arms
            are compared at one fixed step budget).

    ``trl_ext.cli.main`` passes ``handle_signals=True`` (Ctrl-C handling of the run); other callers keep theirs.
    """
    if comparison:
        help_overrides = {**COMPARISON_HELP, **(help_overrides or {})}
        not_resumable = not_resumable or COMPARISON_NOT_RESUMABLE
        result_file = result_file or "comparison.json"
    result_file = result_file or "metrics.json"

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        names = list(inspect.signature(fn).parameters)[1:]

        @functools.wraps(fn)
        def opened(*configs: Any, handle_signals: bool = False, **kwargs: Any) -> Any:
            training = _find(configs, TrainingArguments)
            if comparison and training.max_steps <= 0:
                raise RecipeError(f"--max_steps {training.max_steps}: a comparison needs a fixed step budget (>= 1)")
            output_dir = next(c.output_dir for c in configs if hasattr(c, "output_dir"))
            overwrite = any(c.overwrite_output_dir for c in configs if isinstance(c, RecipeArguments))
            resume = next((c.resume_from_checkpoint for c in configs if hasattr(c, "resume_from_checkpoint")), None)
            if not_resumable is not None:
                refuse_resume(resume, *not_resumable)
                resume = None
            run = RecipeRun(
                name,
                output_dir,
                dict(zip(names, configs)),
                overwrite=overwrite,
                resume=resume,
                result_file=result_file(*configs) if callable(result_file) else result_file,
                handle_signals=handle_signals,
            )
            model_args = _find(configs, trl.ModelConfig)
            if model_args is not None:
                check_model_options(model_args)
            return fn(run, *configs, **kwargs)

        def parse_args(argv: Sequence[str] | None = None) -> tuple:
            """The recipe's configs from its flags (``argv``, default ``sys.argv[1:]``): see :func:`parse`."""
            return parse(configs, default_config, argv, fn.__globals__.get("__doc__"), help_overrides)

        opened.recipe_name, opened.configs, opened.default_config = name, tuple(configs), default_config
        opened.parse_args = parse_args
        return opened

    return decorate


def _find(configs: Sequence[Any], kind: type) -> Any:
    """The first of ``configs`` that is a ``kind`` (``transformers.TrainingArguments``, ``trl.ModelConfig``), or
    None."""
    return next((c for c in configs if isinstance(c, kind)), None)


def main(recipe_main: Callable[..., Any], argv: Sequence[str] | None = None) -> Any:
    """Run a recipe (a ``main`` decorated with :func:`recipe`) from the command line: Ctrl-C handling, its flags
    (``argv``, default ``sys.argv[1:]``; ``recipe_main.parse_args``), then ``recipe_main(*configs, ...)``. A
    :class:`RecipeError` (or a missing file) becomes one ``error: ...`` line on stderr and exit status 2.

    What ``recipe_main`` gets besides its configs: ``handle_signals=True`` (its run handles Ctrl-C from then on);
    ``speed=`` when it has a ``speed`` parameter -- ``trl_ext.runtime.apply_speed_defaults`` picks threads and CPU
    precision on the training config (the ``TrainingArguments`` among the configs) before ``main`` runs, so before any
    trainer config is derived from it, and names the ``trl.ModelConfig``'s dtype; ``command=`` when it has a
    ``command`` parameter: the command line that reproduces this run (:func:`trl_ext.run.command_line`).
    """
    install_interrupt_handler()
    try:
        configs = recipe_main.parse_args(argv)
        wants = inspect.signature(recipe_main).parameters
        kwargs: dict[str, Any] = {"handle_signals": True}
        if "speed" in wants:
            model_args = _find(configs, trl.ModelConfig)
            kwargs["speed"] = runtime.apply_speed_defaults(
                _find(configs, TrainingArguments),
                argv,
                default_config=recipe_main.default_config,
                dtype=getattr(model_args, "dtype", "float32"),
            )
        if "command" in wants:
            kwargs["command"] = command_line(None if argv is None else [sys.argv[0], *argv])
        return recipe_main(*configs, **kwargs)
    except (RecipeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
