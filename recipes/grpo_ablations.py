"""The GRPO experiments of CS336 assignment 5 (handout section 8), each as arms of trl_ext.compare.

    uv run python recipes/grpo_ablations.py --experiment baselines                 # CPU default, one experiment
    uv run python recipes/grpo_ablations.py --experiment all                       # every experiment + report.md
    uv run --extra gpu accelerate launch --config_file accelerate_configs/single_process.yaml \\
        recipes/grpo_ablations.py --experiment clip_ablation \\
        --config recipes/configs/grpo_ablations_math.yaml                          # GPU: Qwen2.5-Math-1.5B, vLLM

Experiments (--experiment NAME; the reference arm is the handout's default: reinforce_with_baseline, std
normalization, masked_mean, on-policy, beta 0):

  learning_rate         the reference at learning_rate x each of --lr_factors (default 1/3, 1, 3)
  baselines             no_baseline (raw reward) vs reinforce_with_baseline (group-normalized advantage)
  length_normalization  masked_mean vs masked_normalize (sum / max_completion_length)
  std_normalization     with vs without dividing by the group std
  off_policy            grpo_clip at each (epochs per rollout batch, rollout batch / train batch) of
  --off_policy_settings
                        (num_iterations x steps_per_generation / gradient_accumulation_steps); '1x1' is on-policy,
                        where GRPO-Clip's gradient equals the reference's, so it is the reference arm
  clip_ablation         grpo_clip vs grpo_no_clip at --clip_ablation_setting (an off-policy setting)
  prompt                the R1-Zero prompt with the r1_zero reward (stopping at </answer>) vs the question-only prompt
                        with the answer reward; --prompt_templates replaces them (e.g. the course's r1_zero.prompt
                        file)
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import PartialState

import trl_ext
from trl_ext import cli, report, tasks

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_ablations_cpu.yaml"
PANELS = (
    ("reward", "train reward (batch mean)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
    ("grad_norm", "gradient norm (before clipping)"),
)
CURVE_KEYS = (
    "reward",
    "reward_std",
    "entropy",
    "completions/mean_length",
    "completions/clipped_ratio",
    "grad_norm",
    "ratio/max",
    "clip_ratio/region_mean",
)


@dataclass
class AblationArguments(tasks.TaskArguments):
    """The task's options (--task, --task_config, data), plus which experiment to run and how its arms differ."""

    experiment: str = field(
        default="baselines", metadata={"help": f"One of {list(trl_ext.compare.ablations.EXPERIMENTS)} or 'all'."}
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
        metadata={
            "help": "off_policy experiment: 'ExK' = E epochs per rollout batch (num_iterations) and a rollout "
            "batch of K train batches (steps_per_generation = K x gradient_accumulation_steps)."
        },
    )
    clip_ablation_setting: str = field(
        default="2x2",
        metadata={"help": "clip_ablation experiment: the off-policy setting 'ExK' (see off_policy_settings)."},
    )
    cliprange: float = field(
        default=0.2, metadata={"help": "GRPO-Clip epsilon of the off_policy and clip_ablation arms."}
    )
    prompt_templates: list[str] = field(
        default_factory=lambda: list(trl_ext.compare.ablations.PROMPT_TEMPLATES),
        metadata={
            "help": "prompt experiment: one arm per template, each with its own grader and stop strings: names "
            "('r1_zero', 'question_only', 'chat') or template files, e.g. the course's "
            "cs336_alignment/prompts/r1_zero.prompt question_only."
        },
    )

    def __post_init__(self):
        experiments = trl_ext.compare.ablations.EXPERIMENTS
        if self.experiment not in (*experiments, "all"):
            raise ValueError(f"--experiment {self.experiment!r}; expected one of {list(experiments)} or 'all'")
        if self.eval_every <= 0:
            raise ValueError(f"--eval_every={self.eval_every}; expected >= 1")
        if not self.lr_factors or any(f <= 0 for f in self.lr_factors):
            raise ValueError(f"--lr_factors={self.lr_factors}; expected positive factors")
        for setting in (*self.off_policy_settings, self.clip_ablation_setting):
            trl_ext.compare.ablations.parse_setting(setting)
        arms = [trl_ext.compare.ablations.prompt_arm_name(t) for t in self.prompt_templates]
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"--prompt_templates {self.prompt_templates}: expected templates with distinct names")

    @property
    def experiments(self) -> list[str]:
        return list(trl_ext.compare.ablations.EXPERIMENTS) if self.experiment == "all" else [self.experiment]


