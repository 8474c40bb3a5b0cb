"""Running arms one after another from the same model, data, seed, prompts and step budget."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import trl
from transformers import set_seed

from trl_ext.callbacks import eval_record
from trl_ext.compare.arms import TRAINERS, Arm, arm_config, arm_key
from trl_ext.compare.monitoring import ArmMonitor, PeakMemory, release_memory, summarize_arm
from trl_ext.eval import write_jsonl
from trl_ext.measurement.profiling import StepProfiler, time_breakdown
from trl_ext.tasks import Task, nothing_to_learn


def eval_steps(max_steps: int, every: int) -> list[int]:
    """The steps a comparison evaluates at: 0 (before training), every ``every`` steps, and the last."""
    return sorted({0, max_steps, *range(every, max_steps, every)})


def _evaluator(task: Any, tokenizer: Any, timer: Any = None) -> Callable[[Any], Mapping[str, Any]] | None:
    """``task.evaluate`` of a model (quiet), timed as the ``evaluation`` phase of ``timer``; None without a task."""
    if task is None or tokenizer is None:
        return None

    def evaluate(model):
        with timer.phase("evaluation") if timer is not None else contextlib.nullcontext():
            return task.evaluate(model, tokenizer, progress=False)

    return evaluate


def run_comparison(
    arms: Sequence[Arm],
    base_args: trl.GRPOConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    task: Any,
    tokenizer: Any = None,
    eval_steps: Sequence[int] = (),
    curve_keys: Sequence[str] = ("reward", "entropy", "completions/mean_length"),
    log: Callable[[str], None] = print,
    *,
    tasks: Mapping[str, Task] | None = None,
    cache: MutableMapping[str, Any] | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Train each arm from the same initial model, one after another, and summarize it (:func:`summarize_arm`).

    Every arm gets ``set_seed(base_args.seed)`` before its model loads, the same prompts in the same order, rewards
    and step budget (:func:`arm_config`). With a ``tokenizer`` arms are evaluated at ``eval_steps``; step 0 is
    evaluated once per task and shared (records in ``<output_dir>/eval_before.jsonl``; ``warn`` when there is
    nothing to learn, :func:`trl_ext.tasks.nothing_to_learn`). An arm with a ``task`` uses ``tasks[arm.task]``.

    Args:
        arms: from :func:`parse_arms`.
        base_args: the shared config (a ``trl.GRPOConfig``).
        load_model: returns a fresh ``(model, tokenizer, peft_config)`` (``trl_ext.models.load_model_and_tokenizer``).
        task: a :class:`trl_ext.tasks.Task`: training prompts, reward function(s) and held-out evaluation.
        tokenizer: for the held-out evaluations (None: no evaluation).
        eval_steps: optimizer steps at which to evaluate (0 = before training; :func:`eval_steps`).
        curve_keys: logged metrics kept as curves.
        log: progress printer (main process only).
        tasks: task name -> :class:`trl_ext.tasks.Task`, for arms whose ``task`` is set.
        cache: a dict shared by several calls: an arm whose :func:`arm_key` is in it is not trained again.
        warn: prints (and records) a warning, e.g. ``trl_ext.run.RecipeRun.warn``; default ``log("warning: ...")``.

    Returns:
        One summary dict per arm (on every process; held-out numbers only exist on the main process).

    Raises:
        ValueError: an arm names a task that is not in ``tasks``.
    """
    from accelerate import PartialState

    tasks = _tasks_by_name(arms, tasks, task)
    cache = {} if cache is None else cache
    is_main = PartialState().is_main_process
    log = log if is_main else (lambda message: None)
    warn = warn or (lambda message: log(f"warning: {message}"))

    def initial_eval(task_name):  # once per task (and per cache)
        evaluate = _evaluator(tasks[task_name], tokenizer)
        if evaluate is None or 0 not in eval_steps:
            return None
        key = f"initial-eval:{task_name}"
        if key not in cache:
            cache[key] = _initial_record(
                evaluate, tasks[task_name], task_name, base_args, load_model, log, warn, is_main
            )
        return cache[key]

    results = []
    for i, arm in enumerate(arms):
        key, which = arm_key(arm, base_args), f"[{i + 1}/{len(arms)}] arm {arm.name!r}"
        if key in cache:
            log(f"{which}: already trained in this run as {cache[key]['name']!r}, reused")
            results.append({**cache[key], "name": arm.name, "settings": dict(arm.settings), "task": arm.task})
            continue
        first_eval, config = initial_eval(arm.task), arm_config(base_args, arm)
        log(f"{which} ({arm.trainer}{f', task {arm.task}' if arm.task else ''}): {arm.settings}")
        cache[key] = _train_arm(arm, tasks[arm.task], config, load_model, eval_steps, first_eval, curve_keys, log)
        results.append(cache[key])
    return results


