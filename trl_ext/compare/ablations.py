"""The GRPO experiments of CS336 assignment 5 (handout section 8) as arms: each changes one thing from the reference.

The reference arm is the handout's default GRPO (:data:`REFERENCE`: reinforce_with_baseline, std normalization,
masked_mean, on-policy, beta 0). :func:`experiment_arms` gives the arm specs of one experiment
(:data:`EXPERIMENTS`), for :func:`trl_ext.compare.parse_arms`; arms shared between experiments have one
:func:`~trl_ext.compare.arm_key` and train once when the experiments share a cache. :func:`observations` says which
arm ended best and whether each gap exceeds the noise of the held-out estimate; :func:`write_report` links every
finished experiment. Used by ``recipes/grpo_ablations.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trl_ext.compare.monitoring import binomial_standard_error
from trl_ext.measurement.observations import entropy_collapsed

EXPERIMENTS = (  # the order of --experiment all: the reference arm first, reused by the next four experiments
    "baselines",
    "std_normalization",
    "length_normalization",
    "learning_rate",
    "off_policy",
    "clip_ablation",
    "prompt",
    "dynamic_sampling",
)
REFERENCE = {
    "trainer": "trl_ext",
    "pg_loss_type": "reinforce_with_baseline",
    "normalize_by_std": True,
    "length_normalization": "masked_mean",
    "beta": 0.0,
}
"""The handout's default GRPO settings; every experiment changes one thing relative to them."""

PROMPT_TEMPLATES = ("r1_zero", "question_only")
"""The default templates of the ``prompt`` experiment (``--prompt_templates``); each arm trains on the task of that
template (its own reward and stop strings)."""


def prompt_arm_name(template: str) -> str:
    """The ``prompt`` experiment's arm for ``template``: a template name as is, a template file by its file name
    (``cs336_alignment/prompts/r1_zero.prompt`` -> ``r1_zero.prompt``)."""
    return template if "/" not in template and "\\" not in template else Path(template).name.replace(" ", "_")


