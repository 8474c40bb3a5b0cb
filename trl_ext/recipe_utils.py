"""What every recipe does the same way: parse its config, check its inputs before any model work, resume, stop
cleanly on Ctrl-C, and record what it ran in ``metrics.json``.

A recipe reads top to bottom as::

    run = RecipeRun("grpo_math", training_args.output_dir, {"script_args": ..., "training_args": ..., ...},
                    overwrite=script_args.overwrite_output_dir, resume=training_args.resume_from_checkpoint)
    with run.phase("data"):
        ...                                  # validate data: fails in seconds, before the model is loaded
    with run.phase("load_model"):
        ...
    trainer.add_callback(run.callback())     # logs the last step, defers Ctrl-C past a checkpoint being written
    trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    metrics = {...}; metrics["my_key"] = value   # one line per key
    run.write_metrics(metrics)               # + command, resolved configs, library versions, phase times

and ends with ``if __name__ == "__main__": recipe_main(main, parse_recipe_args(...))``, which turns a
:class:`RecipeError` (bad flag, data or folder) into an ``error: ...`` message and installs the Ctrl-C handler.
:func:`parse_recipe_args` checks everything that needs no model (flag values, what this machine can run, which
models, datasets and files it can reach) and reports every problem it finds at once, each naming the flag that
fixes it; :func:`check_fills_one_step` refuses a training set from which the trainer would take no batch.

Choices (documented in README "Stopping and resuming" and in each recipe's ``--help``):

* ``--config FILE`` is layered over the recipe's default config: keys of FILE replace the defaults, keys it does
  not set keep the recipe's value, and command-line flags override both (TRL's own rule, file < flags, with the
  recipe's defaults underneath instead of the dataclasses' bare defaults). TRL's name of a course setting counts as
  that setting (``GRPOConfig.UPSTREAM_OPTIONS``): ``--loss_type dr_grpo`` replaces a file's ``length_normalization``,
  a file's ``scale_rewards`` replaces the defaults' ``normalize_by_std``; one layer that sets both must agree.
* A folder that holds a finished run (``metrics.json``) or an unfinished run's checkpoints is never silently reused:
  the recipe refuses unless ``--overwrite_output_dir`` (delete that run's outputs first) or
  ``--resume_from_checkpoint`` (continue it) is given.
* ``--resume_from_checkpoint true`` picks the latest ``checkpoint-N`` in ``--output_dir`` (transformers'
  ``resume_from_checkpoint=True``); a path picks that checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import trl
import yaml
from rich.console import Console
from rich.table import Table
from transformers import TrainerCallback, TrainingArguments

from trl_ext.models import EMBEDDED_ALIAS, EMBEDDED_BASE_MODEL  # noqa: F401  (re-exported: recipes name them)

OVERWRITE_FLAG = "--overwrite_output_dir"
"""The one flag, in every recipe, that allows replacing a finished run in ``--output_dir``."""

VERSIONED_PACKAGES = ("trl_ext", "trl", "transformers", "torch", "accelerate", "datasets", "peft", "vllm")
"""Packages whose installed versions ``metrics.json`` records (absent ones are left out)."""

RUN_ARTIFACTS = ("metrics.json", "eval_before.json", "runs", "checkpoint-*")
"""What :func:`check_output_dir` deletes from a folder on ``--overwrite_output_dir``: a previous run's metrics, its
cached before-evaluation, its TensorBoard logs and its checkpoints (model files are replaced when the new run saves)."""


MODEL_NAME_HELP = (
    f"A Hub id or a local folder. `{EMBEDDED_ALIAS}` (also `embedded:SmolLM2-135M-Instruct`; the default when no "
    "config names a model) selects the embedded SmolLM2-135M-Instruct, also over a --config file that names "
    "another model."
)
"""What every recipe's ``--help`` adds to ``--model_name_or_path`` (trl.ModelConfig's own help)."""


class RecipeError(ValueError):
    """Bad user input (a flag, a config file, a data file, an output folder): shown as one line, no traceback."""


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


# ------------------------------------------------------------------------------------------- parsing
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
}


def flag_problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem of the parsed flag values (``{field name: value}``) against :data:`FLAG_CHECKS` and GRPO's
    grouping rule, one message each, naming the flag, its value and what is expected (for GRPO's grouping, the flags
    that set the number of completions per generation step and which ones to change)."""
    problems = [
        f"--{name} {values[name]}: expected {expected}"
        for name, (ok, expected) in FLAG_CHECKS.items()
        if name in values and values[name] is not None and not ok(values[name])
    ]
    if problems:  # the grouping rule below divides by values this list already refused
        return problems
    if values.get("num_generations") and "steps_per_generation" in values and "per_device_train_batch_size" in values:
        # mirrors trl.GRPOConfig.__post_init__ (TRL 1.16), which reports the derived generation_batch_size instead
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        per_step = values["per_device_train_batch_size"] * processes
        steps = values.get("steps_per_generation") or values.get("gradient_accumulation_steps") or 1
        if values.get("generation_batch_size"):
            total, how = values["generation_batch_size"], f"--generation_batch_size {values['generation_batch_size']}"
        else:
            total = per_step * steps
            which = "--steps_per_generation" if values.get("steps_per_generation") else "--gradient_accumulation_steps"
            how = (
                f"--per_device_train_batch_size {values['per_device_train_batch_size']} x {processes} process(es) x "
                f"{which} {steps}"
            )
        if total % values["num_generations"]:
            problems.append(
                f"--num_generations {values['num_generations']} must divide the completions generated per step, "
                f"{total} = {how}; change --num_generations or --per_device_train_batch_size"
            )
    return problems


