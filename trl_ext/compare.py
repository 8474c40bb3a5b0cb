"""Run GRPO settings ("arms") one after another on the same model, data, seed, prompts and step budget; compare them.

An arm is a trainer (upstream ``trl.GRPOTrainer`` or ``trl_ext.GRPOTrainer``) plus the config fields it changes
relative to one shared ``trl.GRPOConfig`` (learning rate, batch, generation, steps, seed, ...). Upstream arms must
write out ``loss_type``, ``scale_rewards``, ``beta`` and ``epsilon`` (never TRL's implicit defaults, which change
between releases); ``trl_ext`` arms set the course fields (``normalize_by_std``, ``length_normalization``, ...).

Per arm, :func:`run_comparison` records TRL's logged metrics (``reward``, ``entropy``, ``completions/mean_length``,
per-function rewards), held-out greedy accuracy at chosen steps (logged as ``heldout/accuracy`` next to TRL's
metrics, so tensorboard/wandb/trackio see it too), wall seconds per optimizer step (median), peak memory (process
RSS peak on CPU, ``torch.cuda.max_memory_allocated`` on GPU) and generated tokens per second of generation time.
:func:`write_comparison` writes ``comparison.json``, ``comparison.md`` (a table) and ``comparison.png`` (curves).

Used by ``recipes/compare_upstream.py`` (math) and ``recipes/grpo_sort.py`` (the lecture's sorting toy task).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import trl
from transformers import TrainerCallback, set_seed

from trl_ext.profiling import StepProfiler, time_breakdown
from trl_ext.trainers import GRPOConfig, GRPOTrainer

TRAINERS = {"trl": (trl.GRPOTrainer, trl.GRPOConfig), "trl_ext": (GRPOTrainer, GRPOConfig)}
"""Arm trainer name -> (trainer class, config class)."""

UPSTREAM_REQUIRED = ("loss_type", "scale_rewards", "beta", "epsilon")
"""Fields an upstream (``trainer="trl"``) arm must set explicitly."""

ARM_PRESETS: dict[str, dict[str, Any]] = {
    # Upstream TRL, GRPO as in DeepSeekMath: group-std-normalized advantages, per-response token mean, no KL.
    "trl": {"trainer": "trl", "loss_type": "grpo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2},
    # The course's defaults: GRPO-Clip, std normalization, masked_mean.
    "course": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "normalize_by_std": True,
        "length_normalization": "masked_mean",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    "no_std": {"trainer": "trl_ext", "pg_loss_type": "grpo_clip", "normalize_by_std": False, "beta": 0.0, "epsilon": 0.2},
    "masked_normalize": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "length_normalization": "masked_normalize",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    # Dr. GRPO (Liu et al. 2025): no std division, sum over tokens / max_completion_length.
    "dr_grpo": {
        "trainer": "trl_ext",
        "pg_loss_type": "grpo_clip",
        "normalize_by_std": False,
        "length_normalization": "masked_normalize",
        "beta": 0.0,
        "epsilon": 0.2,
    },
    # Course defaults plus a k3 KL penalty to the initial policy (TRL reloads the reference from the policy's path).
    "kl_k3": {"trainer": "trl_ext", "pg_loss_type": "grpo_clip", "beta": 0.04, "kl_estimator": "k3", "epsilon": 0.2},
}
"""Named arms usable as ``arms: [trl, course, ...]``; a mapping ``{preset: course, name: ..., field: value}`` extends one."""

_DERIVED_FIELDS = ("generation_batch_size", "loss_type", "scale_rewards", "gradient_checkpointing", "gradient_checkpointing_kwargs")


# ------------------------------------------------------------------------------------------------------------ arms
@dataclasses.dataclass
class Arm:
    """One setting of a comparison.

    Attributes:
        name: label in tables and plots, and the arm's output sub-directory; unique within a comparison.
        trainer: ``"trl"`` (upstream ``trl.GRPOTrainer``) or ``"trl_ext"``.
        settings: config fields this arm sets on top of the shared config (e.g. ``{"normalize_by_std": False}``).
    """

    name: str
    trainer: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError(f"arm name {self.name!r}: expected a non-empty string without spaces or slashes")
        if self.trainer not in TRAINERS:
            raise ValueError(f"arm {self.name!r}: trainer={self.trainer!r}; expected one of {sorted(TRAINERS)}")
        config_cls = TRAINERS[self.trainer][1]
        known = {f.name for f in dataclasses.fields(config_cls) if f.init}
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise ValueError(f"arm {self.name!r}: {unknown} are not fields of {config_cls.__module__}.{config_cls.__name__}")
        if self.trainer == "trl":
            missing = [k for k in UPSTREAM_REQUIRED if k not in self.settings]
            if missing:
                raise ValueError(
                    f"upstream arm {self.name!r} must set {list(UPSTREAM_REQUIRED)} explicitly; missing {missing}"
                )
        else:
            derived = [k for k in ("loss_type", "scale_rewards") if k in self.settings]
            if derived:
                raise ValueError(
                    f"arm {self.name!r} (trl_ext) sets {derived}; these are derived from length_normalization and "
                    "normalize_by_std, set those instead"
                )


def parse_arms(
    specs: Sequence[str | Mapping[str, Any]], presets: Mapping[str, Mapping[str, Any]] = ARM_PRESETS
) -> list[Arm]:
    """Build arms from preset names and/or mappings.

    Each spec is a preset name from ``presets`` (default :data:`ARM_PRESETS`, e.g. ``"trl"``), a mapping, or a JSON
    object string (from the command line). A preset is a mapping with ``trainer`` and config fields. A mapping holds ``name``, optionally ``preset`` (a preset to start from) and ``trainer``
    (default: the preset's, else ``"trl_ext"``), and any config fields, which override the preset's.

    Raises:
        ValueError: unknown preset, a mapping without ``name``, a repeated name, or an invalid arm (see :class:`Arm`).
    """
    arms: list[Arm] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as err:
                raise ValueError(f"arm {i}: invalid JSON {spec!r}: {err}") from None
        if isinstance(spec, str):
            if spec not in presets:
                raise ValueError(f"arm {i}: unknown preset {spec!r}; expected one of {sorted(presets)} or a mapping")
            settings = dict(presets[spec])
            arms.append(Arm(spec, settings.pop("trainer"), settings))
            continue
        if not isinstance(spec, Mapping) or "name" not in spec:
            raise ValueError(f"arm {i}: expected a preset name or a mapping with a 'name', got {spec!r}")
        spec = dict(spec)
        name, preset = spec.pop("name"), spec.pop("preset", None)
        if preset is not None and preset not in presets:
            raise ValueError(f"arm {name!r}: unknown preset {preset!r}; expected one of {sorted(presets)}")
        settings = dict(presets[preset]) if preset else {}
        trainer = spec.pop("trainer", settings.pop("trainer", "trl_ext"))
        settings.pop("trainer", None)
        settings.update(spec)
        arms.append(Arm(name, trainer, settings))
    names = [a.name for a in arms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"arm names must be unique; repeated: {repeated}")
    if not arms:
        raise ValueError("expected at least one arm")
    return arms


def arm_config(base: trl.GRPOConfig, arm: Arm) -> trl.GRPOConfig:
    """The config of ``arm``: the shared ``base`` with the arm's settings, output under ``base.output_dir/arm.name``.

    Fields of ``base`` that differ from their defaults are carried over, except those ``__post_init__`` derives
    (``generation_batch_size`` from ``steps_per_generation``; ``gradient_checkpointing*`` from
    ``activation_checkpointing*``) and ``loss_type``/``scale_rewards``, which every arm sets (upstream) or derives
    (trl_ext). ``run_name`` becomes the arm's name.

    Raises:
        ValueError: ``base`` sets ``loss_type`` or ``scale_rewards`` away from TRL's defaults (set them per arm).
    """
    for name in ("loss_type", "scale_rewards"):
        default = next(f.default for f in dataclasses.fields(trl.GRPOConfig) if f.name == name)
        if getattr(base, name) != default:
            raise ValueError(
                f"the shared config sets {name}={getattr(base, name)!r}; set it per arm instead (upstream arms write "
                f"out {list(UPSTREAM_REQUIRED)}, trl_ext arms derive it)"
            )
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        if not f.init or f.name in _DERIVED_FIELDS:
            continue
        value = getattr(base, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != default:
            kwargs[f.name] = value
    kwargs.update(output_dir=str(Path(base.output_dir) / arm.name), run_name=arm.name)
    kwargs.update(arm.settings)
    return TRAINERS[arm.trainer][1](**kwargs)


# --------------------------------------------------------------------------------------------------- measurements
def _rss_peak_resettable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/self/status")


def release_memory() -> None:
    """Collect garbage, empty the CUDA cache and (glibc) return freed heap pages to the OS, so a fresh peak starts
    from what is really in use."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory between :meth:`start` and :meth:`stop`.

    On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (``kind="cuda_max_allocated"``).
    On CPU under Linux: the process's peak resident set size ``VmHWM``, reset by writing 5 to
    ``/proc/self/clear_refs`` (``kind="rss_peak"``); elsewhere the RSS sampled every 10 ms by a thread through
    ``psutil`` (``kind="rss_sampled"``). RSS covers the whole process (Python, libraries, datasets), not only tensors.
    """

    def __init__(self, device: str | None = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.kind = ""
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def start(self) -> PeakMemory:
        release_memory()
        if self.device == "cuda":
            self.kind = "cuda_max_allocated"
            torch.cuda.reset_peak_memory_stats()
        elif _rss_peak_resettable():
            self.kind = "rss_peak"
        else:
            import psutil

            self.kind = "rss_sampled"
            process = psutil.Process()

            def sample():
                while not self._stop.is_set():
                    self._sampled = max(self._sampled, process.memory_info().rss)
                    self._stop.wait(0.01)

            self._stop.clear()
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> int:
        """Stop measuring; return (and keep in ``peak_bytes``) the peak in bytes."""
        if self.kind == "cuda_max_allocated":
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        elif self.kind == "rss_peak":
            self.peak_bytes = _rss_hwm_bytes()
        elif self.kind == "rss_sampled":
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._sampled
        else:
            raise RuntimeError("PeakMemory.stop() called before start()")
        return self.peak_bytes


class ArmMonitor(TrainerCallback):
    """Measures one arm while it trains: step wall time, generation time and tokens, held-out accuracy.

    Attach with :meth:`attach` after building the trainer. Step time runs from ``on_step_begin`` to ``on_step_end``
    (generation, reward, loss, backward and optimizer step; not the held-out evaluation, which runs after it in
    ``on_step_end``). Generation time and generated tokens come from wrapping the trainer's ``_generate`` (TRL
    1.16: returns ``(prompt_ids, completion_ids, ...)`` with ``completion_ids`` a list of token-id lists, this
    process's completions). Held-out results are appended to ``trainer._metrics["train"]`` as ``heldout/accuracy``
    and ``heldout/format_rate``, which TRL logs at this step.

    Args:
        eval_fn: ``eval_fn(model) -> dict`` with at least ``accuracy`` (e.g. :func:`trl_ext.eval.evaluate_math`
            partially applied); None for no held-out evaluation.
        eval_steps: optimizer steps after which to evaluate (step 0 is not handled here: evaluate the initial model
            before training).
    """

    def __init__(self, eval_fn: Callable[[Any], Mapping[str, Any]] | None = None, eval_steps: Sequence[int] = ()):
        self.eval_fn = eval_fn
        self.eval_steps = set(eval_steps)
        self.step_seconds: list[float] = []
        self.generation_seconds = 0.0
        self.generated_tokens = 0
        self.evals: list[dict[str, Any]] = []
        self.trainer: Any = None
        self._step_start: float | None = None

    def attach(self, trainer: Any) -> ArmMonitor:
        self.trainer = trainer
        trainer.add_callback(self)
        generate = trainer._generate

        def timed_generate(prompts):
            start = time.perf_counter()
            out = generate(prompts)
            self.generation_seconds += time.perf_counter() - start
            self.generated_tokens += sum(len(ids) for ids in out[1])
            return out

        trainer._generate = timed_generate
        return self

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self.step_seconds.append(time.perf_counter() - self._step_start)
        if self.eval_fn is None or state.global_step not in self.eval_steps:
            return
        trainer = self.trainer
        if trainer.accelerator.is_main_process:
            result = self.eval_fn(trainer.accelerator.unwrap_model(trainer.model))
            self.evals.append(_eval_record(state.global_step, result))
            trainer._metrics["train"]["heldout/accuracy"].append(float(result["accuracy"]))
            if "format_rate" in result:
                trainer._metrics["train"]["heldout/format_rate"].append(float(result["format_rate"]))
        trainer.accelerator.wait_for_everyone()


_EVAL_KEYS = ("accuracy", "format_rate", "reward", "seconds", "examples_per_second")


def _eval_record(step: int, result: Mapping[str, Any], num_examples: int = 3) -> dict[str, Any]:
    """The numbers of an evaluation result plus its first responses (``records`` of trl_ext.eval.evaluate_math)."""
    record = {"step": step, **{k: result[k] for k in _EVAL_KEYS if k in result}}
    if result.get("records"):
        record["examples"] = [{"response": r["response"], "answer": r["answer"]} for r in result["records"][:num_examples]]
    return record


# ------------------------------------------------------------------------------------------------------ summaries
def metric_curve(log_history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of every ``log_history`` entry that has ``key`` with a finite number."""
    return [
        (int(e["step"]), float(e[key]))
        for e in log_history
        if isinstance(e.get(key), (int, float)) and math.isfinite(e[key]) and "step" in e
    ]


def summarize_arm(
    arm: Arm,
    log_history: Sequence[Mapping[str, Any]],
    step_seconds: Sequence[float],
    evals: Sequence[Mapping[str, Any]],
    *,
    generated_tokens: int = 0,
    generation_seconds: float = 0.0,
    peak_memory_bytes: int | None = None,
    memory_kind: str = "",
    train_seconds: float | None = None,
    curve_keys: Sequence[str] = ("reward", "entropy", "completions/mean_length"),
    last_k: int = 5,
) -> dict[str, Any]:
    """Per-arm numbers for the comparison.

    Returns:
        dict with ``name``, ``trainer``, ``settings``; ``final_accuracy`` (held-out accuracy at the last evaluated
        step), ``best_accuracy`` and ``best_step`` (highest over all evaluated steps, step 0 included; the first
        one on ties); ``accuracy_curve`` ``[[step, accuracy], ...]``; ``median_step_seconds``; ``final_reward``
        (mean train ``reward`` over the last ``last_k`` logged steps); ``gen_tokens_per_second``
        (``generated_tokens / generation_seconds``); ``peak_memory_bytes``, ``memory_kind``, ``train_seconds``,
        ``steps``; and ``curves``: ``{key: [[step, value], ...]}`` for each of ``curve_keys`` that was logged.
        Missing quantities are None.
    """
    evals = sorted(evals, key=lambda e: e["step"])
    best = max(evals, key=lambda e: e["accuracy"]) if evals else None  # max keeps the first of equal values
    rewards = [v for _, v in metric_curve(log_history, "reward")]
    curves = {key: [list(p) for p in metric_curve(log_history, key)] for key in curve_keys}
    return {
        "name": arm.name,
        "trainer": arm.trainer,
        "settings": dict(arm.settings),
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "best_accuracy": best["accuracy"] if best else None,
        "best_step": best["step"] if best else None,
        "accuracy_curve": [[e["step"], e["accuracy"]] for e in evals],
        "evals": [dict(e) for e in evals],
        "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
        "final_reward": statistics.fmean(rewards[-last_k:]) if rewards else None,
        "gen_tokens_per_second": generated_tokens / generation_seconds if generation_seconds > 0 else None,
        "generated_tokens": generated_tokens,
        "peak_memory_bytes": peak_memory_bytes,
        "memory_kind": memory_kind,
        "train_seconds": train_seconds,
        "steps": len(step_seconds),
        "curves": {k: v for k, v in curves.items() if v},
    }


# ------------------------------------------------------------------------------------------------------- running
def _timed(eval_fn, timer):
    """``eval_fn`` timed as the ``evaluation`` phase of ``timer`` (None stays None)."""
    if eval_fn is None:
        return None

    def timed(model):
        with timer.phase("evaluation"):
            return eval_fn(model)

    return timed


def run_comparison(
    arms: Sequence[Arm],
    base_args: trl.GRPOConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    train_dataset: Any,
    reward_funcs: Any,
    eval_fn: Callable[[Any], Mapping[str, Any]] | None = None,
    eval_steps: Sequence[int] = (),
    curve_keys: Sequence[str] = ("reward", "entropy", "completions/mean_length"),
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train each arm from the same initial model, one after another, and summarize it (:func:`summarize_arm`).

    Every arm gets ``set_seed(base_args.seed)`` before its model is loaded, the same ``train_dataset`` (so the same
    prompts in the same order), the same ``reward_funcs`` and ``base_args``'s step budget (:func:`arm_config`).
    When ``eval_fn`` is given and 0 is in ``eval_steps``, the initial model is evaluated once and that result is
    every arm's step-0 point.

    Args:
        arms: from :func:`parse_arms`.
        base_args: the shared config (a ``trl.GRPOConfig``).
        load_model: returns a fresh ``(model, tokenizer, peft_config)``, e.g. ``lambda:
            trl_ext.models.load_model_and_tokenizer(model_args)``. With ``beta > 0`` TRL builds the reference model
            from ``model.config._name_or_path``, which is the checkpoint directory for models loaded that way.
        train_dataset: the training prompts.
        reward_funcs: TRL reward function(s); an arm changes their weights through ``reward_weights``.
        eval_fn: ``eval_fn(model) -> dict`` with ``accuracy`` (and optionally ``format_rate``, ``reward``).
        eval_steps: optimizer steps at which to evaluate (0 = before training).
        curve_keys: logged metrics kept as curves.
        log: progress printer (main process only).

    Returns:
        One summary dict per arm (on every process; held-out numbers only exist on the main process).
    """
    from accelerate import PartialState

    is_main = PartialState().is_main_process
    log = log if is_main else (lambda message: None)
    initial_eval = None
    if eval_fn is not None and 0 in eval_steps:
        set_seed(base_args.seed)
        model, _, _ = load_model()
        if is_main:
            if torch.cuda.is_available():
                model = model.to("cuda")
            initial_eval = _eval_record(0, eval_fn(model))
            log(f"initial model: held-out accuracy {initial_eval['accuracy']:.1%}")
        del model
        release_memory()
    results = []
    for i, arm in enumerate(arms):
        config = arm_config(base_args, arm)
        log(f"[{i + 1}/{len(arms)}] arm {arm.name!r} ({arm.trainer}): {arm.settings}")
        set_seed(config.seed)
        model, tokenizer, peft_config = load_model()
        trainer_cls = TRAINERS[arm.trainer][0]
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_funcs,
            args=config,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        profiler = StepProfiler()  # held-out evaluations count as "evaluation", not as training time
        monitor = ArmMonitor(_timed(eval_fn, profiler.timer), [s for s in eval_steps if s > 0]).attach(trainer)
        profiler.attach(trainer)
        meter = PeakMemory().start()
        start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - start
        peak = meter.stop()
        evals = ([initial_eval] if initial_eval else []) + monitor.evals
        summary = summarize_arm(
            arm,
            trainer.state.log_history,
            monitor.step_seconds,
            evals,
            generated_tokens=monitor.generated_tokens,
            generation_seconds=monitor.generation_seconds,
            peak_memory_bytes=peak,
            memory_kind=meter.kind,
            train_seconds=train_seconds,
            curve_keys=curve_keys,
        )
        summary["time_breakdown"] = time_breakdown(profiler.timer)  # seconds per phase of this arm's train()
        results.append(summary)
        acc = summary["final_accuracy"]
        median = summary["median_step_seconds"]
        log(
            f"arm {arm.name!r}: {summary['steps']} steps in {train_seconds:.0f} s"
            + (f", median {median:.1f} s/step" if median is not None else "")
            + (f", held-out accuracy {acc:.1%}" if acc is not None else "")
        )
        del trainer, model, monitor, profiler
        release_memory()
    return results


# -------------------------------------------------------------------------------------------------------- reports
def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _fmt_num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _settings_text(arm: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in arm["settings"].items())


def comparison_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table with one row per arm: accuracy (final, best@step), final train reward, median s/step, peak
    memory (GiB), generated tokens/s and the arm's settings."""
    lines = [
        "| arm | trainer | held-out acc. (final) | best (step) | train reward (last 5) | s/step (median) | peak mem (GiB) "
        + "| gen. tok/s | settings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] is not None else None
        best = f"{_fmt_pct(r['best_accuracy'])} ({r['best_step']})" if r["best_accuracy"] is not None else "n/a"
        lines.append(
            f"| {r['name']} | {r['trainer']} | {_fmt_pct(r['final_accuracy'])} | {best} | "
            f"{_fmt_num(r['final_reward'], '.3f')} | {_fmt_num(r['median_step_seconds'], '.2f')} | "
            f"{_fmt_num(mem, '.2f')} | {_fmt_num(r['gen_tokens_per_second'], '.1f')} | {_settings_text(r)} |"
        )
    return "\n".join(lines)


DEFAULT_PANELS = (
    ("reward", "train reward (batch mean)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
)
"""(logged metric, panel title) plotted next to the held-out accuracy panel by default."""


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_comparison(
    results: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "",
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    accuracy_title: str = "held-out accuracy (greedy)",
    smooth: int = 5,
) -> Path:
    """Plot held-out accuracy and the logged ``panels`` per arm (one color per arm; upstream arms dashed).

    Logged curves are drawn raw (faint) and as a running mean over ``smooth`` steps (bold). Saves a PNG and returns
    its path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 1 + len(panels)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.6 * rows), squeeze=False)
    axes = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        # Later arms are drawn thinner and on top, so arms whose curves coincide stay visible as nested lines and
        # markers; upstream arms are dashed and drawn over everything, so an arm with the same math shows through
        # the gaps of the upstream curve.
        upstream = r["trainer"] == "trl"
        style = "--" if upstream else "-"
        z, width, marker = (100 if upstream else 2) + i, max(1.2, 3.2 - 0.6 * i), max(3.0, 9.0 - 2.0 * i)
        label = f"{r['name']} ({r['trainer']})"
        acc = r["accuracy_curve"]
        if acc:
            axes[0].plot([s for s, _ in acc], [a for _, a in acc], style, marker="o", color=color, label=label, zorder=z,
                         linewidth=width, markersize=marker)
        for ax, (key, _) in zip(axes[1:], panels):
            curve = r["curves"].get(key, [])
            if not curve:
                continue
            steps, values = [s for s, _ in curve], [v for _, v in curve]
            ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=1, zorder=z)
            ax.plot(steps, _running_mean(values, smooth), style, color=color, linewidth=width, label=label, zorder=z)
    axes[0].set_title(accuracy_title)
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for ax, (_, panel_title) in zip(axes[1:], panels):
        ax.set_title(panel_title + (f" ({smooth}-step mean)" if smooth > 1 else ""))
    for ax in axes[:n]:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[n:]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels() if n > 1 else ([], [])
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4) or 1, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_comparison(
    results: Sequence[Mapping[str, Any]],
    output_dir: str | os.PathLike,
    setup: Mapping[str, Any],
    *,
    title: str = "",
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    command: str | None = None,
) -> dict[str, Path]:
    """Write ``comparison.json`` (setup + every arm's summary), ``comparison.md`` (setup, command, table) and
    ``comparison.png`` (:func:`plot_comparison`) into ``output_dir``; return their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "comparison.json", "md": out / "comparison.md", "png": out / "comparison.png"}
    paths["json"].write_text(json.dumps({"setup": dict(setup), "arms": list(results)}, indent=2, default=str))
    md = [f"# {title or 'Comparison'}", ""]
    md += [f"- {k}: {v}" for k, v in setup.items()]
    if command:
        md += ["", "Reproduce with:", "", f"    {command}"]
    md += ["", comparison_table(results), "", "![comparison](comparison.png)", ""]
    paths["md"].write_text("\n".join(md))
    plot_comparison(results, paths["png"], title=title, panels=panels)
    return paths
