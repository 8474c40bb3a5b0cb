"""One recipe run: its output folder, resume, Ctrl-C, phase times and provenance.

A recipe's ``main`` gets a :class:`RecipeRun` from ``@trl_ext.cli.recipe``; it checks the folder
(:func:`check_output_dir`), resolves and checks the checkpoint (:func:`resolve_resume`, :func:`check_resume`), times
phases (:meth:`RecipeRun.phase`, :meth:`RecipeRun.profile`), reuses a resumed run's before-evaluation
(:meth:`RecipeRun.reuse_or_compute`), stops on Ctrl-C/SIGTERM with the resume command (:func:`command_line`), and
records :meth:`RecipeRun.provenance` in ``metrics.json`` (written by ``trl_ext.report.finish``).
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

    A finished run (the first of ``result_file`` that exists) or ``checkpoint-*`` folders are refused unless
    ``resuming`` or ``overwrite`` (then :data:`RUN_ARTIFACTS` and the result files are deleted on the main process). The
    folder is created and probed for writing.

    Raises:
        RecipeError: naming the folder and the ways forward, or why it cannot be written."""
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
    """The highest-numbered ``checkpoint-N`` in ``output_dir`` with ``trainer_state.json`` (written last), or None."""
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
    """The checkpoint to resume from: None for None/"false", :func:`latest_checkpoint` for "true", else that path.

    Raises:
        RecipeError: "true" with no complete checkpoint, or a path that is not a Trainer checkpoint."""
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
    (``trl_ext.trainers.resume.check_resume_options``).

    Raises:
        RecipeError: naming each changed option, its value in the checkpoint and now, and how to start over."""
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
    """Whether ``word`` names a python interpreter."""
    return re.fullmatch(r"python[0-9.]*", Path(word).name) is not None


def _as_typed(words: Sequence[str]) -> list[str] | None:
    """A launcher's command line (``uv run``, ``accelerate launch``, ``torchrun``, ``python -m`` a launch module) as
    typed, or None; a shebang script's interpreter is dropped and the script written by name when ``PATH`` finds it."""
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
    """Whether ``word`` (after ``before``) names ``script``: the same path or file name, or after ``-m`` its module."""
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
    """The command, as typed, whose launchers started this process (e.g. ``["uv", "run", "accelerate", "launch", ...,
    "recipes/grpo_math.py", "--max_steps", "5"]``); None with no launcher or no ``/proc``.

    Walks up the parents while each is a launcher whose command ends with ``argv`` (default ``sys.argv``); the
    topmost wins. ``pid``: the process to start from (default this one); ``read_process``: ``pid -> (ppid, words)``
    (tests)."""
    return _launch_chain(argv, pid=pid, read_process=read_process)[0]


def _launch_chain(
    argv: Sequence[str] | None = None,
    *,
    pid: int | None = None,
    read_process: Callable[[int], tuple[int, list[str]] | None] | None = None,
) -> tuple[list[str] | None, int]:
    """:func:`typed_command` and the pid of the process it was typed to (the topmost launcher; ``pid`` itself when
    there is none)."""
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
    return found, current


def process_start_time(pid: int) -> float | None:
    """Epoch seconds (``time.time()``'s clock) at which process ``pid`` started, to the kernel's clock tick (10 ms):
    ``/proc/<pid>/stat``'s start time after boot against ``/proc/uptime``; None where ``/proc`` cannot tell."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, after "(comm)"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def launched_as() -> list[str] | None:
    """:func:`typed_command` of this process, cached: read at start, while the launchers still live."""
    return typed_command()


@functools.cache
def launch_time() -> float | None:
    """Epoch seconds at which the command that runs this process was started (under ``uv run accelerate launch``,
    when ``uv`` started; else this process), cached: read at start, while the launchers still live. Where a run's
    ``startup`` row begins (:meth:`RecipeRun.time_breakdown`); None without ``/proc``."""
    return process_start_time(_launch_chain()[1])


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that runs this process's script with ``argv``'s flags (default ``sys.argv``).

    Under a launcher, the command as typed (:func:`typed_command`). Else ``uv run python`` for one process without
    mixed precision, or ``uv run accelerate launch`` with ``--num_processes``, ``--num_machines``,
    ``--mixed_precision``, ``--dynamo_backend`` (and ``--multi_gpu``), then the script relative to the working
    directory and the flags. A launch config's FSDP/DeepSpeed settings are not included."""
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
    """A :meth:`RecipeRun.reuse_or_compute` key for a before-evaluation: ``model``, the held-out file's digest and
    ``depends_on`` (dataclasses without ``overwrite_output_dir``)."""
    key: dict[str, Any] = {"model": model, "test_file": file_digest(test_file)}
    for name, value in depends_on.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: v for k, v in dataclasses.asdict(value).items() if k != "overwrite_output_dir"}
        key[name] = value
    return key