def result_files(script_args, *configs) -> list[str]:
    """A finished experiment leaves <NAME>/comparison.json: any of those this run would redo refuses the folder, and
    --overwrite_output_dir deletes them all first, so no stale result survives a stopped run."""
    return [f"{name}/comparison.json" for name in script_args.experiments]


@cli.recipe(
    "grpo_ablations",
    (AblationArguments, trl.GRPOConfig, trl.ModelConfig),
    DEFAULT_CONFIG,
    result_file=result_files,
    comparison=True,
)
def main(run, script_args, training_args, model_args, command=None, speed=None):
    ablations, compare, models = trl_ext.compare.ablations, trl_ext.compare, trl_ext.models
    names, state = script_args.experiments, PartialState()
    command = command or "uv run python recipes/grpo_ablations.py --experiment " + script_args.experiment
    budget = training_args.max_completion_length
    with run.phase("load_data"):
        task = tasks.load_task(script_args, max_new_tokens=budget)
        prompt_tasks = {
            t: tasks.load_task(script_args, budget, template=t)
            for t in script_args.prompt_templates
            if "prompt" in names
        }
    arms = {name: compare.parse_arms(ablations.experiment_arms(name, script_args, training_args)) for name in names}
    for name in names:  # every arm's own batch sizes (the off-policy arms generate several train batches at once)
        for arm in arms[name]:
            task.check_fills_one_step(compare.arm_config(training_args, arm), f", experiment {name}, arm {arm.name}")
    with run.phase("load_tokenizer"):
        tokenizer = models.load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    steps, cache, written = compare.eval_steps(training_args.max_steps, script_args.eval_every), {}, []
    for name in names:
        start, exp_args = time.perf_counter(), copy.copy(training_args)  # not dataclasses.replace: TRL re-derives
        exp_args.output_dir = str(run.output_dir / name)
        with run.phase(name):
            results = compare.run_comparison(
                arms[name],
                exp_args,
                lambda: models.load_model_and_tokenizer(model_args),
                task,
                tokenizer,
                steps,
                curve_keys=CURVE_KEYS,
                tasks=prompt_tasks,
                cache=cache,
                warn=run.warn,
            )
        if not state.is_main_process:
            continue
        described = ablations.task_description(name, task, prompt_tasks)
        setup = {
            **compare.setup_summary(
                training_args,
                model_args,
                steps,
                speed,
                {"experiment": name, "task": described, "held-out problems": len(task.test)},
            ),
            "wall seconds (this experiment, reused arms cost 0)": round(time.perf_counter() - start),
            "code": "; ".join(trl_ext.run.describe_code(run.git, run.project_git)),  # what this run started from
        }
        report.finish_comparison(
            run,
            results,
            setup,
            title=f"GRPO ablation: {name}",
            output_dir=run.output_dir / name,
            panels=PANELS,
            command=command.replace(f"--experiment {script_args.experiment}", f"--experiment {name}"),
            record=(ablations.RECORD_HEADER, ablations.record_rows(results), ablations.observations(results)),
            hyperparameters={"arms": "; ".join(f"{a.name}: {a.settings}" for a in arms[name])},
        )
        written.append((name, results))
        if script_args.experiment == "all":  # rewritten after every experiment, so a stopped run still has one
            ablations.write_report(run.output_dir, written, [n for n in names if n not in dict(written)], command)


if __name__ == "__main__":
    # threads and precision are set once (speed=), before the arms' configs are derived: every arm runs on them
    cli.main(main)