def parse_setting(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): epochs per rollout batch, train batches per rollout batch (both >= 1).

    Raises:
        ValueError: not 'ExK' with integers E, K >= 1.
    """
    try:
        epochs, batches = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"off-policy setting {text!r}; expected 'ExK' with integers E, K >= 1, e.g. '2x2'") from None
    if epochs < 1 or batches < 1:
        raise ValueError(f"off-policy setting {text!r}; expected E, K >= 1")
    return epochs, batches


def off_policy_arm(name: str, setting: str, training_args: Any, pg_loss_type: str, cliprange: float) -> dict:
    """An arm that reuses each rollout batch for E epochs, the batch holding K train batches ('ExK').

    '1x1' is on-policy: there the importance ratio is 1, GRPO-Clip's gradient is exactly reinforce_with_baseline's
    (-A * grad log p), so the arm is the reference arm itself (trained once per run).
    """
    epochs, batches = parse_setting(setting)
    if (epochs, batches) == (1, 1) and pg_loss_type == "grpo_clip":
        return {**REFERENCE, "name": "on_policy_1x1"}
    return {
        **REFERENCE,
        "name": name,
        "pg_loss_type": pg_loss_type,
        "epsilon": cliprange,
        "num_iterations": epochs,
        "steps_per_generation": batches * training_args.gradient_accumulation_steps,
    }


def experiment_arms(name: str, options: Any, training_args: Any) -> list[dict]:
    """The arm specs (``trl_ext.compare.parse_arms`` mappings) of experiment ``name``.

    Args:
        name: one of :data:`EXPERIMENTS`.
        options: the recipe's options: ``lr_factors``, ``off_policy_settings``, ``clip_ablation_setting``,
            ``cliprange``, ``prompt_templates`` (default :data:`PROMPT_TEMPLATES`).
        training_args: the shared config (its ``learning_rate`` and ``gradient_accumulation_steps``).

    Raises:
        ValueError: an unknown experiment.
    """
    ref = dict(REFERENCE)
    if name == "learning_rate":
        rates = [training_args.learning_rate * f for f in options.lr_factors]
        return [{**ref, "name": f"lr_{lr:.1e}", "learning_rate": lr} for lr in rates]
    if name == "baselines":
        return [
            {**ref, "name": "no_baseline", "pg_loss_type": "no_baseline"},
            {**ref, "name": "reinforce_with_baseline"},
        ]
    if name == "length_normalization":
        return [
            {**ref, "name": "masked_mean"},
            {**ref, "name": "masked_normalize", "length_normalization": "masked_normalize"},
        ]
    if name == "std_normalization":
        return [{**ref, "name": "std_normalized"}, {**ref, "name": "no_std", "normalize_by_std": False}]
    if name == "off_policy":
        return [
            off_policy_arm(f"grpo_clip_{s}", s, training_args, "grpo_clip", options.cliprange)
            for s in options.off_policy_settings
        ]
    if name == "clip_ablation":
        s = options.clip_ablation_setting
        return [
            off_policy_arm(f"grpo_clip_{s}", s, training_args, "grpo_clip", options.cliprange),
            off_policy_arm(f"grpo_no_clip_{s}", s, training_args, "grpo_no_clip", options.cliprange),
        ]
    if name == "dynamic_sampling":  # DAPO: extra rounds until every group of the batch has unequal rewards
        return [
            {**ref, "name": "dynamic_sampling_off"},
            {**ref, "name": "dynamic_sampling_on", "dynamic_sampling": True},
        ]
    if name == "prompt":
        templates = getattr(options, "prompt_templates", None) or PROMPT_TEMPLATES
        return [{**ref, "name": prompt_arm_name(t), "task": t} for t in templates]
    raise ValueError(f"unknown experiment {name!r}; expected one of {list(EXPERIMENTS)}")


def task_description(name: str, task: Any, prompt_tasks: Mapping[str, Any]) -> str:
    """What experiment ``name`` trains on, for its setup table: ``task``'s description, and for the prompt
    experiment each arm's task (``prompt_tasks``: template -> task)."""
    if name != "prompt":
        return task.description
    return task.description + "; arms: " + ", ".join(f"{k}: {t.description}" for k, t in prompt_tasks.items())


def never_rewarded(arm: Mapping[str, Any]) -> bool:
    """Whether every reward an arm trained on was 0: at every logged step the batch's mean ``reward`` and its
    ``reward_std`` (both in ``arm["curves"]``) are 0, so every completion's reward was. Its loss then had no learning
    signal under any of the handout's losses (no_baseline weighs each completion by its reward, the others by its
    reward minus the group's mean). False when either curve is missing or empty."""
    rewards, stds = arm["curves"].get("reward"), dict(arm["curves"].get("reward_std") or [])
    return bool(rewards) and len(stds) == len(rewards) and all(v == 0 and stds.get(s) == 0 for s, v in rewards)


