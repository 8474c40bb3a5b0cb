"""Upstream trl.GRPOTrainer next to trl_ext.GRPOTrainer settings: same model, data, seed, prompts and step budget.

    uv run python recipes/compare_upstream.py   # CPU default: embedded SmolLM2, 2-digit addition, trl trl_ext course
    uv run --extra gpu accelerate launch --config_file accelerate_configs/single_process.yaml \
        recipes/compare_upstream.py --config recipes/configs/compare_upstream_gsm8k.yaml      # GPU
    uv run python recipes/compare_upstream.py --arms trl course kl_k3 --max_steps 40 --eval_every 20

Without --config the CPU config recipes/configs/compare_upstream_cpu.yaml is used; any flag overrides it (on 2 CPU
cores its 20 steps and 5 evaluations take ~6 minutes for upstream's arm and ~2-3 for each trl_ext arm). Arms are
preset names (trl_ext.compare.ARM_PRESETS: trl and trl_ext -- upstream and trl_ext at TRL's defaults, the same
math --, trl_grpo, course, no_std, masked_normalize, dr_grpo, kl_k3) or mappings
(YAML) / JSON objects (command line) such as '{"name": "lr_high", "preset": "course", "learning_rate": 5e-5}'.
Writes comparison.json, comparison.md and comparison.png into --output_dir, and each arm's tensorboard logs into
--output_dir/<arm> (`tensorboard --logdir <output_dir>` shows the arms side by side).

Options: a --config file is layered over the recipe's default config (it replaces only what it sets; flags override
both); options and --output_dir are checked before any model is loaded; a folder holding a finished comparison
(comparison.json) is not overwritten unless --overwrite_output_dir. Comparisons cannot be resumed (each arm trains
from scratch): --resume_from_checkpoint is refused. comparison.json also records the command, the resolved configs,
library versions and phase times.
"""

from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import PartialState

import trl_ext
from trl_ext import cli, report, tasks

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "compare_upstream_cpu.yaml"


@dataclass
class CompareArguments(tasks.TaskArguments):
    """The task's options (--task, --task_config, data), plus the arms and how often to evaluate them."""

    arms: list[str] = field(
        default_factory=lambda: ["trl", "trl_ext", "course"],
        metadata={"help": "Arms, run in this order: preset names or JSON objects (see trl_ext.compare.parse_arms)."},
    )
    eval_every: int = field(
        default=10, metadata={"help": "Held-out greedy evaluation every this many steps, plus step 0 and the last."}
    )


@cli.recipe("compare_upstream", (CompareArguments, trl.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, comparison=True)
def main(run, script_args, training_args, model_args, command=None, speed=None):
    compare, models = trl_ext.compare, trl_ext.models
    with cli.user_input("--arms: "):
        arms = compare.parse_arms(script_args.arms)
    with run.phase("load_data"):
        task = tasks.load_task(script_args, max_new_tokens=training_args.max_completion_length)
    for arm in arms:  # each arm's own batch sizes
        with cli.user_input(f"--arms {arm.name}: "):
            task.check_fills_one_step(compare.arm_config(training_args, arm), f", arm {arm.name}")
    tokenizer = models.load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    steps = compare.eval_steps(training_args.max_steps, script_args.eval_every)
    load = lambda: models.load_model_and_tokenizer(model_args)  # noqa: E731  (a fresh model per arm)
    results = compare.run_comparison(arms, training_args, load, task, tokenizer, steps, warn=run.warn)
    if not PartialState().is_main_process:
        return
    setup = compare.setup_summary(
        training_args,
        model_args,
        steps,
        speed,
        {
            "dataset": task.dataset,
            "reward": task.name,
            "train prompts": len(task.train) if hasattr(task.train, "__len__") else "streamed",
            "held-out problems": len(task.test),
        },
    )
    report.finish_comparison(run, results, setup, title="GRPO: upstream TRL vs trl_ext settings", command=command)


if __name__ == "__main__":
    # threads and precision are set once (speed=), before the arms' configs are derived: every arm runs on them
    cli.main(main)