def _tasks_by_name(arms: Sequence[Arm], tasks: Mapping[str, Task] | None, task: Any) -> dict[str | None, Any]:
    """``tasks`` and ``task`` under the name None; an arm naming a task not in ``tasks`` raises ValueError."""
    tasks = dict(tasks or {})
    missing = sorted({a.task for a in arms if a.task is not None and a.task not in tasks})
    if missing:
        raise ValueError(f"arms use tasks {missing} that are not in tasks (given: {sorted(tasks)})")
    return {**tasks, None: task}


def _initial_record(
    evaluate: Callable[[Any], Mapping[str, Any]],
    task: Task,
    task_name: str | None,
    base_args: trl.GRPOConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    log: Callable[[str], None],
    warn: Callable[[str], None],
    is_main: bool,
) -> dict[str, Any] | None:
    """The initial model's step-0 point, evaluated on the main process (None elsewhere, where the model is loaded
    too); its records written to ``eval_before[_<task>].jsonl`` before any arm trains, and ``warn`` told when there
    is nothing to learn."""
    set_seed(base_args.seed)
    model, _, _ = load_model()
    record = None
    if is_main:
        if torch.cuda.is_available():
            model = model.to("cuda")
        result = evaluate(model)
        record = eval_record(0, result)
        log(f"initial model{f' ({task_name})' if task_name else ''}: held-out accuracy {record['accuracy']:.1%}")
        records = write_jsonl(
            result["records"], Path(base_args.output_dir) / f"eval_before{f'_{task_name}' if task_name else ''}.jsonl"
        )
        warning = nothing_to_learn(result, task.reward_keys, where=str(records))
        if warning:
            warn(warning)
    del model
    release_memory()
    return record


def _train_arm(
    arm: Arm,
    task: Task,
    config: trl.GRPOConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    eval_steps: Sequence[int],
    first_eval: Mapping[str, Any] | None,
    curve_keys: Sequence[str],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Train one arm from a fresh model seeded with ``config.seed`` and summarize it (:func:`summarize_arm`, plus
    the seconds per phase of its ``train()``); the model and trainer are released before it returns."""
    set_seed(config.seed)
    model, tokenizer, peft_config = load_model()
    trainer = TRAINERS[arm.trainer][0](
        model=model,
        reward_funcs=task.reward_funcs,
        args=config,
        train_dataset=task.train,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    profiler = StepProfiler()  # held-out evaluations count as "evaluation", not as training time
    evaluate = _evaluator(task, tokenizer, profiler.timer)
    monitor = ArmMonitor(evaluate, [s for s in eval_steps if s > 0]).attach(trainer)
    profiler.attach(trainer)
    meter = PeakMemory().start()
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    peak = meter.stop()
    summary = summarize_arm(
        arm,
        trainer.state.log_history,
        monitor.step_seconds,
        ([first_eval] if first_eval else []) + monitor.evals,
        generated_tokens=monitor.generated_tokens,
        generation_seconds=monitor.generation_seconds,
        peak_memory_bytes=peak,
        memory_kind=meter.kind,
        train_seconds=train_seconds,
        step_cpu_seconds=monitor.step_cpu_seconds,
        curve_keys=curve_keys,
    )
    summary["time_breakdown"] = time_breakdown(profiler.timer)  # seconds per phase of this arm's train()
    acc, median = summary["final_accuracy"], summary["median_step_seconds"]
    log(
        f"arm {arm.name!r}: {summary['steps']} steps in {train_seconds:.0f} s"
        + (f", median {median:.1f} s/step" if median is not None else "")
        + (f", held-out accuracy {acc:.1%}" if acc is not None else "")
    )
    del trainer, model, monitor, profiler
    release_memory()
    return summary