def observations(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which arm ended best, and whether each gap to it exceeds the noise of the held-out estimate (2 standard
    errors of the difference of two binomial accuracies); an arm that never saw a nonzero reward
    (:func:`never_rewarded`) is said not to have trained instead, and when no arm did, that is the one finding; per
    arm, entropy collapse (``trl_ext.measurement.observations.entropy_collapsed``), completions cut at the length limit,
    the largest importance ratio."""
    scored = [r for r in results if r.get("final_accuracy") is not None]
    if not scored:
        return []
    untrained = {r["name"] for r in results if never_rewarded(r)}
    best = max(scored, key=lambda r: r["final_accuracy"])
    notes = [
        f"Best final held-out accuracy: {best['name']} ({best['final_accuracy']:.1%} on {best['n_eval']} problems)."
    ]
    if untrained and untrained == {r["name"] for r in results}:
        notes = [
            f"No arm trained: every reward was 0 (every completion of every step of all {len(results)} arms), so no "
            "loss had a learning signal: the accuracies measure the initial model, not the settings (check "
            "eval_before.jsonl for what the scorer saw: the prompt's answer format, the generation budget)."
        ]
    for r in scored:
        if r["name"] in untrained:
            if len(untrained) < len(results):
                steps = len(r["curves"]["reward"])
                notes.append(
                    f"{r['name']}: did not train: every reward was 0 in its {steps} logged step"
                    f"{'s' if steps != 1 else ''}, so its loss had no learning signal: its {r['final_accuracy']:.1%} "
                    "measures the initial model, not its setting."
                )
            continue
        if r is best:
            continue
        gap = best["final_accuracy"] - r["final_accuracy"]
        se = [binomial_standard_error(x["final_accuracy"], x["n_eval"]) for x in (best, r)]
        if None in se:
            continue
        noise = (se[0] ** 2 + se[1] ** 2) ** 0.5
        verdict = (
            "a real difference (> 2 standard errors)" if gap > 2 * noise else "within noise (<= 2 standard errors)"
        )
        notes.append(
            f"{r['name']}: {r['final_accuracy']:.1%}, {gap * 100:.1f} points below ({gap / noise if noise else 0:.1f} "
            f"SE of the gap): {verdict}."
        )
    for r in results:
        entropy = r["curves"].get("entropy")
        if entropy and len(entropy) >= 2 and entropy_collapsed(entropy[0][1], entropy[-1][1]):
            notes.append(f"{r['name']}: entropy collapsed from {entropy[0][1]:.3f} to {entropy[-1][1]:.3f} nats/token.")
        clipped = r["curves"].get("completions/clipped_ratio")
        if clipped and clipped[-1][1] > 0.5:
            notes.append(f"{r['name']}: {clipped[-1][1]:.0%} of the last step's completions hit the length limit.")
        ratio = r["curves"].get("ratio/max")
        if ratio:
            notes.append(f"{r['name']}: largest importance ratio pi/pi_old seen {max(v for _, v in ratio):.3g}.")
    return notes


RECORD_HEADER = ("arm", "accuracy before", "accuracy after", "SE (points)", "train reward (last 5)", "train seconds")
"""Columns of :func:`record_rows`, the results table of each experiment's ``experiment.md``."""


def record_rows(results: Sequence[Mapping[str, Any]]) -> list[tuple]:
    """One :data:`RECORD_HEADER` row per arm: held-out accuracy at step 0 and at the end, its standard error in
    points, the train reward of the last 5 steps and the training seconds."""
    pct = lambda x: f"{x:.1%}" if x is not None else "n/a"  # noqa: E731
    return [
        (
            r["name"],
            pct(r["accuracy_curve"][0][1]) if r["accuracy_curve"] else "n/a",
            pct(r["final_accuracy"]),
            f"{100 * r['final_accuracy_se']:.1f}" if r.get("final_accuracy_se") is not None else "n/a",
            r["final_reward"],
            r["train_seconds"],
        )
        for r in results
    ]


def write_report(
    out: Path, written: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], missing: Sequence[str], command: str
) -> Path:
    """``out/report.md``: for each finished experiment (``(name, its arm summaries)``, in order) its plot, the final
    accuracies with their standard errors and links to its table and record; ``missing`` names the experiments not
    run yet."""
    lines = ["# GRPO ablations (CS336 A5, section 8)", "", f"Command: `{command}`", ""]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    for name, arms in written:
        lines += [
            f"## {name}",
            "",
            f"[table]({name}/comparison.md), [record]({name}/experiment.md)",
            "",
            f"![{name}]({name}/comparison.png)",
            "",
        ]
        lines += [
            f"- {r['name']}: {r['final_accuracy']:.1%} ± {100 * (r['final_accuracy_se'] or 0):.1f} "
            f"({r['n_eval']} held-out problems)"
            for r in arms
            if r["final_accuracy"] is not None
        ]
        lines.append("")
    path = Path(out) / "report.md"
    path.write_text("\n".join(lines))
    print(f"Wrote {path}")
    return path