def _json_config(obj: Any) -> Any:
    """A config object as JSON-able data."""
    if hasattr(obj, "to_dict"):  # TrainingArguments: enums to values, *_token fields masked
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return obj


GIT_KEYS = ("commit", "describe", "dirty", "root")
"""What :func:`git_state` reads of a git checkout."""


def git_state(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """``{"commit", "describe", "dirty", "root"}`` of the checkout holding ``path``; all None without git or repository.

    Default ``path``: trl_ext's source tree, counted only when the package's files are tracked there (an install
    inside another repository's ``.venv`` is not trl_ext's commit; see :func:`project_git_state`)."""
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
    """:func:`git_state` of the working directory when it is not trl_ext's checkout (``trl_ext_git``), else None."""
    trl_ext_git = git_state() if trl_ext_git is None else trl_ext_git
    here = git_state(Path.cwd())
    return None if here["root"] is None or here["root"] == trl_ext_git.get("root") else here


def trl_ext_version() -> str:
    """trl_ext's installed version, or ``"unknown"`` for a bare source tree."""
    try:
        return metadata.version("trl-ext")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe_code(git: Mapping[str, Any], project: Mapping[str, Any] | None = None) -> list[str]:
    """Lines naming the code a record was made with: trl_ext's version, ``git`` state and ``project``'s checkout."""
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
    """Versions of :data:`VERSIONED_PACKAGES` and Python, ``trl_ext_git`` (from ``git``, default :func:`git_state`)
    and ``project_git`` when ``project`` is given."""
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
        name: the recipe's name, recorded in ``metrics.json``.
        output_dir: the run's ``--output_dir``.
        configs: the resolved argument objects by name, recorded in ``metrics.json``.
        overwrite: ``--overwrite_output_dir``.
        resume: ``--resume_from_checkpoint`` as parsed (:func:`resolve_resume`).
        result_file: the file(s) whose presence marks a finished run.
        handle_signals: install this run's Ctrl-C / SIGTERM handler (:meth:`interrupted`); the run of the command
            line (``trl_ext.cli.main``): its :meth:`time_breakdown` then starts when the command did
            (:func:`launch_time`), with a ``startup`` row up to the first phase.

    Attributes:
        resume_from_checkpoint: the checkpoint folder for ``trainer.train``, or None.
        resumed_step: that checkpoint's optimizer step (0 when not resuming).
        timer, profilers, roofline: the run's PhaseTimer, StepProfilers and RooflineRecorder.
        reused, warnings: names read back by :meth:`reuse_or_compute`; messages of :meth:`warn`.
        git, project_git: :func:`git_state` and :func:`project_git_state` at start.

    Raises:
        RecipeError: from :func:`check_output_dir`, :func:`resolve_resume` and :func:`check_resume`."""

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
        self.launched: float | None = None  # when the command started: the breakdown's startup row begins there
        if handle_signals:
            launched_as()  # the command as typed, read while its launchers live (for the resume line)
            launched = launch_time()
            self.launched = launched if launched is not None and launched <= self.started else None
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
        """``"2 steps in 171 s"`` for the steps this process trained in ``seconds`` (default: the ``train`` phase),
        plus ``"(resumed from step 1; 3 in all)"`` on resume."""
        seconds = self.phase_seconds["train"] if seconds is None else seconds
        done = global_step - self.resumed_step
        text = f"{done} step{'s' if done != 1 else ''} in {seconds:.0f} s"
        return text + (f" (resumed from step {self.resumed_step}; {global_step} in all)" if self.resuming else "")

    def phase(self, name: str, breakdown: str | None = None):
        """Time phase ``name`` (repeats add up); ``breakdown`` also charges it to that exclusive phase. The first
        phase ends the breakdown's ``startup`` row (when the run knows :attr:`launched`)."""
        if self.launched is not None and "startup" not in self.timer.seconds:
            self.timer.add("startup", time.time() - self.launched)
        stage = self.timer.stage(name)
        if breakdown is None:
            return stage
        return _both(stage, self.timer.phase(breakdown))

    def profile(self, trainer: Any) -> None:
        """Time ``trainer.train()``'s phases into :attr:`timer` and :meth:`watch` its model; once per trainer."""
        if id(trainer) not in self._profiled:
            self._profiled.add(id(trainer))
            self.profilers.append(StepProfiler(self.timer).attach(trainer))
        self.watch(trainer.model)

    def watch(self, model: Any) -> None:
        """Count the work of every forward of ``model`` by phase, for the roofline report (once per model)."""
        self.roofline.watch(model)

    def roofline_report(self, optimizer_steps: int | None = None) -> dict[str, Any] | None:
        """Each phase's seconds against this machine's floor for its work, or None when no model was watched;
        ``optimizer_steps`` defaults to the steps the profilers timed."""
        if optimizer_steps is None:
            optimizer_steps = sum(p.optimizer_steps for p in self.profilers)
        return self.roofline.report(self.timer.seconds, optimizer_steps)

    def time_breakdown(self) -> dict[str, float]:
        """The exclusive seconds per phase plus ``other`` and ``total``: the wall time so far, from when the command
        started where the run knows it (:attr:`launched`; rows ``startup`` and, once ``trl_ext.report.finish`` has
        written the outputs, ``finish``), else from when the run opened."""
        return time_breakdown(self.timer, time.time() - self.launched if self.launched is not None else self.seconds)

    def reuse_or_compute(self, name: str, key: Mapping[str, Any], compute: Callable[[], Any]) -> Any:
        """On resume, the result saved under ``name`` with the same ``key``; else ``compute()``, saved to
        ``output_dir/<name>.json`` (main process). Reused names go to ``metrics.json``'s ``reused``."""
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
        """:meth:`attach`, :meth:`profile`, then ``eval_before`` (:meth:`reuse_or_compute`), ``train`` and
        ``eval_after`` phases.

        Returns:
            ``(before, what trainer.train() returned, after)``."""
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
        """Print ``warning: message`` on stderr (main process) and record it in ``metrics.json``; nothing for None."""
        if message is None:
            return
        self.warnings.append(message)
        if is_main_process():
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def provenance(self) -> dict[str, Any]:
        """The keys ``trl_ext.report`` adds to ``metrics.json``: recipe, command, config, versions, phase_seconds,
        resumed_from, resumed_from_step, reused, warnings."""
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
        """Write ``metrics`` plus :meth:`provenance` atomically to ``path`` (default ``output_dir/metrics.json``)."""
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
        """Add this run's callback to ``trainer``: log the last step, finish a checkpoint being written before a Ctrl-C
        exits, log ``first_logs`` at step 0 (not on resume).

        ``evaluate(model) -> {"accuracy", "format_rate", ...}`` with ``eval_every``: held-out evaluation every
        ``eval_every`` steps but the last, logged as ``eval_*`` (not under FSDP/DeepSpeed: said once). ``rollouts`` >
        0: that many rollouts per step to ``output_dir/rollouts.jsonl``."""
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
        """Log ``logs`` at the last step to every ``report_to`` logger and flush TensorBoard."""
        from transformers import Trainer
        from transformers.integrations import TensorBoardCallback

        Trainer.log(trainer, dict(logs))  # not the GRPO override: no pending training metrics to merge
        for cb in trainer.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None:
                cb.tb_writer.close()
                cb.tb_writer = None

    def interrupted(self, signum: int) -> None:
        """Signal handler body: print the last checkpoint and the resume command, exit with :func:`exit_status`
        (after a checkpoint being written); only the first stop signal counts."""
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
    """128 + the signal's number: 130 for SIGINT (Ctrl-C), 143 for SIGTERM."""
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
    """Until a run installs its own, Ctrl-C / SIGTERM stop the process with one line; on Linux under a launcher, the
    launcher's death sends this process SIGTERM (``PR_SET_PDEATHSIG``)."""
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
    """Raise :class:`RecipeError` when ``--resume_from_checkpoint`` (``value``) is given to a recipe that cannot
    resume; ``reason`` says why, ``what`` names what ``--overwrite_output_dir`` would replace."""
    if value not in (None, "", "false", "False", False):
        raise RecipeError(
            f"--resume_from_checkpoint: {reason} and cannot be resumed; run it again (add {OVERWRITE_FLAG} to replace "
            f"an earlier {what} in the same --output_dir)"
        )
