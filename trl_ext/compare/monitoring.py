"""Monitoring one arm while it trains: peak memory, step and generation time, held-out accuracy; summaries."""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from trl_ext.compare.arms import Arm
from trl_ext.measurement.observations import metric_curve


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
    process's completions). Held-out results are appended to ``trainer._metrics["train"]`` as ``<prefix>accuracy``
    and ``<prefix>format_rate`` (default ``heldout/accuracy``, ``heldout/format_rate``), which TRL logs at this step
    next to its own metrics (every ``report_to`` logger and ``log_history``): an evaluated step is always logged,
    whatever ``logging_steps`` is, so its value is never averaged with a later one.

    Args:
        eval_fn: ``eval_fn(model) -> dict`` with at least ``accuracy`` (e.g. :func:`trl_ext.eval.evaluate_math`
            partially applied); None for no held-out evaluation.
        eval_steps: optimizer steps after which to evaluate (step 0 is not handled here: evaluate the initial model
            before training).
        eval_every: also evaluate after every step that is a multiple of it (None: only ``eval_steps``).
        skip_last: with ``eval_every``, leave out the run's last step (``state.max_steps``), which the caller
            evaluates after training itself.
        prefix: the logged names' prefix (``"eval_"`` logs ``eval_accuracy``, which TensorBoard shows as
            ``eval/accuracy``).
    """

    def __init__(
        self,
        eval_fn: Callable[[Any], Mapping[str, Any]] | None = None,
        eval_steps: Sequence[int] = (),
        *,
        eval_every: int | None = None,
        skip_last: bool = False,
        prefix: str = "heldout/",
    ):
        if eval_every is not None and eval_every < 1:
            raise ValueError(f"eval_every={eval_every}; expected >= 1 or None")
        self.eval_fn = eval_fn
        self.eval_steps = set(eval_steps)
        self.eval_every, self.skip_last, self.prefix = eval_every, skip_last, prefix
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

    def due(self, step: int, max_steps: int) -> bool:
        """Whether the held-out evaluation runs after optimizer step ``step`` of ``max_steps``."""
        if self.eval_fn is None:
            return False
        every = self.eval_every is not None and step % self.eval_every == 0
        return step in self.eval_steps or (every and not (self.skip_last and step >= max_steps))

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self.step_seconds.append(time.perf_counter() - self._step_start)
        if not self.due(state.global_step, state.max_steps):
            return
        trainer = self.trainer
        if trainer.accelerator.is_main_process:
            result = self.eval_fn(trainer.accelerator.unwrap_model(trainer.model))
            self.evals.append(_eval_record(state.global_step, result))
            trainer._metrics["train"][f"{self.prefix}accuracy"].append(float(result["accuracy"]))
            if "format_rate" in result:
                trainer._metrics["train"][f"{self.prefix}format_rate"].append(float(result["format_rate"]))
        trainer.accelerator.wait_for_everyone()
        if args.logging_strategy != "no":
            control.should_log = True  # logged at this step, not averaged into a later step's log
        return control


class RolloutLog(TrainerCallback):
    """Writes a few of each optimizer step's rollouts to a JSON-lines file (``rollouts.jsonl`` in a recipe's output
    folder), one object per sample: ``step``, ``prompt``, ``response``, the scores ``reward``, ``format_reward``,
    ``answer_reward`` and the row's ``answer`` (where the reward function logged them), each reward function's value
    under ``rewards``, and the ``advantage`` the loss used.

    It reads what TRL's ``GRPOTrainer`` keeps for its completions table (``trainer._logs``, TRL 1.16: the prompts,
    completions, per-function rewards and advantages of the latest generation batch, gathered from every process;
    trl_ext's trainer replaces the advantages with the course's) and the columns reward functions add to that table
    through TRL's ``log_extra`` (a task's reward function logs its three scores and the answer:
    :func:`trl_ext.rewards.as_trl_row_reward`). A step that generated nothing (its batch was generated at an earlier
    step: ``steps_per_generation`` > ``gradient_accumulation_steps``, ``num_iterations`` > 1) adds no rows; with
    dynamic sampling the rows come from the step's last generation round (the step trains on the informative groups
    of all its rounds). The
    samples are spread evenly over the batch (``samples`` of ``n``: rows ``i * n // samples``), so several groups are
    seen. Main process only; a run that resumes keeps the rows up to its checkpoint's step and drops the rest; a run
    that starts at step 0 starts the file anew. A trainer without that table (not a GRPO trainer) writes nothing and
    says so once.

    Args:
        path: the file.
        samples: rollouts kept per step (>= 1).
    """

    def __init__(self, path: str | os.PathLike, samples: int = 4):
        if samples < 1:
            raise ValueError(f"samples={samples}; expected >= 1")
        self.path, self.samples = Path(path), samples
        self.trainer: Any = None
        self._tokens_seen: int | None = None

    def attach(self, trainer: Any) -> RolloutLog:
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self._tokens_seen = state.num_input_tokens_seen
        if not state.is_world_process_zero:
            return
        if not isinstance(getattr(self.trainer, "_logs", None), Mapping):
            print(
                f"note: {type(self.trainer).__name__} keeps no completions table (trainer._logs): no {self.path.name}",
                file=sys.stderr,
            )
            self.trainer = None
            return
        kept = []
        if state.global_step > 0 and self.path.is_file():  # resumed: the rows up to the checkpoint's step
            kept = [
                line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= state.global_step
            ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in kept))

    def on_step_end(self, args, state, control, **kwargs):
        generated, self._tokens_seen = state.num_input_tokens_seen != self._tokens_seen, state.num_input_tokens_seen
        if self.trainer is None or not generated or not state.is_world_process_zero:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in self.rows(state.global_step))

    def rows(self, step: int) -> list[dict[str, Any]]:
        """The rows written for ``step``: :attr:`samples` of the latest generation batch in ``trainer._logs``."""
        from trl_ext.rewards import completion_text

        logs = self.trainer._logs
        prompts, completions = list(logs["prompt"]), list(logs["completion"])
        n = len(completions)
        picked = range(n) if n <= self.samples else [i * n // self.samples for i in range(self.samples)]
        extra = {k: list(v) for k, v in logs["extra"].items() if len(v) == n}
        rewards = {k: list(v) for k, v in logs["rewards"].items() if len(v) == n}
        advantages = list(logs["advantages"])
        rows = []
        for i in picked:
            row = {"step": step, "prompt": prompts[i], "response": completion_text(completions[i], row=i)}
            row.update(
                {k: _json_number(extra[k][i]) for k in ("reward", "format_reward", "answer_reward") if k in extra}
            )
            if "answer" in extra:
                row["answer"] = extra["answer"][i]
            if "truncated" in extra:  # cut by the length limit: a task that does not credit it scored it 0
                row["truncated"] = bool(extra["truncated"][i])
            row["rewards"] = {name: _json_number(values[i]) for name, values in rewards.items()}
            row["advantage"] = _json_number(advantages[i]) if len(advantages) == n else None
            rows.append(row)
        return rows


def _json_number(value: Any) -> float | None:
    """A float for JSON: None and NaN (TRL's "no score") as None."""
    return None if value is None or math.isnan(float(value)) else float(value)


_EVAL_KEYS = ("accuracy", "format_rate", "reward", "n", "seconds", "examples_per_second")


def _eval_record(step: int, result: Mapping[str, Any], num_examples: int = 3) -> dict[str, Any]:
    """The numbers of an evaluation result plus its first responses (``records`` of trl_ext.eval.evaluate_math)."""
    record = {"step": step, **{k: result[k] for k in _EVAL_KEYS if k in result}}
    if result.get("records"):
        record["examples"] = [
            {"response": r["response"], "answer": r["answer"]} for r in result["records"][:num_examples]
        ]
    return record


# ------------------------------------------------------------------------------------------------------ summaries
def binomial_standard_error(accuracy: float | None, n: int | None) -> float | None:
    """Standard error sqrt(p (1 - p) / n) of an accuracy p measured on n independent problems (None if unknown).

    Two accuracies on the same n problems differ by more than noise when the gap exceeds about twice
    sqrt(se_1^2 + se_2^2) (an upper bound: paired problems correlate, which makes the real noise smaller).
    """
    if accuracy is None or not n:
        return None
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / n)


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
        one on ties); ``accuracy_curve`` ``[[step, accuracy], ...]``; ``accuracy_by_seconds`` ``[[seconds,
        accuracy], ...]`` (the training seconds of the steps before each evaluation); ``median_step_seconds``;
        ``final_reward``
        (mean train ``reward`` over the last ``last_k`` logged steps); ``gen_tokens_per_second``
        (``generated_tokens / generation_seconds``); ``peak_memory_bytes``, ``memory_kind``, ``train_seconds``,
        ``steps``; ``n_eval`` (held-out problems of the last evaluation) and ``final_accuracy_se``
        (:func:`binomial_standard_error`); ``task`` (the arm's task or None); and ``curves``:
        ``{key: [[step, value], ...]}`` for each of ``curve_keys`` that was logged.
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
        "task": arm.task,
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "n_eval": evals[-1].get("n") if evals else None,
        "final_accuracy_se": binomial_standard_error(evals[-1]["accuracy"], evals[-1].get("n")) if evals else None,
        "best_accuracy": best["accuracy"] if best else None,
        "best_step": best["step"] if best else None,
        "accuracy_curve": [[e["step"], e["accuracy"]] for e in evals],
        # training wall seconds before each evaluation (the steps only; held-out evaluations take none of it)
        "accuracy_by_seconds": [[round(sum(step_seconds[: e["step"]]), 3), e["accuracy"]] for e in evals],
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
