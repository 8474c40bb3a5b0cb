"""One recipe run: its output folder, resume, Ctrl-C, phase times and provenance.

A recipe's ``main`` gets a :class:`RecipeRun` from ``@trl_ext.cli.recipe`` (or builds one itself)::

    run = RecipeRun("grpo_math", training_args.output_dir, {"script_args": ..., "training_args": ...},
                    overwrite=script_args.overwrite_output_dir, resume=training_args.resume_from_checkpoint)
    with run.phase("load_model", breakdown="model_load"):
        model, tokenizer, peft_config = ...
    before = run.reuse_or_compute("eval_before", key, evaluate)   # read back on resume instead of recomputed
    run.attach(trainer)                                            # last step logged, Ctrl-C waits for a checkpoint
    run.profile(trainer)                                           # generation/forward/backward/... seconds
    trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)

and ends with ``trl_ext.report.finish(run, ...)``, which writes ``metrics.json`` with :meth:`RecipeRun.provenance`.

* A folder that holds a finished run (``metrics.json``) or an unfinished run's checkpoints is never silently reused:
  the run refuses unless ``--overwrite_output_dir`` (delete that run's outputs first) or
  ``--resume_from_checkpoint`` (continue it) is given (:func:`check_output_dir`).
* ``--resume_from_checkpoint true`` picks the latest complete ``checkpoint-N`` in ``--output_dir``
  (:func:`latest_checkpoint`); a path picks that checkpoint. The options a resume depends on are compared with the
  checkpoint's before any model work (:func:`check_resume`).
* With ``handle_signals`` (what ``trl_ext.cli.main`` asks for), Ctrl-C and SIGTERM stop the run at once with one
  line naming the last checkpoint and the command that resumes it (the command as typed, launcher included:
  :func:`command_line`); a checkpoint being written is finished first; the first stop signal sets the line and the
  exit status.
* One :class:`trl_ext.measurement.profiling.PhaseTimer` (:attr:`RecipeRun.timer`) holds both the run's phases
  (``phase_seconds`` in ``metrics.json``: load_data, load_model, eval_before, train, ...) and the exclusive
  breakdown the profiler fills (``time_breakdown``: model_load, evaluation, generation, backward, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainingArguments

from trl_ext.errors import RecipeError
from trl_ext.measurement.profiling import PhaseTimer, StepProfiler, time_breakdown
from trl_ext.measurement.roofline import RooflineRecorder

OVERWRITE_FLAG = "--overwrite_output_dir"
"""The one flag, in every recipe, that allows replacing a finished run in ``--output_dir``."""


VERSIONED_PACKAGES = ("trl_ext", "trl", "transformers", "torch", "accelerate", "datasets", "peft", "vllm")
"""Packages whose installed versions ``metrics.json`` records (absent ones are left out)."""


RUN_ARTIFACTS = ("metrics.json", "eval_before.json", "rollouts.jsonl", "runs", "checkpoint-*")
"""What :func:`check_output_dir` deletes from a folder on ``--overwrite_output_dir``: a previous run's metrics, its
cached before-evaluation, its rollout samples, its TensorBoard logs and its checkpoints (model files are replaced when
the new run saves)."""


def is_main_process() -> bool:
    """Whether this is the main process of a launch (``RANK`` 0, or no launch), without initializing anything."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


# ------------------------------------------------------------------------------------------- output folder
def check_output_dir(
    output_dir: str | Path,
    overwrite: bool = False,
    resuming: bool = False,
    result_file: str | Sequence[str] = "metrics.json",
) -> Path:
    """Make sure ``output_dir`` can take this run's results, before any model work.

    * A finished run (``result_file``, default ``metrics.json``; of several result files, the first that exists) or
      an unfinished run's ``checkpoint-*`` folders: refused, unless ``resuming`` (continue it) or ``overwrite`` (the
      previous run's :data:`RUN_ARTIFACTS` and every result file are deleted first, on the main process, so
      TensorBoard logs and checkpoints of two runs never mix and no stale result survives a stopped run).
    * The folder is created and a probe file written and removed, so an unwritable folder fails now.

    Raises:
        RecipeError: naming the folder and the ways forward (a new ``--output_dir``, ``--overwrite_output_dir``,
            ``--resume_from_checkpoint true``), or why it cannot be written.
    """
    out = Path(output_dir)
    result_files = [result_file] if isinstance(result_file, str) else list(result_file)
    finished = next((name for name in result_files if (out / name).is_file()), None)
    checkpoints = sorted(out.glob("checkpoint-*")) if out.is_dir() else []
    if (finished or checkpoints) and not resuming:
        if not overwrite:
            what = f"a finished run ({finished})" if finished else f"an unfinished run ({checkpoints[-1].name})"
            resume = "" if finished else ", or --resume_from_checkpoint true to continue it"
            raise RecipeError(
                f"--output_dir {out} holds {what}; choose a new --output_dir, or pass {OVERWRITE_FLAG} to replace "
                f"it{resume}"
            )
        if is_main_process():
            for pattern in (*RUN_ARTIFACTS, *result_files):
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
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()
    ]
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


