"""The GRPO experiments of CS336 assignment 5 (handout section 8), each as arms of trl_ext.compare.

    uv run accelerate launch recipes/grpo_ablations.py --experiment baselines        # CPU default, one experiment
    uv run accelerate launch recipes/grpo_ablations.py --experiment all              # every experiment + report.md
    uv run accelerate launch recipes/grpo_ablations.py --experiment clip_ablation \\
        --config recipes/configs/grpo_ablations_math.yaml                            # GPU: Qwen2.5-Math-1.5B, vLLM

Experiments (--experiment NAME; the reference arm is the handout's default: reinforce_with_baseline, std
normalization, masked_mean, on-policy, beta 0):

  learning_rate         the reference at learning_rate x each of --lr_factors (default 1/3, 1, 3)
  baselines             no_baseline (raw reward) vs reinforce_with_baseline (group-normalized advantage)
  length_normalization  masked_mean vs masked_normalize (sum / max_completion_length)
  std_normalization     with vs without dividing by the group std
  off_policy            grpo_clip at each (epochs per rollout batch, rollout batch / train batch) of --off_policy_settings
                        (num_iterations x steps_per_generation / gradient_accumulation_steps); '1x1' is on-policy,
                        where GRPO-Clip's gradient equals the reference's, so it is the reference arm
  clip_ablation         grpo_clip vs grpo_no_clip at --clip_ablation_setting (an off-policy setting)
  prompt                the R1-Zero prompt with the r1_zero reward vs the question-only prompt with the answer reward
  all                   every experiment one after another (an arm shared by several is trained once), then
                        <output_dir>/report.md linking every table and plot

Every arm starts from the same model with the same seed, prompts and step budget (--max_steps); held-out greedy
accuracy is measured at step 0 and every --eval_every steps on --num_eval problems, next to the reward, entropy,
response length and gradient norm curves. Writes <output_dir>/<NAME>/comparison.{json,md,png} and experiment.md;
comparison.json also records the command, the resolved configs, library versions and phase times.

Options: recipes/configs/grpo_ablations_cpu.yaml holds the recipe's defaults; a --config file is layered over them
(it replaces only what it sets) and flags override both. Options, data and --output_dir are checked before any model
is loaded. An experiment whose <output_dir>/<NAME>/comparison.json exists (for 'all': any of them) is not run again
unless --overwrite_output_dir; other experiments may share the folder. Comparisons cannot be resumed (each arm trains
from scratch): --resume_from_checkpoint is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trl
from accelerate import PartialState
from grpo_math import REWARDS, MathScriptArguments, load_data, train_source  # the math recipe's data options and loaders

from trl_ext.compare import Task, arm_config, parse_arms, run_comparison, write_comparison
from trl_ext.compare.monitoring import binomial_standard_error
from trl_ext.eval import evaluate_math
from trl_ext.experiment import git_state, write_experiment_record
from trl_ext.models import DEFAULT_MODEL, load_model_and_tokenizer, load_tokenizer
from trl_ext.recipe_utils import (
    COMPARISON_HELP,
    RecipeError,
    RecipeRun,
    add_provenance,
    check_fills_one_step,
    check_model_options,
    parse_recipe_args,
    recipe_main,
    refuse_comparison_resume,
    user_input,
)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_ablations_cpu.yaml"
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
PANELS = (
    ("reward", "train reward (batch mean)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
    ("grad_norm", "gradient norm (before clipping)"),
)
CURVE_KEYS = ("reward", "entropy", "completions/mean_length", "completions/clipped_ratio", "grad_norm", "ratio/max",
              "clip_ratio/region_mean")


@dataclass
class AblationArguments(MathScriptArguments):
    """The math recipe's data options, plus which experiment to run and how its arms differ."""

    experiment: str = field(
        default="baselines", metadata={"help": f"One of {list(EXPERIMENTS)} or 'all'."}
    )
    eval_every: int = field(
        default=10, metadata={"help": "Held-out greedy evaluation every this many steps, plus step 0 and the last."}
    )
    lr_factors: list[float] = field(
        default_factory=lambda: [1 / 3, 1.0, 3.0],
        metadata={"help": "learning_rate experiment: the arms' learning rates are learning_rate x each factor."},
    )
    off_policy_settings: list[str] = field(
        default_factory=lambda: ["1x1", "2x1", "1x2", "2x2"],
        metadata={"help": "off_policy experiment: 'ExK' = E epochs per rollout batch (num_iterations) and a rollout "
                  "batch of K train batches (steps_per_generation = K x gradient_accumulation_steps)."},
    )
    clip_ablation_setting: str = field(
        default="2x2", metadata={"help": "clip_ablation experiment: the off-policy setting 'ExK' (see off_policy_settings)."}
    )
    cliprange: float = field(default=0.2, metadata={"help": "GRPO-Clip epsilon of the off_policy and clip_ablation arms."})

    def __post_init__(self):
        if self.experiment not in (*EXPERIMENTS, "all"):
            raise ValueError(f"--experiment {self.experiment!r}; expected one of {list(EXPERIMENTS)} or 'all'")
        if self.eval_every <= 0:
            raise ValueError(f"--eval_every={self.eval_every}; expected >= 1")
        if not self.lr_factors or any(f <= 0 for f in self.lr_factors):
            raise ValueError(f"--lr_factors={self.lr_factors}; expected positive factors")
        for setting in (*self.off_policy_settings, self.clip_ablation_setting):
            parse_setting(setting)


