"""Monitoring one arm while it trains: peak memory, step and generation time, held-out accuracy; summaries."""

from __future__ import annotations

import ctypes
import gc
import math
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trl_ext.callbacks import HeldOutEvaluation, RolloutLog, eval_record  # noqa: F401 -- served here too
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


class ArmMonitor(HeldOutEvaluation):
    """Measures one arm while it trains: step wall time, generation time and tokens, and held-out accuracy
    (:class:`trl_ext.callbacks.HeldOutEvaluation`, whose arguments it takes).

    Attach with :meth:`attach` after building the trainer. Step time runs from ``on_step_begin`` to ``on_step_end``
    (generation, reward, loss, backward and optimizer step; not the held-out evaluation, which runs after it in
    ``on_step_end``). ``step_cpu_seconds`` are the process's CPU seconds (user + system, every thread:
    ``time.process_time``) over the same spans: the work a step did, whatever share of the cores it got. Generation
    time and generated tokens come from wrapping the trainer's ``_generate`` (TRL 1.16: returns ``(prompt_ids,
    completion_ids, ...)`` with ``completion_ids`` a list of token-id lists, this process's completions).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.generation_seconds = 0.0
        self.generated_tokens = 0
        self._step_start: tuple[float, float] | None = None

    def attach(self, trainer: Any) -> ArmMonitor:
        super().attach(trainer)
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
        self._step_start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            wall, cpu = self._step_start
            self.step_seconds.append(time.perf_counter() - wall)
            self.step_cpu_seconds.append(time.process_time() - cpu)
        return super().on_step_end(args, state, control, **kwargs)


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
    step_cpu_seconds: Sequence[float] | None = None,
    curve_keys: Sequence[str] = ("reward", "entropy", "completions/mean_length"),
    last_k: int = 5,
) -> dict[str, Any]:
    """Per-arm numbers for the comparison.

    Returns:
        dict with ``name``, ``trainer``, ``settings``; ``final_accuracy`` (held-out accuracy at the last evaluated
        step), ``best_accuracy`` and ``best_step`` (highest over all evaluated steps, step 0 included; the first
        one on ties); ``accuracy_curve`` ``[[step, accuracy], ...]``; ``accuracy_by_seconds`` ``[[seconds,
        accuracy], ...]`` (the training seconds of the steps before each evaluation) and, given
        ``step_cpu_seconds`` (one per step, as ``step_seconds``), ``accuracy_by_cpu_seconds`` (their CPU seconds)
        and ``median_step_cpu_seconds``; ``median_step_seconds``; ``final_reward``
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
        "accuracy_by_cpu_seconds": (
            [[round(sum(step_cpu_seconds[: e["step"]]), 3), e["accuracy"]] for e in evals] if step_cpu_seconds else None
        ),
        "median_step_cpu_seconds": statistics.median(step_cpu_seconds) if step_cpu_seconds else None,
        "final_reward": statistics.fmean(rewards[-last_k:]) if rewards else None,
        "gen_tokens_per_second": generated_tokens / generation_seconds if generation_seconds > 0 else None,
        "generated_tokens": generated_tokens,
        "peak_memory_bytes": peak_memory_bytes,
        "memory_kind": memory_kind,
        "train_seconds": train_seconds,
        "steps": len(step_seconds),
        "curves": {k: v for k, v in curves.items() if v},
    }