def check_resume(checkpoint: str | Path, training_args: Any) -> None:
    """Refuse, before any model work, to resume ``checkpoint`` with options that would not continue it exactly
    (``trl_ext.trainers.resume.check_resume_options``: the options that change which rows a step reads, for the
    config's trainer), and warn once for each option that changes what the steps after the checkpoint compute; the
    trainer checks the same again in ``train()``, and the number of training rows.

    Raises:
        RecipeError: naming each option that changed with its value in the checkpoint and now, and how to start over.
    """
    from trl_ext.trainers.resume import (
        ResumeMismatchError,
        check_resume_options,
    )  # only on resume: loads TRL's trainers

    try:
        check_resume_options(checkpoint, training_args, RECIPE_START_OVER)
    except ResumeMismatchError as err:
        raise RecipeError(str(err)) from None


RECIPE_START_OVER = (
    "run without --resume_from_checkpoint, with a new --output_dir (or --overwrite_output_dir to replace this run)"
)
"""How a recipe's user starts over instead of resuming (see :func:`check_resume`)."""


_LAUNCHER_SCRIPTS = ("uv", "accelerate", "accelerate-launch", "torchrun")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")


def _read_process(pid: int) -> tuple[int, list[str]] | None:
    """``(parent pid, command line words)`` of process ``pid`` from ``/proc``, or None where it cannot be read."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)", which may hold spaces: state, ppid
    except (OSError, ValueError, IndexError):
        return None
    return parent, [os.fsdecode(w) for w in words]


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python[0-9.]*", Path(word).name) is not None


def _as_typed(words: Sequence[str]) -> list[str] | None:
    """A launcher's command line as a person types it, or None when ``words`` is no launcher: ``uv run``,
    ``accelerate launch``, ``accelerate-launch``, ``torchrun``, or ``python -m`` of torch's or accelerate's launch
    module.

    A console script run through its shebang (``accelerate``, ``torchrun``) shows in ``/proc`` as ``[interpreter,
    /path/to/script, ...]``: it is written as its name where that name finds the same file on ``PATH`` (else its
    path); ``uv`` (a shim may have run it by its full path) as ``uv``; a ``python -m`` launcher keeps its interpreter
    as given."""
    words = list(words)
    if len(words) >= 2 and _is_python(words[0]) and Path(words[1]).name in _LAUNCHER_SCRIPTS:
        words = words[1:]  # the shebang's interpreter, then the script's resolved path
        found = shutil.which(Path(words[0]).name)
        if found and os.path.exists(words[0]) and os.path.samefile(found, words[0]):
            words[0] = Path(words[0]).name
    if words and Path(words[0]).name == "uv":
        words[0] = "uv"
    name = Path(words[0]).name if words else ""
    if [name, *words[1:2]] in (["uv", "run"], ["accelerate", "launch"]) or name in ("accelerate-launch", "torchrun"):
        return words
    if len(words) >= 3 and _is_python(words[0]) and words[1] == "-m" and words[2] in _LAUNCHER_MODULES:
        return words
    return None


def _is_script(word: str, before: str | None, script: str) -> bool:
    """Whether ``word`` in a launcher's command names the script this process runs (``sys.argv[0]`` = ``script``):
    the same path or file name, or (after ``-m``) the module whose file it is."""
    if before in ("-m", "--module"):
        stem = word.replace(".", "/")
        return script.endswith((f"{stem}.py", f"{stem}/__main__.py"))
    return word == script or Path(word).name == Path(script).name


def typed_command(
    argv: Sequence[str] | None = None,
    *,
    pid: int | None = None,
    read_process: Callable[[int], tuple[int, list[str]] | None] | None = None,
) -> list[str] | None:
    """The command, as typed, whose launchers started this process: ``["uv", "run", "accelerate", "launch",
    "--config_file", "X", "recipes/grpo_math.py", "--max_steps", "5"]``; None when no launcher started it (a plain
    ``python recipes/grpo_math.py``) or ``/proc`` cannot be read (not Linux).

    Walks up the parent processes while each is a launcher (``uv run``, ``accelerate launch``, ``torchrun``,
    ``python -m torch.distributed.run``, written as typed: :func:`_as_typed`) whose command ends with this
    process's script and flags (``argv``, default ``sys.argv``: the script as the launcher was given it, then the
    same flags); the topmost such launcher's command is the one a person (or a job script) typed.

    Args:
        argv: this process's script and flags (default ``sys.argv``).
        pid: the process to start from (default this one).
        read_process: ``pid -> (parent pid, command line words)`` or None (default: ``/proc``); tests pass a fake.
    """
    script, *flags = list(sys.argv if argv is None else argv)
    read_process = read_process or _read_process
    found, current = None, os.getpid() if pid is None else pid
    for _ in range(32):  # a launcher chain is a few processes deep; never loop on a broken /proc
        this = read_process(current)
        if this is None or this[0] <= 1:
            break
        parent = read_process(this[0])
        words = None if parent is None else _as_typed(parent[1])
        cut = None if words is None else len(words) - len(flags) - 1
        if words is None or cut < 1 or words[cut + 1 :] != flags:
            break
        if not _is_script(words[cut], words[cut - 1], script):
            break
        found, current = words, this[0]
    return found


@functools.cache
def launched_as() -> list[str] | None:
    """:func:`typed_command` of this process, read once: :func:`install_interrupt_handler` and a run that handles
    signals read it at start, while the launchers live (a SIGTERM to the process group stops the launcher before
    this process prints its resume line, and /proc then shows the process that adopted it)."""
    return typed_command()


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that runs this process's script with ``argv``'s flags (default ``sys.argv``).

    Started by a launcher (``uv run``, ``accelerate launch``, ``torchrun``: :func:`typed_command`), the command as it
    was typed, launcher and its options included, with ``argv``'s flags after the script. Else (a plain ``python``,
    or no ``/proc`` to read): the launcher, the script relative to the working directory (as given when it lies
    outside), the flags.

    That launcher reproduces this launch without accelerate's "values were not passed" warning (which a bare ``uv run
    accelerate launch`` prints): ``uv run python`` for one process without accelerate's mixed precision (the same
    job: trl_ext.runtime picks the threads either way), else ``uv run accelerate launch`` with every value that
    warning names (``--num_processes``, ``--num_machines``, ``--mixed_precision``, ``--dynamo_backend``;
    ``--multi_gpu`` for several processes, torchrun's launcher, which also runs CPU processes). A launch config's
    other settings (FSDP, DeepSpeed) are not in it: repeat your ``--config_file``."""
    script, *flags = list(sys.argv if argv is None else argv)
    if script == sys.argv[0]:  # this process's script: its launchers' command as typed, where /proc shows it
        typed = launched_as()
        if typed is not None:
            return shlex.join([*typed[: len(typed) - len(sys.argv) + 1], *flags])
    try:
        relative = os.path.relpath(script)
        script = script if relative.startswith("..") else relative
    except ValueError:
        pass
    launcher = "uv run python"
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        machines = max(1, processes // int(os.environ.get("LOCAL_WORLD_SIZE", processes)))
        precision = os.environ["ACCELERATE_MIXED_PRECISION"].lower()
        if processes > 1 or precision != "no":
            launcher = (
                f"uv run accelerate launch{' --multi_gpu' if processes > 1 else ''} --num_processes {processes} "
                f"--num_machines {machines} --mixed_precision {precision} --dynamo_backend "
                f"{os.environ.get('ACCELERATE_DYNAMO_BACKEND', 'no').lower()}"
            )
    return f"{launcher} {shlex.join([script, *flags])}"


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command that resumes this run: the same flags, ``--resume_from_checkpoint true`` instead of any given."""
    argv = list(sys.argv if argv is None else argv)
    args, kept, i = argv[1:], [], 0
    while i < len(args):
        if args[i] == "--resume_from_checkpoint":
            i += 2
            continue
        if args[i].startswith("--resume_from_checkpoint="):
            i += 1
            continue
        kept.append(args[i])
        i += 1
    return command_line([argv[0], *kept, "--resume_from_checkpoint", "true"])


# ------------------------------------------------------------------------------------------- provenance
def file_digest(path: str | Path) -> str:
    """``"<path> sha256:<hex>"`` of a file's bytes: what a cached result computed from that file depends on."""
    import hashlib

    return f"{path} sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def evaluation_key(model: str | None, test_file: str | Path, **depends_on: Any) -> dict[str, Any]:
    """What a before-evaluation depends on (a :meth:`RecipeRun.reuse_or_compute` key): the starting ``model``, the
    held-out file's bytes (:func:`file_digest`) and ``depends_on``, where a dataclass (a recipe's own options) counts
    without the options that change no result (``overwrite_output_dir``)."""
    key: dict[str, Any] = {"model": model, "test_file": file_digest(test_file)}
    for name, value in depends_on.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: v for k, v in dataclasses.asdict(value).items() if k != "overwrite_output_dir"}
        key[name] = value
    return key