def parse_setting(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): epochs per rollout batch, train batches per rollout batch (both >= 1)."""
    try:
        epochs, batches = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"off-policy setting {text!r}; expected 'ExK' with integers E, K >= 1, e.g. '2x2'") from None
    if epochs < 1 or batches < 1:
        raise ValueError(f"off-policy setting {text!r}; expected E, K >= 1")
    return epochs, batches


def off_policy_arm(name: str, setting: str, training_args, pg_loss_type: str, cliprange: float) -> dict:
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


def experiment_arms(name: str, script_args: AblationArguments, training_args) -> list[dict]:
    """The arm specs (trl_ext.compare.parse_arms mappings) of one experiment."""
    ref = dict(REFERENCE)
    if name == "learning_rate":
        rates = [training_args.learning_rate * f for f in script_args.lr_factors]
        return [{**ref, "name": f"lr_{lr:.1e}", "learning_rate": lr} for lr in rates]
    if name == "baselines":
        return [{**ref, "name": "no_baseline", "pg_loss_type": "no_baseline"}, {**ref, "name": "reinforce_with_baseline"}]
    if name == "length_normalization":
        return [{**ref, "name": "masked_mean"}, {**ref, "name": "masked_normalize", "length_normalization": "masked_normalize"}]
    if name == "std_normalization":
        return [{**ref, "name": "std_normalized"}, {**ref, "name": "no_std", "normalize_by_std": False}]
    if name == "off_policy":
        return [
            off_policy_arm(f"grpo_clip_{s}", s, training_args, "grpo_clip", script_args.cliprange)
            for s in script_args.off_policy_settings
        ]
    if name == "clip_ablation":
        s = script_args.clip_ablation_setting
        return [
            off_policy_arm(f"grpo_clip_{s}", s, training_args, "grpo_clip", script_args.cliprange),
            off_policy_arm(f"grpo_no_clip_{s}", s, training_args, "grpo_no_clip", script_args.cliprange),
        ]
    if name == "dynamic_sampling":  # DAPO: extra rounds until every group of the batch has unequal rewards
        return [{**ref, "name": "dynamic_sampling_off"}, {**ref, "name": "dynamic_sampling_on", "dynamic_sampling": True}]
    if name == "prompt":
        return [{**ref, "name": "r1_zero", "task": "r1_zero"}, {**ref, "name": "question_only", "task": "question_only"}]
    raise ValueError(f"unknown experiment {name!r}; expected one of {list(EXPERIMENTS)}")


def load_task_data(script_args, template: str | None = None) -> tuple:
    """``(args, train, test, reward name)`` for ``template`` (None: the config's own); no tokenizer or model needed,
    so bad data fails before any model work."""
    args = script_args if template is None else dataclasses.replace(script_args, template=template, reward=None)
    train, test, reward_name = load_data(args)
    return args, train, test, reward_name


def make_task(script_args, tokenizer, training_args, data: tuple) -> tuple[Task, str]:
    """Train data, reward and held-out evaluation from ``data`` (:func:`load_task_data`)."""
    args, train, test, reward_name = data
    train_reward, eval_reward = REWARDS[reward_name]
    eval_fn = partial(
        evaluate_math, tokenizer=tokenizer, dataset=test, reward_fn=eval_reward,
        max_new_tokens=training_args.max_completion_length, batch_size=script_args.eval_batch_size, disable_progress=True,
    )
    description = f"{args.template} prompt, {reward_name} reward"
    return Task(train, train_reward, eval_fn, description), description


def observations(results: list[dict]) -> list[str]:
    """Which arm ended best, and whether each gap to it exceeds the noise of the held-out estimate."""
    scored = [r for r in results if r.get("final_accuracy") is not None]
    if not scored:
        return []
    best = max(scored, key=lambda r: r["final_accuracy"])
    notes = [f"Best final held-out accuracy: {best['name']} ({best['final_accuracy']:.1%} on {best['n_eval']} problems)."]
    for r in scored:
        if r is best:
            continue
        gap = best["final_accuracy"] - r["final_accuracy"]
        se = [binomial_standard_error(x["final_accuracy"], x["n_eval"]) for x in (best, r)]
        if None in se:
            continue
        noise = (se[0] ** 2 + se[1] ** 2) ** 0.5
        verdict = "a real difference (> 2 standard errors)" if gap > 2 * noise else "within noise (<= 2 standard errors)"
        notes.append(f"{r['name']}: {r['final_accuracy']:.1%}, {gap * 100:.1f} points below ({gap / noise if noise else 0:.1f} SE of the gap): {verdict}.")
    for r in results:
        entropy = r["curves"].get("entropy")
        if entropy and len(entropy) >= 2 and (entropy[-1][1] < 0.1 or entropy[-1][1] < entropy[0][1] / 5):
            notes.append(f"{r['name']}: entropy collapsed from {entropy[0][1]:.3f} to {entropy[-1][1]:.3f} nats/token.")
        clipped = r["curves"].get("completions/clipped_ratio")
        if clipped and clipped[-1][1] > 0.5:
            notes.append(f"{r['name']}: {clipped[-1][1]:.0%} of the last step's completions hit the length limit.")
        ratio = r["curves"].get("ratio/max")
        if ratio:
            notes.append(f"{r['name']}: largest importance ratio pi/pi_old seen {max(v for _, v in ratio):.3g}.")
    return notes


def main(script_args, training_args, model_args, command=None, speed=None):
    # everything that can be checked without the model comes first: resume, folder, options, data
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    refuse_comparison_resume(training_args)
    names = list(EXPERIMENTS) if script_args.experiment == "all" else [script_args.experiment]
    out = Path(training_args.output_dir)
    # a finished experiment leaves <NAME>/comparison.json: refuse the first one this run would redo
    markers = [f"{name}/comparison.json" for name in names]
    marker = next((m for m in markers if (out / m).is_file()), markers[0])
    run = RecipeRun("grpo_ablations", out, configs, overwrite=script_args.overwrite_output_dir, result_file=marker)
    if script_args.overwrite_output_dir and PartialState().is_main_process:
        for m in markers:  # the other experiments this run redoes: no stale result survives a stopped run
            (out / m).unlink(missing_ok=True)
    check_model_options(model_args)
    if training_args.max_steps <= 0:
        raise RecipeError(f"--max_steps {training_args.max_steps}: the experiments need a fixed step budget (>= 1)")
    command = command or "uv run accelerate launch recipes/grpo_ablations.py --experiment " + script_args.experiment
    state = PartialState()
    git = git_state()  # the code this run starts from (commits made while it runs are not its code)
    with run.phase("load_data"), user_input("--dataset_name: " if script_args.dataset_name else ""):
        base_data = load_task_data(script_args)
        prompt_data = {t: load_task_data(script_args, t) for t in ("r1_zero", "question_only")} if "prompt" in names else {}
    for name in names:  # every arm's own batch sizes (the off-policy arms generate several train batches at once)
        for arm in parse_arms(experiment_arms(name, script_args, training_args)):
            source = f"{train_source(script_args, base_data[2])}, experiment {name}, arm {arm.name}"
            check_fills_one_step(len(base_data[1]), arm_config(training_args, arm), source, "prompts")
    with run.phase("load_tokenizer"):
        tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    base_task, base_description = make_task(script_args, tokenizer, training_args, base_data)
    tasks = {template: make_task(script_args, tokenizer, training_args, data)[0] for template, data in prompt_data.items()}
    steps = training_args.max_steps
    eval_steps = sorted({0, steps, *range(script_args.eval_every, steps, script_args.eval_every)})
    cache: dict = {}
    written = []
    for name in names:
        start = time.perf_counter()
        arms = parse_arms(experiment_arms(name, script_args, training_args))
        exp_args = copy.copy(training_args)  # not dataclasses.replace: that re-runs TRL's derivations
        exp_args.output_dir = str(out / name)
        with run.phase(name):
            results = run_comparison(
                arms, exp_args, lambda: load_model_and_tokenizer(model_args), base_task.train_dataset,
                base_task.reward_funcs, base_task.eval_fn, eval_steps, curve_keys=CURVE_KEYS, tasks=tasks, cache=cache,
            )
        if not state.is_main_process:
            continue
        setup = {
            "experiment": name,
            "model": model_args.model_name_or_path or DEFAULT_MODEL,
            "task": base_description + (
                "; arms: " + ", ".join(f"{k}: {t.description}" for k, t in tasks.items()) if name == "prompt" else ""
            ),
            "held-out problems": len(base_task.eval_fn.keywords["dataset"]),
            "steps per arm": steps,
            "held-out evaluation at steps": eval_steps,
            "completions per step": training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * state.num_processes,
            "num_generations": training_args.num_generations,
            "max_completion_length": training_args.max_completion_length,
            "learning_rate": training_args.learning_rate,
            "temperature": training_args.temperature,
            "seed": training_args.seed,
            "wall seconds (this experiment, reused arms cost 0)": round(time.perf_counter() - start),
            "git commit": git["commit"],
            "dirty": git["dirty"],
            # the same for every arm: threads and precision are set once, before the arms' configs are derived
            **({"threads": speed["threads"], "precision": speed["precision"]} if speed else {}),
        }
        paths = write_comparison(results, out / name, setup, title=f"GRPO ablation: {name}", panels=PANELS,
                                 command=command.replace(f"--experiment {script_args.experiment}", f"--experiment {name}"))
        add_provenance(paths["json"], run)
        write_experiment_record(
            out / name, f"GRPO ablation: {name}", configs=(script_args, training_args, model_args),
            hyperparameters={"arms": "; ".join(f"{a.name}: {a.settings}" for a in arms)},
            results=[(r["name"], f"{r['accuracy_curve'][0][1]:.1%}" if r["accuracy_curve"] else "n/a",
                      f"{r['final_accuracy']:.1%}" if r["final_accuracy"] is not None else "n/a",
                      f"{100 * r['final_accuracy_se']:.1f}" if r.get("final_accuracy_se") is not None else "n/a",
                      r["final_reward"], r["train_seconds"]) for r in results],
            results_header=("arm", "accuracy before", "accuracy after", "SE (points)", "train reward (last 5)", "train seconds"),
            plots=["comparison.png"], observations=observations(results), command=command, git=git,
        )
        written.append((name, paths))
        print(Path(paths["md"]).read_text(), flush=True)
        if script_args.experiment == "all":  # rewritten after every experiment, so a stopped run still has one
            write_report(out, written, [n for n in names if n not in dict(written)], command)


def write_report(out: Path, written: list, missing: list, command: str) -> Path:
    """``out/report.md``: each finished experiment's plot, final accuracies with their standard errors and links."""
    lines = ["# GRPO ablations (CS336 A5, section 8)", "", f"Command: `{command}`", ""]
    if missing:
        lines += [f"Not run yet: {', '.join(missing)}.", ""]
    for name, paths in written:
        data = json.loads(Path(paths["json"]).read_text())
        lines += [f"## {name}", "", f"[table]({name}/comparison.md), [record]({name}/experiment.md)", "",
                  f"![{name}]({name}/comparison.png)", ""]
        lines += [f"- {r['name']}: {r['final_accuracy']:.1%} ± {100 * (r['final_accuracy_se'] or 0):.1f} "
                  f"({r['n_eval']} held-out problems)" for r in data["arms"] if r["final_accuracy"] is not None]
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    print(f"Wrote {path}")
    return path


def parse_args(argv=None):
    return parse_recipe_args((AblationArguments, trl.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__, COMPARISON_HELP)


if __name__ == "__main__":
    command = ("uv run accelerate launch recipes/grpo_ablations.py " + shlex.join(sys.argv[1:])).strip()
    # threads and precision are set once, before the arms' configs are derived, so every arm runs on the same ones
    recipe_main(main, parse_args, speed_defaults=DEFAULT_CONFIG, command=command)