def check_flags(values: Mapping[str, Any]) -> None:
    """Raise :func:`flag_problems` as one :class:`RecipeError` (see :func:`raise_problems`)."""
    raise_problems(flag_problems(values))


def raise_problems(problems: Sequence[str]) -> None:
    """Nothing for no problems; else one :class:`RecipeError` holding them all: the problem itself when there is one,
    else a count and one indented line per problem (``recipe_main`` prints it after ``error:``)."""
    if len(problems) == 1:
        raise RecipeError(problems[0])
    if problems:
        raise RecipeError(
            f"{len(problems)} problems with the options (found before loading any model):\n"
            + "\n".join(f"  {p}" for p in problems)
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _offline(*names: str) -> bool:
    return any(os.environ.get(n, "0").lower() in ("1", "true", "yes", "on") for n in names)


def _gpu_fix(flag: str, fix: str, what: str, package: str | None) -> str | None:
    """The problem of a GPU-only option on this machine (``package`` missing or no CUDA GPU), or None."""
    if package is not None and importlib.util.find_spec(package) is None:
        return f"{flag}: {what} is not installed here; pass `{fix}`, or install the gpu extra on a CUDA machine"
    if not _cuda():
        return f"{flag}: {what} needs a CUDA GPU (torch.cuda.is_available() is False); pass `{fix}`"
    return None


def device_problems(values: Mapping[str, Any]) -> list[str]:
    """What the options ask of this machine and it cannot do, each naming the flag that fixes it: vLLM (``use_vllm``,
    eval_math's ``backend vllm``), Liger kernels, bf16 without a bf16 GPU (unless ``use_cpu``), 4/8-bit loading and
    flash-attention without their packages or a CUDA GPU."""
    problems = []
    if values.get("use_vllm"):
        problems.append(_gpu_fix("--use_vllm true", "--use_vllm false", "vLLM", "vllm"))
    if values.get("backend") == "vllm":
        problems.append(_gpu_fix("--backend vllm", "--backend hf", "vLLM", "vllm"))
    if values.get("use_liger_kernel"):
        problems.append(_gpu_fix("--use_liger_kernel true", "--use_liger_kernel false", "liger-kernel", "liger_kernel"))
    if (values.get("bf16") or values.get("bf16_full_eval")) and not values.get("use_cpu"):
        from transformers.utils import is_torch_bf16_gpu_available

        if not is_torch_bf16_gpu_available():
            flag = "--bf16 true" if values.get("bf16") else "--bf16_full_eval true"
            why = "this GPU has no bf16 (Ampere or newer)" if _cuda() else "no CUDA GPU here"
            problems.append(f"{flag}: bf16 training needs a GPU that supports it ({why}); pass `--bf16 false` or "
                            "`--use_cpu true`")
    if values.get("load_in_4bit") and values.get("load_in_8bit"):
        problems.append("--load_in_4bit true and --load_in_8bit true: set at most one")
    for bits in ("4", "8"):
        if values.get(f"load_in_{bits}bit"):
            problems.append(_gpu_fix(f"--load_in_{bits}bit true", f"--load_in_{bits}bit false",
                                     f"{bits}-bit loading (bitsandbytes)", "bitsandbytes"))
    if values.get("attn_implementation") == "flash_attention_2":
        problems.append(_gpu_fix("--attn_implementation flash_attention_2", "--attn_implementation sdpa",
                                 "flash-attention", "flash_attn"))
    return [p for p in problems if p]


def source_problems(values: Mapping[str, Any]) -> list[str]:
    """Where the options name models, datasets and files this machine cannot reach: ``model_name_or_path``
    (:func:`model_source_problem`), ``dataset_name`` (:func:`dataset_source_problem`), ``*_file`` (must exist) and
    ``reward_model_path`` (a local folder)."""
    problems = [model_source_problem(values.get("model_name_or_path"))]
    if "dataset_name" in values:
        problems.append(dataset_source_problem(values.get("dataset_name")))
    for name, value in values.items():
        if name.endswith("_file") and isinstance(value, str) and value and not Path(value).is_file():
            problems.append(f"--{name} {value}: no such file")
    if values.get("reward_model_path") and not Path(values["reward_model_path"]).is_dir():
        problems.append(f"--reward_model_path {values['reward_model_path']}: no such folder")
    return [p for p in problems if p]


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


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
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
    # subclasses only for the help text: parse_recipe_args builds the original classes
    def title(t: type) -> str:
        root = t.__module__.split(".")[0]
        return f"{root}.{t.__qualname__} options" if root in ("trl", "trl_ext", "transformers") else (
            f"recipe options ({t.__qualname__})")

    grouped = [type(t.__name__, (t,), {"_argument_group_name": title(t)}) for t in dataclass_types]
    parser = trl.TrlParser(
        grouped, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [--config FILE] [--OPTION VALUE ...]",
        epilog="The first group holds the recipe's own options; the others come from the classes in their titles, "
        "documented in full by TRL (https://huggingface.co/docs/trl) and transformers (TrainingArguments).",
    )
    if default_config:
        try:
            shown = os.path.relpath(default_config)
        except ValueError:
            shown = str(default_config)
    if default_config:
        config_help = (f"YAML file of option: value pairs, layered over the recipe's default config ({shown}): options "
                       "the file sets replace the defaults, the others keep them; command-line flags override both.")
    else:
        config_help = "YAML file of option: value pairs (as in TRL scripts); command-line flags override it."
    parser.add_argument("--config", metavar="FILE", help=config_help)
    for action in parser._actions:  # trl.ModelConfig's help does not know the embedded model
        if action.dest == "model_name_or_path":
            action.help = (f"{action.help} {MODEL_NAME_HELP}" if action.help else MODEL_NAME_HELP)
    options = parser._option_string_actions
    overrides = dict(help_overrides or {})
    if "--overwrite_output_dir" in options and ("--resume_from_checkpoint" not in options or "resume_from_checkpoint" in overrides):
        overrides.setdefault("overwrite_output_dir", OVERWRITE_HELP_NO_RESUME)
    for name, text in overrides.items():
        if f"--{name}" not in options:
            raise ValueError(f"help_overrides names --{name}, which this recipe does not have")
        options[f"--{name}"].help = text
    return parser


OVERWRITE_HELP_NO_RESUME = (
    "Replace a finished run in --output_dir (delete its results first). Without it the recipe refuses, so results "
    "are never lost. This recipe cannot be resumed."
)


def parse_recipe_args(
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
    (:func:`source_problems`) and whatever a config class itself rejects (its ``__post_init__``; run with the
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
    # Two names of one setting (trl_ext.GRPOConfig: TRL's loss_type = length_normalization, scale_rewards =
    # normalize_by_std): a layer that sets one name replaces what lower layers set under the other.
    same_setting: dict[str, set[str]] = {}
    for dtype in dataclass_types:
        for upstream_name, (course_name, *_) in getattr(dtype, "UPSTREAM_OPTIONS", {}).items():
            same_setting.setdefault(upstream_name, set()).add(course_name)
            same_setting.setdefault(course_name, set()).add(upstream_name)

    merged: dict[str, Any] = {}
    source: dict[str, str] = {}

    def drop_other_names(layer_keys: set[str]) -> None:
        for key in layer_keys:
            for other in same_setting.get(key, ()):
                if other not in layer_keys:
                    merged.pop(other, None)

    for path in ([default_config] if default_config else []) + paths:
        layer = _read_yaml(path)
        env = layer.pop("env", {}) or {}
        if not isinstance(env, dict):
            raise RecipeError(f"--config {path}: `env` must be a mapping of variable: value")
        for key, value in env.items():  # TRL's `env:` block
            os.environ[key] = str(value)
        layer = {DEPRECATED_ALIASES.get(k, k) if f"--{DEPRECATED_ALIASES.get(k, k)}" in options else k: v
                 for k, v in layer.items()}
        drop_other_names(set(layer))
        merged.update(layer)
        source.update(dict.fromkeys(layer, str(path)))
    drop_other_names({arg[2:].split("=", 1)[0] for arg in args if arg.startswith("--")})
    problems = []
    unknown = parser.set_defaults_with_config(**merged)
    if unknown:
        keys = sorted({item[2:] for item in unknown[::2]})
        problems.append("unknown option(s) " + ", ".join(f"{k!r} (from {source[k]})" for k in keys)
                        + "; see --help for the options of this recipe")
    if paths and source.get("use_cpu") == str(default_config) and merged.get("use_cpu") and "--use_cpu" not in args:
        import torch

        if torch.cuda.is_available():
            print(f"note: use_cpu: true comes from the recipe's defaults ({default_config}); your --config does not "
                  "set it, so this run stays on the CPU. Set use_cpu: false in your file to use the GPU.", file=sys.stderr)
    for alias, name in DEPRECATED_ALIASES.items():  # the command line's aliases, read as their new names
        if f"--{name}" in options:
            args = [f"--{name}" if a == f"--{alias}" else a.replace(f"--{alias}=", f"--{name}=", 1) for a in args]
    # mirrors transformers.HfArgumentParser.parse_args_into_dataclasses, with the checks before construction
    namespace, remaining = parser.parse_known_args(args=args)
    if remaining:
        parser.error(f"unrecognized arguments: {' '.join(remaining)}")
    values = vars(namespace)
    values.pop("config", None)
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and "use_cpu" in values and (values["use_cpu"] or not _cuda()) and _is_main_process():
        print("note: accelerate runs FSDP only on GPUs; on the CPU (use_cpu true, or no GPU) this launch trains with plain "
              "data parallelism, every process holding the whole model", file=sys.stderr)
    flagged = flag_problems(values)
    problems += flagged
    devices = device_problems(values)
    problems += devices + source_problems(values)
    # the classes' own checks, with what device_problems refused switched off (TRL would raise on it first)
    constructed = dict(values)
    if devices:
        constructed.update({k: False for k in ("use_vllm", "use_liger_kernel", "bf16", "bf16_full_eval",
                                                "load_in_4bit", "load_in_8bit") if k in values})
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
    raise_problems(problems)
    return tuple(outputs)


# ------------------------------------------------------------------------------------------- output folder
def check_output_dir(
    output_dir: str | Path, overwrite: bool = False, resuming: bool = False, result_file: str = "metrics.json"
) -> Path:
    """Make sure ``output_dir`` can take this run's results, before any model work.

    * A finished run (``result_file``, default ``metrics.json``) or an unfinished run's ``checkpoint-*`` folders:
      refused, unless
      ``resuming`` (continue it) or ``overwrite`` (the previous run's :data:`RUN_ARTIFACTS` are deleted first,
      on the main process, so TensorBoard logs and checkpoints of two runs never mix).
    * The folder is created and a probe file written and removed, so an unwritable folder fails now.

    Raises:
        RecipeError: naming the folder and the ways forward (a new ``--output_dir``, ``--overwrite_output_dir``,
            ``--resume_from_checkpoint true``), or why it cannot be written.
    """
    out = Path(output_dir)
    finished = (out / result_file).is_file()
    checkpoints = sorted(out.glob("checkpoint-*")) if out.is_dir() else []
    if (finished or checkpoints) and not resuming:
        if not overwrite:
            what = f"a finished run ({result_file})" if finished else f"an unfinished run ({checkpoints[-1].name})"
            resume = "" if finished else ", or --resume_from_checkpoint true to continue it"
            raise RecipeError(
                f"--output_dir {out} holds {what}; choose a new --output_dir, or pass {OVERWRITE_FLAG} to replace "
                f"it{resume}"
            )
        if _is_main_process():
            for pattern in (*RUN_ARTIFACTS, result_file):
                for path in out.glob(pattern):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise RecipeError(f"--output_dir {out} is not writable: {err.strerror or err}") from None
    return out


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The highest-numbered complete ``checkpoint-N`` in ``output_dir`` (complete: it has ``trainer_state.json``,
    which transformers writes last), or None. A checkpoint cut short by a kill is skipped."""
    import re

    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()]
    for _, path in sorted(found, reverse=True):
        if (path / "trainer_state.json").is_file():
            return str(path)
    return None


def resolve_resume(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint folder to resume from, or None.

    ``None``/"false" -> None; "true" (any case) -> the latest complete ``checkpoint-N`` in ``output_dir``
    (:func:`latest_checkpoint`: what ``Trainer.train(resume_from_checkpoint=True)`` picks, minus a checkpoint cut
    short by a kill); anything else -> that folder.

    Raises:
        RecipeError: "true" with no complete checkpoint in ``output_dir``, or a path that is not a Trainer checkpoint.
    """
    if value is None or value is False or str(value).strip().lower() in ("", "false", "no", "none"):
        return None
    if value is True or str(value).strip().lower() in ("true", "yes", "latest"):
        found = latest_checkpoint(output_dir)
        if found is None:
            raise RecipeError(
                f"--resume_from_checkpoint true: no checkpoint-N folder in --output_dir {output_dir}; run without it "
                "to start, or give a checkpoint path"
            )
        return found
    path = Path(str(value))
    if not (path / "trainer_state.json").is_file():
        reason = "no such folder" if not path.is_dir() else "not a Trainer checkpoint (no trainer_state.json)"
        raise RecipeError(f"--resume_from_checkpoint {value}: {reason}")
    return str(path)


LOCAL_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Suffixes of the local dataset files the math recipes read (``trl_ext.data.math_datasets.LOCAL_FORMATS``)."""

_SOURCE_CACHE: dict[tuple, str | None] = {}  # (kind, name, offline) -> problem: one Hub query per name and process


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _hub_check(name: str, repo_type: str) -> str | None:
    """None when the Hub has ``name``; else why not (``"not found"`` or ``"unreachable (ConnectError)"``). One
    request with a 10 s timeout, no retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=10)
    except RepositoryNotFoundError:
        return "not found"
    except Exception as err:  # no network, proxy, DNS, gated repository...: say so instead of retrying later
        return f"unreachable ({type(err).__name__})"
    return None


def model_source_problem(name_or_path: str | None, flag: str = "--model_name_or_path") -> str | None:
    """Why a model is neither the embedded one, a local folder, nor a Hub id this machine can reach; None when it is.

    Checks the local Hugging Face cache first (works offline, ``HF_HUB_OFFLINE`` respected), then asks the Hub once
    (10 s timeout, no retries) whether the repository exists; the answer is remembered for the process.
    The embedded model (None, ``embedded`` or its full name) is fine when its package is installed; an empty name is
    a problem (naming ``--model_name_or_path embedded``), and so is the embedded model's package missing (how to get it).
    """
    from trl_ext.models import embedded_gguf_path, is_embedded

    if name_or_path is not None and not str(name_or_path).strip():
        return (f"{flag} {name_or_path!r}: empty; give a Hub id or a local folder, or {flag} {EMBEDDED_ALIAS} for the "
                "embedded SmolLM2-135M-Instruct")
    if is_embedded(name_or_path):
        try:
            embedded_gguf_path()
        except FileNotFoundError as err:
            return f"{flag} {name_or_path or EMBEDDED_ALIAS}: {err}"
        return None
    if Path(name_or_path).exists():
        return None
    name_or_path = str(name_or_path)
    local = f"{flag} {name_or_path}: no such local folder (if it is a recipe's output, run that recipe first)"
    if _looks_local(name_or_path):
        return local
    key = ("model", name_or_path, _offline("HF_HUB_OFFLINE"))
    if key not in _SOURCE_CACHE:
        from huggingface_hub import try_to_load_from_cache

        alternative = (f"; download it where the Hub is reachable, or pass a local model folder or {flag} "
                       f"{EMBEDDED_ALIAS} (the embedded SmolLM2-135M-Instruct)")
        if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            _SOURCE_CACHE[key] = None
        elif key[2]:
            _SOURCE_CACHE[key] = f"{local}, and not in the local Hugging Face cache (HF_HUB_OFFLINE is set){alternative}"
        else:
            hub = _hub_check(name_or_path, "model")
            _SOURCE_CACHE[key] = hub and (
                f"{local}, nor a model on the Hugging Face Hub" if hub == "not found"
                else f"{local}, and the Hugging Face Hub is {hub}{alternative}"
            )
    return _SOURCE_CACHE[key]


def _dataset_cached(name: str) -> bool:
    """Whether ``datasets`` can load hub dataset ``name`` offline: its files in the Hub cache, or a prepared copy in
    the ``datasets`` cache."""
    from datasets.config import HF_DATASETS_CACHE
    from huggingface_hub.constants import HF_HUB_CACHE

    hub = Path(HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}" / "snapshots"
    prepared = Path(HF_DATASETS_CACHE) / name.replace("/", "___")
    return (hub.is_dir() and any(hub.iterdir())) or prepared.is_dir()


def dataset_source_problem(name: str | None, flag: str = "--dataset_name") -> str | None:
    """Why a dataset is neither a local file nor a Hub dataset this machine can load; None when it is (or is unset).

    A name ending in .jsonl/.json/.parquet, or a path, must be an existing file. A Hub id must be in the local cache,
    or -- unless ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set -- answer one Hub request (10 s timeout, no
    retries: ``datasets`` itself would retry for most of a minute, then print a long traceback).
    """
    if name is None or Path(name).exists():
        return None  # unset (generated data), or an existing path: the loader reads it and names what is wrong
    name = str(name)
    if name.lower().endswith(LOCAL_DATA_SUFFIXES) or _looks_local(name):
        return f"{flag} {name}: no such file"
    key = ("dataset", name, _offline("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if key not in _SOURCE_CACHE:
        alternative = (f"; download it where the Hub is reachable, or pass a local {'/'.join(LOCAL_DATA_SUFFIXES)} "
                       "file with the same columns")
        local = f"{flag} {name}: not a local file"
        if _dataset_cached(name):
            _SOURCE_CACHE[key] = None
        elif key[2]:
            _SOURCE_CACHE[key] = f"{local}, and not in the local Hugging Face cache (HF_HUB_OFFLINE is set){alternative}"
        else:
            hub = _hub_check(name, "dataset")
            _SOURCE_CACHE[key] = hub and (
                f"{local}, nor a dataset on the Hugging Face Hub" if hub == "not found"
                else f"{local}, and the Hugging Face Hub is {hub}{alternative}"
            )
    return _SOURCE_CACHE[key]


def check_model_source(name_or_path: str | None, flag: str = "--model_name_or_path") -> None:
    """Raise :func:`model_source_problem` as a :class:`RecipeError`, if any."""
    raise_problems([p for p in [model_source_problem(name_or_path, flag)] if p])


def check_fills_one_step(rows: int, training_args: Any, source: str, unit: str = "rows") -> None:
    """Refuse, before any model work, a training set from which the trainer would take no batch at all: it would
    train 0 steps and exit 0 after evaluating before and after (transformers only says "There seems not to be a
    single sample in your epoch_iterator").

    * GRPO (``training_args`` has ``num_generations``): TRL's sampler hands out whole generation batches of
      ``generation_batch_size / num_generations`` prompts (``generation_batch_size`` = ``per_device_train_batch_size``
      x processes x ``steps_per_generation``, which defaults to ``gradient_accumulation_steps``) and drops an
      incomplete one, so fewer prompts than one generation batch train 0 steps.
    * SFT, DPO, reward (transformers' dataloader): a last incomplete batch or accumulation window still makes an
      optimizer step, so only ``dataloader_drop_last`` with fewer rows than one batch on every process
      (``per_device_train_batch_size`` x processes) trains 0 steps.

    ``max_steps`` does not help: with 0 batches per epoch transformers stops at step 0 whatever the budget.

    Args:
        rows: training examples (prompts for GRPO).
        training_args: the trainer's config.
        source: what the rows come from, as the user set it (``"--train_file x.jsonl"``).
        unit: what a row is called in the message (``"rows"``, ``"pairs"``, ``"prompts"``).

    Raises:
        RecipeError: naming the numbers and the flags that change them.
    """
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    batch = training_args.per_device_train_batch_size
    have = f"{rows} training {unit[:-1] if rows == 1 and unit.endswith('s') else unit}"
    if getattr(training_args, "num_generations", None):
        steps = training_args.steps_per_generation or training_args.gradient_accumulation_steps
        completions = batch * processes * steps
        needed = completions // training_args.num_generations
        if rows < needed:
            which = ("--gradient_accumulation_steps" if steps == training_args.gradient_accumulation_steps
                     else "--steps_per_generation")
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


def file_digest(path: str | Path) -> str:
    """``"<path> sha256:<hex>"`` of a file's bytes: what a cached result computed from that file depends on."""
    import hashlib

    return f"{path} sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def check_model_options(model_args: Any) -> None:
    """Model checks that need no model: the backend options (4/8-bit, flash-attention: which extra is missing) and
    :func:`check_model_source`.

    Raises:
        RecipeError: with the message of ``trl_ext.models.check_backend_available`` or :func:`check_model_source`.
    """
    from trl_ext.models import check_backend_available

    try:
        check_backend_available(
            load_in_4bit=model_args.load_in_4bit, load_in_8bit=model_args.load_in_8bit,
            attn_implementation=model_args.attn_implementation,
        )
    except (ImportError, RuntimeError, ValueError) as err:
        raise RecipeError(str(err)) from None
    check_model_source(model_args.model_name_or_path)


# ------------------------------------------------------------------------------------------- the run
_CURRENT_RUN: RecipeRun | None = None


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def _json_config(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):  # TrainingArguments: enums to values, *_token fields masked
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return obj


def library_versions() -> dict[str, str]:
    """Installed versions of :data:`VERSIONED_PACKAGES` plus Python, and the git commit of this checkout if any."""
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        if commit.returncode == 0:
            versions["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def check_resume(checkpoint: str | Path, training_args: Any) -> None:
    """Refuse, before any model work, to resume ``checkpoint`` with options that would not continue it exactly
    (``trl_ext.trainers.upstream.check_resume_options``: processes, batch size, accumulation, seed, GRPO's rollout
    shape); the trainer checks the same again in ``train()``.

    Raises:
        RecipeError: naming each option that changed with its value in the checkpoint and now, and how to start over.
    """
    from trl_ext.trainers.upstream import ResumeMismatchError, check_resume_options

    try:
        check_resume_options(checkpoint, training_args, RECIPE_START_OVER)
    except ResumeMismatchError as err:
        raise RecipeError(str(err)) from None


RECIPE_START_OVER = (
    "run without --resume_from_checkpoint, with a new --output_dir (or --overwrite_output_dir to replace this run)"
)
"""How a recipe's user starts over instead of resuming (see :func:`check_resume`)."""


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command that resumes this run: the same flags, ``--resume_from_checkpoint true`` instead of any given."""
    argv = list(sys.argv if argv is None else argv)
    script, args, kept, i = argv[0], argv[1:], [], 0
    while i < len(args):
        if args[i] == "--resume_from_checkpoint":
            i += 2
            continue
        if args[i].startswith("--resume_from_checkpoint="):
            i += 1
            continue
        kept.append(args[i])
        i += 1
    try:
        relative = os.path.relpath(script)
        script = script if relative.startswith("..") else relative
    except ValueError:
        pass
    launcher = "uv run accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ else "uv run python"
    return f"{launcher} {shlex.join([script, *kept, '--resume_from_checkpoint', 'true'])}"


class RecipeRun:
    """Bookkeeping of one recipe run; constructing it checks the output folder and resolves the checkpoint.

    Args:
        name: the recipe's name (``"grpo_math"``), recorded in ``metrics.json``.
        output_dir: the run's ``--output_dir``.
        configs: the resolved argument objects by name (``{"script_args": ..., "training_args": ...}``), recorded
            in ``metrics.json`` (TrainingArguments through ``to_dict``, which masks ``*_token`` values).
        overwrite: ``--overwrite_output_dir``.
        resume: ``--resume_from_checkpoint`` as parsed (None, "true" or a path); see :func:`resolve_resume`.
        result_file: the file whose presence marks a finished run of this recipe.

    Attributes:
        resume_from_checkpoint: the checkpoint folder to pass to ``trainer.train``, or None.
        resumed_step: that checkpoint's optimizer step (0 when not resuming): this process trains the steps after it.
        phase_seconds: wall seconds per phase (:meth:`phase`), recorded in ``metrics.json``.

    Raises:
        RecipeError: from :func:`check_output_dir`, :func:`resolve_resume` and :func:`check_resume`.
    """

    def __init__(self, name: str, output_dir: str | Path, configs: Mapping[str, Any], *, overwrite: bool = False,
                 resume: str | bool | None = None, result_file: str = "metrics.json"):
        global _CURRENT_RUN
        self.name = name
        self.output_dir = Path(output_dir)
        self.configs = dict(configs)
        self.resume_from_checkpoint = resolve_resume(resume, output_dir)
        check_output_dir(output_dir, overwrite, self.resume_from_checkpoint is not None, result_file)
        training_args = self.configs.get("training_args")
        if self.resume_from_checkpoint is not None and isinstance(training_args, TrainingArguments):
            check_resume(self.resume_from_checkpoint, training_args)
        # read now: save_total_limit may delete that checkpoint once this run saves a newer one
        self.resumed_step = 0 if self.resume_from_checkpoint is None else int(json.loads(
            (Path(self.resume_from_checkpoint) / "trainer_state.json").read_text()).get("global_step", 0))
        self.phase_seconds: dict[str, float] = {}
        self.reused: list[str] = []
        self.started = time.time()
        self._saving = False
        self._exit_after_save: str | None = None
        _CURRENT_RUN = self

    def make_current(self) -> None:
        """Make this run the one Ctrl-C reports on (after a nested recipe, e.g. rlhf's reward-model stage)."""
        global _CURRENT_RUN
        _CURRENT_RUN = self

    @property
    def resuming(self) -> bool:
        return self.resume_from_checkpoint is not None

    def steps_summary(self, global_step: int, seconds: float) -> str:
        """``"2 steps in 171 s"`` for the steps this process trained (``global_step`` minus :attr:`resumed_step`),
        ``"(resumed from step 1; 3 in all)"`` added on resume."""
        done = global_step - self.resumed_step
        text = f"{done} step{'s' if done != 1 else ''} in {seconds:.0f} s"
        return text + (f" (resumed from step {self.resumed_step}; {global_step} in all)" if self.resuming else "")

    @contextmanager
    def phase(self, name: str):
        """Time a phase (``load_data``, ``load_model``, ``eval_before``, ``train``, ...); repeated names add up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = round(self.phase_seconds.get(name, 0.0) + time.perf_counter() - start, 3)

    def reuse_or_compute(self, name: str, key: Mapping[str, Any], compute: Callable[[], Any]) -> Any:
        """On resume, the result a previous run of this folder saved under ``name`` with the same ``key``; else
        ``compute()``, saved to ``output_dir/<name>.json`` (main process) for a later resume.

        ``key`` holds what the result depends on (model, held-out rows, generation budget...): a resumed run whose
        key differs computes again. Reused names are listed in ``metrics.json`` under ``reused``.
        """
        path = self.output_dir / f"{name}.json"
        key = json.loads(json.dumps(key, default=str))
        if self.resuming and path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                self.reused.append(name)
                return saved["result"]
        result = compute()
        if _is_main_process() and result is not None:
            path.write_text(json.dumps({"key": key, "result": result}, default=str))
        return result

    def provenance(self) -> dict[str, Any]:
        """``command``, ``config`` (every resolved argument object), ``versions``, ``phase_seconds``,
        ``resumed_from`` (the checkpoint), ``resumed_from_step`` (its step; 0 when not resuming) and ``reused``: the keys
        :meth:`write_metrics` adds."""
        return {
            "recipe": self.name,
            "command": shlex.join(sys.argv),
            "config": {k: _json_config(v) for k, v in self.configs.items()},
            "versions": library_versions(),
            "phase_seconds": {**self.phase_seconds, "total": round(time.time() - self.started, 3)},
            "resumed_from": self.resume_from_checkpoint,
            "resumed_from_step": self.resumed_step,
            "reused": self.reused,
        }

    def write_metrics(self, metrics: Mapping[str, Any]) -> Path:
        """Write ``metrics`` plus :meth:`provenance` to ``output_dir/metrics.json`` (written last: its presence
        marks a finished run); return the path."""
        path = self.output_dir / "metrics.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**metrics, **self.provenance()}, indent=2, default=str))
        tmp.replace(path)
        return path

    def attach(self, trainer: Any, first_logs: Mapping[str, float] | None = None) -> None:
        """Add this run's TrainerCallback to ``trainer``: it logs the last step whatever ``logging_steps`` is,
        makes a Ctrl-C that arrives while a checkpoint is written wait until that checkpoint is complete, and logs
        ``first_logs`` (e.g. the held-out accuracy before training) at step 0 once the loggers are set up (not
        again on resume)."""
        trainer.add_callback(_RecipeCallback(self, trainer, first_logs))

    @staticmethod
    def log_after_training(trainer: Any, logs: Mapping[str, float]) -> None:
        """Log ``logs`` (e.g. the held-out accuracy after training) at the last step to every ``report_to``
        logger, and flush TensorBoard (its writer was closed at the end of training)."""
        from transformers import Trainer
        from transformers.integrations import TensorBoardCallback

        Trainer.log(trainer, dict(logs))  # not the GRPO override: no pending training metrics to merge
        for cb in trainer.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None:
                cb.tb_writer.close()
                cb.tb_writer = None

    def interrupted(self, signum: int) -> None:
        """Signal handler body: one line naming the last checkpoint and the resume command, then exit 130 at once
        (or right after the checkpoint being written)."""
        if self._saving:
            self._exit_after_save = signal.Signals(signum).name
            return
        _stop(self.output_dir, signal.Signals(signum).name)


class _RecipeCallback(TrainerCallback):
    def __init__(self, run: RecipeRun, trainer: Any = None, first_logs: Mapping[str, float] | None = None):
        self.run, self.trainer, self.first_logs = run, trainer, dict(first_logs or {})

    def on_train_begin(self, args, state, control, **kwargs):
        if self.first_logs and state.global_step == 0 and self.trainer is not None:
            from transformers import Trainer

            Trainer.log(self.trainer, dict(self.first_logs))  # after the loggers' own on_train_begin
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps and args.logging_strategy != "no":
            control.should_log = True  # DefaultFlowCallback logs only multiples of logging_steps
        self.run._saving = bool(control.should_save)
        return control

    def on_save(self, args, state, control, **kwargs):
        self.run._saving = False
        if self.run._exit_after_save:
            _stop(self.run.output_dir, self.run._exit_after_save)
        return control


def _stop(output_dir: Path, signame: str) -> None:
    if _is_main_process():
        last = latest_checkpoint(output_dir)
        reason = "Stopped (Ctrl-C)" if signame == "SIGINT" else f"Stopped ({signame})"
        if last:
            line = f"{reason}. Last checkpoint: {last}. Resume with: {resume_command()}"
        else:
            line = f"{reason} before the first checkpoint in {output_dir}; nothing to resume, run again to start over."
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def _handle_signal(signum, frame):  # noqa: ARG001
    if _CURRENT_RUN is not None:
        _CURRENT_RUN.interrupted(signum)
    else:
        print("Stopped (Ctrl-C) before the run started.", file=sys.stderr, flush=True)
        os._exit(130)


def install_interrupt_handler() -> None:
    """Ctrl-C / SIGTERM stop the recipe at once with one line (no traceback); also when only the launcher that
    started this process dies (Linux: the kernel sends SIGINT to the child, so ``accelerate launch``'s child never
    runs on alone)."""
    signal.signal(signal.SIGINT, _handle_signal)
    signal.signal(signal.SIGTERM, _handle_signal)
    if sys.platform.startswith("linux") and "ACCELERATE_MIXED_PRECISION" in os.environ:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def recipe_main(
    main: Callable[..., Any],
    parse: Callable[[], tuple],
    speed_defaults: str | Path | None = None,
    **main_kwargs: Any,
) -> Any:
    """Run a recipe from the command line: Ctrl-C handling, then ``main(*parse(), **main_kwargs)``; a
    :class:`RecipeError` (or a missing file) becomes one ``error: ...`` line on stderr and exit status 2.

    With ``speed_defaults`` (the recipe's default config), ``trl_ext.runtime.apply_speed_defaults`` picks threads and
    CPU precision on the parsed training arguments (the second dataclass) before ``main`` runs -- so before any
    trainer config is derived from them -- and ``main`` gets what it chose as ``speed=``.
    """
    install_interrupt_handler()
    try:
        args = parse()
        if speed_defaults is not None:
            from trl_ext.runtime import apply_speed_defaults

            dtype = getattr(args[2], "dtype", "float32") if len(args) > 2 else "float32"  # the ModelConfig's
            main_kwargs["speed"] = apply_speed_defaults(args[1], default_config=speed_defaults, dtype=dtype)
        return main(*args, **main_kwargs)
    except (RecipeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


COMPARISON_HELP = {
    "resume_from_checkpoint": "Refused: a comparison trains every arm from scratch, so there is nothing to resume "
    "(--overwrite_output_dir replaces an earlier comparison in the same --output_dir).",
    "max_steps": "Optimizer steps of every arm (>= 1: the arms are compared at one fixed step budget).",
}
"""``help_overrides`` of the comparison recipes (compare_upstream, grpo_sort, grpo_ablations): the inherited options
they treat their own way."""


def refuse_comparison_resume(training_args: Any) -> None:
    """Raise :class:`RecipeError` when ``--resume_from_checkpoint`` is given to a comparison recipe: every arm is
    trained from scratch, so there is nothing to resume."""
    if training_args.resume_from_checkpoint not in (None, "", "false", "False"):
        raise RecipeError(
            "--resume_from_checkpoint: a comparison trains every arm from scratch and cannot be resumed; run it again "
            "(add --overwrite_output_dir to replace an earlier comparison in the same --output_dir)"
        )


@contextmanager
def user_input(what: str = ""):
    """Turn ValueError/FileNotFoundError raised while reading user input (data files, options) into RecipeError."""
    try:
        yield
    except RecipeError:
        raise
    except (ValueError, FileNotFoundError) as err:
        raise RecipeError(f"{what}{err}") from None


# ------------------------------------------------------------------------------------------- reports
def add_provenance(json_path: str | Path, run: RecipeRun) -> None:
    """Add ``run``'s provenance (command, configs, versions, phase times) to an existing JSON report."""
    path = Path(json_path)
    data = json.loads(path.read_text())
    data.update(run.provenance())
    path.write_text(json.dumps(data, indent=2, default=str))



def print_before_after(title: str, before: Mapping[str, float], after: Mapping[str, float], keys: Sequence[str]) -> Console:
    """Print a held-out before/after table of ``keys``; return the console for the closing lines."""
    table = Table(title=title)
    for column in ("held-out", "before", "after"):
        table.add_column(column)
    for key in keys:
        table.add_row(key, f"{before[key]:.4f}", f"{after[key]:.4f}")
    console = Console(soft_wrap=True)  # paths in the closing lines stay whole
    console.print(table)
    return console


def write_report(
    output_dir: str | Path,
    report: dict[str, Any],
    title: str,
    before: dict[str, float],
    after: dict[str, float],
    keys: Sequence[str],
    run: RecipeRun | None = None,
) -> Console:
    """Write ``report`` to ``output_dir/metrics.json`` (with ``run``'s provenance when given) and print a
    before/after table of ``keys``. Returns the console, for the recipe's closing lines."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if run is not None:
        run.write_metrics(report)
    else:
        (output_dir / "metrics.json").write_text(json.dumps(report, indent=2, default=str))
    return print_before_after(title, before, after, keys)


def plot_curves(
    log_history: Sequence[Mapping[str, Any]],
    panels: Sequence[tuple[str, str]],
    path: str | Path,
    points: Mapping[str, Sequence[tuple[int, float]]] | None = None,
) -> Path | None:
    """One panel per ``(log key, title)`` of the training log against the step; ``points`` adds marked values
    (e.g. ``{"eval_accuracy": [(0, 0.09), (40, 0.675)]}``) to the panel of that key. Panels with no data are
    left out; returns the PNG path, or None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = dict(points or {})
    series = {key: [(e["step"], e[key]) for e in log_history if key in e and "step" in e] for key, _ in panels}
    shown = [(key, title) for key, title in panels if series[key] or points.get(key)]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], shown):
        if series[key]:
            ax.plot(*zip(*series[key]), marker=".")
        if points.get(key):
            ax.plot(*zip(*points[key]), marker="o", linestyle="--", color="tab:red")
            for step, value in points[key]:
                ax.annotate(f"{value:.3g}", (step, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_model_card(trainer: Any, output_dir: str | Path, base_model: str | None, dataset: str | None = None) -> Path:
    """Write ``output_dir/README.md`` with TRL's model card template, naming the real base model
    (``trl_ext.models.base_model_id``: the embedded model's Hub id for the embedded model, by name or cache folder)
    and the output folder as the model to load (TRL's own card names ``None`` and the folder's bare name for local
    runs)."""
    from trl.trainer.utils import generate_model_card

    from trl_ext.models import base_model_id

    base = base_model_id(base_model)
    embedded = base == EMBEDDED_BASE_MODEL and str(base_model) != EMBEDDED_BASE_MODEL  # our dequantized copy of it
    card = generate_model_card(
        base_model=base,
        model_name=Path(output_dir).name,
        hub_model_id=str(output_dir),
        dataset_name=None,
        tags=sorted(set(getattr(trainer, "_tag_names", [])) | {"trl", "trl_ext"}),
        wandb_url=None,
        trackio_url=None,
        trainer_name=getattr(trainer, "_name", type(trainer).__name__),
        trainer_citation=getattr(trainer, "_paper", {}).get("citation"),
        template_file=getattr(trainer, "_template_file", None),
        paper_title=getattr(trainer, "_paper", {}).get("title"),
        paper_id=getattr(trainer, "_paper", {}).get("id"),
    )
    text = str(card)
    if Path(base).exists():  # a local base model: no Hub link
        text = text.replace(f"[{base}](https://huggingface.co/{base})", f"`{base}` (local)")
    if embedded:
        text = text.replace(
            f"[{base}](https://huggingface.co/{base})",
            f"[{base}](https://huggingface.co/{base}) (trl_ext's embedded copy: its Q4_1 GGUF, dequantized)",
        )
    if dataset:
        text = text.replace("It has been trained using", f"Training data: {dataset}.\nIt has been trained using", 1)
    path = Path(output_dir) / "README.md"
    path.write_text(text)
    return path