def _json_config(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):  # TrainingArguments: enums to values, *_token fields masked
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return obj


GIT_KEYS = ("commit", "describe", "dirty", "root")
"""What :func:`git_state` reads of a git checkout."""


def git_state(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """``{"commit": sha, "describe": git describe --tags --always --dirty, "dirty": bool, "root": the checkout's
    folder}`` of the git checkout holding ``path``: the one place trl_ext reads git. ``dirty`` is True when tracked
    files differ from the commit or untracked files that git does not ignore exist. Every value is None where git or
    the repository is unavailable.

    Default ``path``: trl_ext's own source tree, which counts only when the package's files are tracked there. A
    trl_ext installed into another project's environment (a wheel in a ``.venv`` inside the CS336 course repository)
    lies in a folder that project's repository ignores: that repository's commit is not trl_ext's, so all None
    (the project's own checkout is :func:`project_git_state`)."""
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        if path is None:  # the package's own files tracked: a checkout of trl_ext, not of a project it is installed in
            git("ls-files", "--error-unmatch", "--", Path(__file__).name)
        state = {
            "commit": git("rev-parse", "HEAD") or None,
            "describe": git("describe", "--tags", "--always", "--dirty") or None,
            "dirty": bool(git("status", "--porcelain")),
            "root": git("rev-parse", "--show-toplevel") or None,
        }
    except (OSError, subprocess.SubprocessError):
        return dict.fromkeys(GIT_KEYS)
    return state


def project_git_state(trl_ext_git: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """:func:`git_state` of the working directory's checkout when it is not trl_ext's own (``trl_ext_git``, default
    :func:`git_state` now): the project a run is started from, e.g. the course repository with trl_ext installed into
    it; None when the working directory is in no checkout or in trl_ext's."""
    trl_ext_git = git_state() if trl_ext_git is None else trl_ext_git
    here = git_state(Path.cwd())
    return None if here["root"] is None or here["root"] == trl_ext_git.get("root") else here


def trl_ext_version() -> str:
    """trl_ext's installed version (its package metadata), or ``"unknown"`` when it is not installed (a bare
    source tree on ``sys.path``)."""
    try:
        return metadata.version("trl-ext")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe_code(git: Mapping[str, Any], project: Mapping[str, Any] | None = None) -> list[str]:
    """What code a record was made with, one line each: trl_ext's version and, from ``git`` (:func:`git_state` of
    trl_ext), its commit, ``git describe`` and dirty flag, or "not a git checkout" and where the package is; then,
    when given, the working directory's checkout (``project``: :func:`project_git_state`)."""
    version = trl_ext_version()
    if git.get("commit"):
        lines = [
            f"trl_ext {version}, git commit `{git['commit']}` (`git describe`: {git.get('describe')}; dirty: "
            f"{str(git.get('dirty')).lower()})"
        ]
    else:
        lines = [f"trl_ext {version} (not a git checkout: {Path(__file__).resolve().parent})"]
    if project and project.get("commit"):
        lines.append(
            f"working directory: {project['root']} at git commit `{project['commit']}` (dirty: "
            f"{str(project['dirty']).lower()}; not trl_ext's repository)"
        )
    return lines


def library_versions(git: Mapping[str, Any] | None = None, project: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Installed versions of :data:`VERSIONED_PACKAGES` plus Python; ``trl_ext_git``: trl_ext's ``commit``,
    ``describe`` and ``dirty`` from ``git`` (default: :func:`git_state` now), or ``"not a git checkout"`` when trl_ext
    is an installed package; and ``project_git``, the working directory's checkout when it is another repository
    (``project``, :func:`project_git_state`), when given."""
    versions: dict[str, Any] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            pass
    versions.setdefault("trl_ext", trl_ext_version())
    git = git_state() if git is None else git
    versions["trl_ext_git"] = (
        {k: git.get(k) for k in ("commit", "describe", "dirty")} if git.get("commit") else "not a git checkout"
    )
    if project and project.get("commit"):
        versions["project_git"] = dict(project)
    return versions


# ------------------------------------------------------------------------------------------- the run
class RecipeRun:
    """Bookkeeping of one recipe run; constructing it checks the output folder and resolves the checkpoint.

    Args:
        name: the recipe's name (``"grpo_math"``), recorded in ``metrics.json``.
        output_dir: the run's ``--output_dir``.
        configs: the resolved argument objects by name (``{"script_args": ..., "training_args": ...}``), recorded
            in ``metrics.json`` (TrainingArguments through ``to_dict``, which masks ``*_token`` values).
        overwrite: ``--overwrite_output_dir``.
        resume: ``--resume_from_checkpoint`` as parsed (None, "true" or a path); see :func:`resolve_resume`.
        result_file: the file whose presence marks a finished run of this recipe (or several: any of them).
        handle_signals: install the Ctrl-C / SIGTERM handler of this run (:meth:`interrupted`); the command line
            (``trl_ext.cli.main``) asks for it, a library caller keeps its own handlers.

    Attributes:
        resume_from_checkpoint: the checkpoint folder to pass to ``trainer.train``, or None.
        resumed_step: that checkpoint's optimizer step (0 when not resuming): this process trains the steps after it.
        timer: the run's :class:`~trl_ext.measurement.profiling.PhaseTimer`: :meth:`phase` and :meth:`profile` write to
        it. profilers: the :class:`~trl_ext.measurement.profiling.StepProfiler` of each trainer :meth:`profile` was
        given. roofline: the run's :class:`~trl_ext.measurement.roofline.RooflineRecorder`: the work of every forward of
        the models
            :meth:`watch` was given, counted by phase; ``trl_ext.report.finish`` reports it against the machine's
            peaks, measured then.
        phase_seconds: wall seconds per phase (:meth:`phase`), recorded in ``metrics.json``.
        reused: names of the results :meth:`reuse_or_compute` read back instead of computing.
        warnings: what :meth:`warn` said, recorded in ``metrics.json``.
        git: :func:`git_state` of trl_ext when the run started: the code it runs (``metrics.json``'s ``versions``,
            ``experiment.md``), whatever is committed while it goes on.
        project_git: :func:`project_git_state`: the working directory's checkout when it is not trl_ext's (the
            project trl_ext is installed into), else None.

    Raises:
        RecipeError: from :func:`check_output_dir`, :func:`resolve_resume` and :func:`check_resume`.
    """

    def __init__(
        self,
        name: str,
        output_dir: str | Path,
        configs: Mapping[str, Any],
        *,
        overwrite: bool = False,
        resume: str | bool | None = None,
        result_file: str | Sequence[str] = "metrics.json",
        handle_signals: bool = False,
    ):
        self.name = name
        self.output_dir = Path(output_dir)
        self.configs = dict(configs)
        self.resume_from_checkpoint = resolve_resume(resume, output_dir)
        check_output_dir(output_dir, overwrite, self.resume_from_checkpoint is not None, result_file)
        training_args = self.configs.get("training_args")
        if self.resume_from_checkpoint is not None and isinstance(training_args, TrainingArguments):
            check_resume(self.resume_from_checkpoint, training_args)
        # read now: save_total_limit may delete that checkpoint once this run saves a newer one
        self.resumed_step = (
            0
            if self.resume_from_checkpoint is None
            else int(
                json.loads((Path(self.resume_from_checkpoint) / "trainer_state.json").read_text()).get("global_step", 0)
            )
        )
        self.timer = PhaseTimer()
        self.roofline = RooflineRecorder(lambda: self.timer.current)
        self.profilers: list[StepProfiler] = []
        self._profiled: set[int] = set()  # ids of the trainers profiled
        self.reused: list[str] = []
        self.warnings: list[str] = []
        self.started = time.time()
        self.git = git_state()
        self.project_git = project_git_state(self.git)  # the course repository, when trl_ext is installed into it
        self._saving = False
        self._exit_after_save: str | None = None
        self._stop_signal: str | None = None  # the first stop signal received (:meth:`interrupted`)
        if handle_signals:
            launched_as()  # the command as typed, read while its launchers live (for the resume line)
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)

    @property
    def resuming(self) -> bool:
        return self.resume_from_checkpoint is not None

    @property
    def phase_seconds(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.timer.stage_seconds.items()}

    @property
    def seconds(self) -> float:
        """Wall seconds since the run started."""
        return time.time() - self.started

    def steps_summary(self, global_step: int, seconds: float | None = None) -> str:
        """``"2 steps in 171 s"`` for the steps this process trained (``global_step`` minus :attr:`resumed_step`) in
        ``seconds`` (default: the ``train`` phase), ``"(resumed from step 1; 3 in all)"`` added on resume."""
        seconds = self.phase_seconds["train"] if seconds is None else seconds
        done = global_step - self.resumed_step
        text = f"{done} step{'s' if done != 1 else ''} in {seconds:.0f} s"
        return text + (f" (resumed from step {self.resumed_step}; {global_step} in all)" if self.resuming else "")

    def phase(self, name: str, breakdown: str | None = None):
        """Time a phase of the run (``load_data``, ``load_model``, ``eval_before``, ``train``, ...; repeated names add
        up) -- inclusive wall seconds, ``phase_seconds`` in ``metrics.json``. ``breakdown`` also charges the block to
        that phase of the exclusive breakdown (``model_load``, ``evaluation``; ``time_breakdown``)."""
        stage = self.timer.stage(name)
        if breakdown is None:
            return stage
        return _both(stage, self.timer.phase(breakdown))

    def profile(self, trainer: Any) -> None:
        """Charge ``trainer.train()``'s generation, reward, forward, backward, optimizer and checkpoint seconds to
        :attr:`timer` (:class:`~trl_ext.measurement.profiling.StepProfiler`; any Trainer: the phases it does not have
        are not timed), and count the work of its model's forwards and backwards (:meth:`watch`). Once per trainer: a
        second call changes nothing."""
        if id(trainer) not in self._profiled:
            self._profiled.add(id(trainer))
            self.profilers.append(StepProfiler(self.timer).attach(trainer))
        self.watch(trainer.model)

    def watch(self, model: Any) -> None:
        """Count the work of every forward of ``model`` by phase, for the roofline report (once per model; call it
        before the first evaluation so that it is counted too; a trainer's PEFT wrapper of a watched model counts as
        that model, whose shape is read again)."""
        self.roofline.watch(model)

    def roofline_report(self, optimizer_steps: int | None = None) -> dict[str, Any] | None:
        """Each phase's seconds against the floor this machine allows for its work, the peaks measured now (about
        2 s; :func:`trl_ext.measurement.roofline.roofline_report`); None when no model was watched. ``optimizer_steps``:
        default the steps the profilers timed (:meth:`profile`), so that the optimizer's floor covers the steps its
        seconds do."""
        if optimizer_steps is None:
            optimizer_steps = sum(p.optimizer_steps for p in self.profilers)
        return self.roofline.report(self.timer.seconds, optimizer_steps)

    def time_breakdown(self) -> dict[str, float]:
        """The exclusive seconds per phase plus ``other`` and ``total`` (the run's wall time so far)."""
        return time_breakdown(self.timer, self.seconds)

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
        if is_main_process() and result is not None:
            path.write_text(json.dumps({"key": key, "result": result}, default=str))
        return result

    def train_and_evaluate(
        self, trainer: Any, evaluate: Callable[[], Any], key: Mapping[str, Any]
    ) -> tuple[Any, Any, Any]:
        """The phases of a recipe that evaluates held-out data before and after training, in order: this run
        attached to ``trainer`` (:meth:`attach`) and its phases profiled (:meth:`profile`), ``eval_before``
        (``evaluate()``, read back on resume when ``key`` is the same: :meth:`reuse_or_compute`), ``train``
        (``trainer.train``, from :attr:`resume_from_checkpoint`) and ``eval_after`` (``evaluate()`` again).

        Returns:
            ``(before, what trainer.train() returned, after)``.
        """
        self.attach(trainer)
        self.profile(trainer)  # every trainer's phases timed: the roofline's rows need their seconds
        with self.phase("eval_before", breakdown="evaluation"):
            before = self.reuse_or_compute("eval_before", key, evaluate)
        with self.phase("train"):
            output = trainer.train(resume_from_checkpoint=self.resume_from_checkpoint)
        with self.phase("eval_after", breakdown="evaluation"):
            after = evaluate()
        return before, output, after

    def warn(self, message: str | None) -> None:
        """Print ``warning: message`` on stderr (main process) and record it under ``warnings`` in ``metrics.json``;
        nothing for None."""
        if message is None:
            return
        self.warnings.append(message)
        if is_main_process():
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def provenance(self) -> dict[str, Any]:
        """``recipe``, ``command``, ``config`` (every resolved argument object), ``versions``, ``phase_seconds``,
        ``resumed_from`` (the checkpoint), ``resumed_from_step`` (its step; 0 when not resuming), ``reused`` and
        ``warnings``: the keys ``trl_ext.report`` adds to ``metrics.json``."""
        return {
            "recipe": self.name,
            "command": shlex.join(sys.argv),
            "config": {k: _json_config(v) for k, v in self.configs.items()},
            "versions": library_versions(self.git, self.project_git),
            "phase_seconds": {**self.phase_seconds, "total": round(self.seconds, 3)},
            "resumed_from": self.resume_from_checkpoint,
            "resumed_from_step": self.resumed_step,
            "reused": self.reused,
            "warnings": self.warnings,
        }

    def write_metrics(self, metrics: Mapping[str, Any], path: str | Path | None = None) -> Path:
        """Write ``metrics`` plus :meth:`provenance` to ``path`` (default ``output_dir/metrics.json``; written last:
        its presence marks a finished run), through a temporary file so a kill never leaves half of it."""
        path = Path(path) if path is not None else self.output_dir / "metrics.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**metrics, **self.provenance()}, indent=2, default=str))
        tmp.replace(path)
        return path

    def attach(
        self,
        trainer: Any,
        first_logs: Mapping[str, float] | None = None,
        *,
        evaluate: Callable[[Any], Mapping[str, Any]] | None = None,
        eval_every: int | None = None,
        rollouts: int = 0,
    ) -> None:
        """Add this run's TrainerCallback to ``trainer``: it logs the last step whatever ``logging_steps`` is,
        makes a Ctrl-C that arrives while a checkpoint is written wait until that checkpoint is complete, and logs
        ``first_logs`` (e.g. the held-out accuracy before training) at step 0 once the loggers are set up (not
        again on resume).

        ``evaluate`` (``evaluate(model) -> {"accuracy", "format_rate", ...}``, e.g. ``Task.evaluate``) with
        ``eval_every``: held-out evaluation after every ``eval_every``-th optimizer step but the last (which the
        recipe evaluates after training), logged as ``eval_accuracy`` and ``eval_format_rate`` at that step
        (``trl_ext.callbacks.HeldOutEvaluation``: TensorBoard's ``eval/accuracy``, ``log_history``) and timed as
        ``evaluation``; not under FSDP or DeepSpeed (said once). ``rollouts`` > 0: that many of each step's rollouts
        written to ``output_dir/rollouts.jsonl`` (``trl_ext.callbacks.RolloutLog``)."""
        trainer.add_callback(_RecipeCallback(self, trainer, first_logs))
        if evaluate is not None and eval_every:
            if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
                self.warn(
                    f"--eval_every {eval_every}: not run under FSDP or DeepSpeed (the main process alone cannot "
                    "generate from sharded weights); held-out accuracy before and after training only"
                )
            else:
                from trl_ext.callbacks import HeldOutEvaluation

                def timed(model: Any) -> Mapping[str, Any]:
                    with self.timer.phase("evaluation"):
                        return evaluate(model)

                HeldOutEvaluation(timed, eval_every=eval_every, skip_last=True, prefix="eval_").attach(trainer)
        if rollouts:
            from trl_ext.callbacks import RolloutLog

            RolloutLog(self.output_dir / "rollouts.jsonl", rollouts).attach(trainer)

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
        """Signal handler body: one line naming the last checkpoint and the resume command, then exit at once (or
        right after the checkpoint being written) with 128 + the signal's number (:func:`exit_status`: 130 for
        Ctrl-C, 143 for SIGTERM).

        The first stop signal decides the line and the status: a later one changes nothing (under a launcher, a
        SIGTERM sent to the process group also stops the launcher, whose death signals this process again)."""
        if self._stop_signal is not None:
            return
        self._stop_signal = signal.Signals(signum).name
        if self._saving:
            self._exit_after_save = self._stop_signal
            return
        _stop(self.output_dir, self._stop_signal)

    def _on_signal(self, signum, frame):  # noqa: ARG002
        self.interrupted(signum)


@contextmanager
def _both(first, second):
    with first, second:
        yield


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
    if is_main_process():
        last = latest_checkpoint(output_dir)
        reason = "Stopped (Ctrl-C)" if signame == "SIGINT" else f"Stopped ({signame})"
        if last:
            line = f"{reason}. Last checkpoint: {last}. Resume with: {resume_command()}"
        else:
            line = f"{reason} before the first checkpoint in {output_dir}; nothing to resume, run again to start over."
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exit_status(signame))


def exit_status(signame: str) -> int:
    """The shell's exit status of a process stopped by signal ``signame``: 128 + its number (SIGINT, Ctrl-C: 130;
    SIGTERM, what ``kill``, schedulers and containers send: 143), so a caller can tell the two apart."""
    return 128 + int(signal.Signals[signame])


_stopping_before_the_run: list[str] = []  # the first stop signal before the run: a later one changes nothing


def _stopped_before_the_run(signum, frame):  # noqa: ARG001
    if _stopping_before_the_run:
        return
    name = signal.Signals(signum).name
    _stopping_before_the_run.append(name)
    reason = "Ctrl-C" if name == "SIGINT" else name
    print(f"Stopped ({reason}) before the run started.", file=sys.stderr, flush=True)
    os._exit(exit_status(name))


def install_interrupt_handler() -> None:
    """Until a run installs its own (``RecipeRun(handle_signals=True)``), Ctrl-C / SIGTERM stop the process at once
    with one line (no traceback); and when only the launcher that started this process dies, the process stops too
    (Linux: the kernel sends SIGTERM to the child, so ``accelerate launch``'s child never runs on alone, and stops
    as it does for a SIGTERM sent to the launcher's process group, which also stops the launcher; under a SIGKILL of
    the launcher it still finishes a checkpoint being written)."""
    signal.signal(signal.SIGINT, _stopped_before_the_run)
    signal.signal(signal.SIGTERM, _stopped_before_the_run)
    launched_as()  # the command as typed, read while its launchers live (for the resume line)
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ  # accelerate, torchrun
    if sys.platform.startswith("linux") and launched:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def refuse_resume(value: Any, reason: str, what: str = "run") -> None:
    """Raise :class:`RecipeError` when ``--resume_from_checkpoint`` is given to a recipe that cannot be resumed.

    Args:
        value: the parsed ``--resume_from_checkpoint``.
        reason: why (``"a comparison trains every arm from scratch"``).
        what: what ``--overwrite_output_dir`` would replace (``"comparison"``).
    """
    if value not in (None, "", "false", "False", False):
        raise RecipeError(
            f"--resume_from_checkpoint: {reason} and cannot be resumed; run it again (add {OVERWRITE_FLAG} to replace "
            f"an earlier {what} in the same --output_dir)"
        )
