"""Where the wall time of a training run goes: per-phase timers around the trainer's seams.

:class:`PhaseTimer` accumulates wall seconds per phase, exclusive of nested phases (they never double count).
:class:`StepProfiler` attaches one to any ``transformers.Trainer`` by wrapping, on the instance, the methods each
phase runs in (TRL 1.16 / transformers 5.x; a trainer without the method has no such phase):

==============  ==========================================================================================
phase           what is timed
==============  ==========================================================================================
generation      ``trainer._generate`` (prompt tokenization, ``model.generate`` / vLLM, decoding)
reward          ``trainer._calculate_rewards`` (every reward function, gathered across processes)
logprob_forward ``trainer._get_per_token_logps_and_entropies`` (policy, old-policy and reference forwards)
backward        ``trainer.accelerator.backward`` (the loss's backward pass)
optimizer       ``trainer._clip_grad_norm`` plus ``optimizer.step()`` (``on_pre_optimizer_step`` ->
                ``on_optimizer_step``)
checkpoint      ``trainer._save_checkpoint``
train_other     the rest of ``trainer.train()``: data loading, advantages, the loss arithmetic, logging, callbacks
==============  ==========================================================================================

``evaluation`` and ``model_load`` are timed by the caller with :meth:`PhaseTimer.phase`. On CUDA each phase boundary
synchronizes the device, so kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

TRAIN_PHASES = ("generation", "reward", "logprob_forward", "backward", "optimizer", "checkpoint")
"""Phases :class:`StepProfiler` times inside ``trainer.train()``; ``train_other`` is the remainder."""


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimer:
    """Wall seconds per phase, exclusive of nested phases (:meth:`phase`, ``seconds``: where the time went), and per
    stage, inclusive (:meth:`stage`, ``stage_seconds``: ``load_model``, ``eval_before``, ``train``...)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stage_seconds: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [name, start, seconds spent in nested phases]

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name``, inclusive of whatever runs inside it; repeated names add up."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name``; time spent in phases nested inside it is charged to those instead."""
        _sync()
        self._stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            _sync()
            _, start, nested = self._stack.pop()
            elapsed = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - nested
            self.calls[name] = self.calls.get(name, 0) + 1
            if self._stack:
                self._stack[-1][2] += elapsed

    @property
    def current(self) -> str | None:
        """The innermost phase running now, or None (read by ``trl_ext.measurement.roofline.WorkCounter``)."""
        return self._stack[-1][0] if self._stack else None

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` to ``name`` (for intervals measured outside :meth:`phase`); measured while a phase runs,
        they are that phase's no longer (exclusive, as if timed by a nested :meth:`phase`)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._stack:
            self._stack[-1][2] += seconds

    def wrap(self, obj: Any, method: str, name: str) -> None:
        """Replace ``obj.method`` (on the instance) by a version timed as ``name``."""
        original = getattr(obj, method)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(obj, method, timed)


class StepProfiler(TrainerCallback):
    """Per-phase wall time of ``trainer.train()`` (phases in the module docstring): ``StepProfiler(timer).attach(
    trainer)`` before training; ``timer`` None starts a fresh :class:`PhaseTimer`."""

    def __init__(self, timer: PhaseTimer | None = None):
        self.timer = timer if timer is not None else PhaseTimer()
        self.train_seconds = 0.0
        self.steps = 0
        self.optimizer_steps = 0
        self._train_start: float | None = None
        self._optimizer_start: float | None = None
        self._clipped = False
        self._inside_train = 0.0

    def attach(self, trainer: Any) -> StepProfiler:
        """Wrap ``trainer``'s phase methods (those it has) and register as its callback; returns ``self``.

        Raises:
            ValueError: ``trainer`` already has a StepProfiler (its phases would be timed twice).
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is not None and any(isinstance(cb, StepProfiler) for cb in handler.callbacks):
            raise ValueError("this trainer already has a StepProfiler attached; attach one per trainer")
        for method, name in (
            ("_generate", "generation"),
            ("_calculate_rewards", "reward"),
            ("_get_per_token_logps_and_entropies", "logprob_forward"),
            ("_save_checkpoint", "checkpoint"),
        ):
            if callable(getattr(trainer, method, None)):
                self.timer.wrap(trainer, method, name)
        if callable(getattr(getattr(trainer, "accelerator", None), "backward", None)):
            self.timer.wrap(trainer.accelerator, "backward", "backward")
        if callable(getattr(trainer, "_clip_grad_norm", None)):
            # Gradient clipping runs right before on_pre_optimizer_step; charge it to the optimizer phase.
            clip = trainer._clip_grad_norm

            @functools.wraps(clip)
            def clipped(*args, **kwargs):
                self._clipped = True
                return clip(*args, **kwargs)

            trainer._clip_grad_norm = clipped
            self.timer.wrap(trainer, "_clip_grad_norm", "optimizer")
        trainer.add_callback(self)
        return self

    def _phase_total(self) -> float:
        # every phase, including ones the caller times inside train() (e.g. held-out evaluation in a callback)
        return sum(self.timer.seconds.values())

    def on_train_begin(self, args, state, control, **kwargs):
        _sync()
        self._train_start = time.perf_counter()
        self._inside_train = self._phase_total()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        _sync()
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_start is not None:
            _sync()
            self.timer.add("optimizer", time.perf_counter() - self._optimizer_start)
            if self._clipped:  # clipping + step count as one call per optimizer step
                self.timer.calls["optimizer"] -= 1
            self._optimizer_start, self._clipped = None, False
            self.optimizer_steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_train_end(self, args, state, control, **kwargs):
        if self._train_start is None:
            return
        _sync()
        self.train_seconds += time.perf_counter() - self._train_start
        inside = self._phase_total() - self._inside_train
        self.timer.add("train_other", max(0.0, self.train_seconds - inside))
        self._train_start = None


def time_breakdown(timer: PhaseTimer, total_seconds: float | None = None) -> dict[str, float]:
    """Seconds per phase in a fixed order (phases that never ran are left out), rounded to 1 ms.

    With ``total_seconds`` (wall time), ``other`` is what no phase covered and ``total`` the phases plus ``other``.
    ``startup`` (a recipe's: from the command's start to its first phase) comes first, ``finish`` (writing its
    outputs) last.
    """
    order = ("startup", "model_load", "evaluation", *TRAIN_PHASES, "train_other")
    out = {name: timer.seconds[name] for name in order if name in timer.seconds}
    out.update({k: v for k, v in timer.seconds.items() if k not in out and k != "finish"})
    if "finish" in timer.seconds:
        out["finish"] = timer.seconds["finish"]
    if total_seconds is not None:
        out["other"] = max(0.0, total_seconds - sum(out.values()))
        out["total"] = total_seconds
    return {k: round(v, 3) for k, v in out.items()}


def format_breakdown(breakdown: Mapping[str, float]) -> str:
    """One line per phase: seconds and share of ``total`` (or of the sum when there is no ``total``)."""
    total = breakdown.get("total") or sum(v for k, v in breakdown.items() if k != "total") or 1.0
    width = max(len(k) for k in breakdown)
    return "\n".join(f"{k:<{width}}  {v:8.1f} s  {v / total:6.1%}" for k, v in breakdown.items())


def cpu_seconds() -> float:
    """User plus system CPU seconds of this process so far, all threads (``getrusage``; Unix): work that a busy
    machine does not inflate, unlike wall time."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
