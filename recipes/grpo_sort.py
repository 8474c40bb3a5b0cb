"""The lecture's toy RL experiment on a language model: learn to sort N numbers with policy gradient.

    uv run python recipes/grpo_sort.py              # CPU default: embedded SmolLM2, 3 numbers, 4 arms
    uv run python recipes/grpo_sort.py --arms raw normalized --max_steps 30 --num_numbers 4

Rewards (trl_ext.rewards.sorting): the lecture's shaped reward (one point per prompt number present in the response,
one per adjacent pair in order; 2N-1 for a correct answer) and the all-or-nothing reward (1 for exactly the sorted
numbers). Both are computed and logged for every arm (rewards/sort_shaped_reward/mean,
rewards/sort_exact_reward/mean); ``reward_weights`` decides which one trains (default [1, 0]: the shaped one).

Arms are the lecture's three ways to turn rewards into the weights of -log p (its ``compute_deltas`` modes), as
trl_ext.GRPOTrainer settings:
  raw         pg_loss_type=no_baseline: weight = reward
  centered    reinforce_with_baseline, normalize_by_std=False: weight = reward - group mean
  normalized  reinforce_with_baseline, normalize_by_std=True: (reward - group mean) / (group std + 1e-5)
and normalized_exact: "normalized" trained on the all-or-nothing reward instead. Held-out accuracy is the exact-match
rate of greedy answers. Writes comparison.json/.md/.png into --output_dir (default outputs/grpo_sort).

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

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_sort_cpu.yaml"

SORT_ARMS = {
    "raw": {"trainer": "trl_ext", "pg_loss_type": "no_baseline", "beta": 0.0},
    "centered": {
        "trainer": "trl_ext",
        "pg_loss_type": "reinforce_with_baseline",
        "normalize_by_std": False,
        "beta": 0.0,
    },
    "normalized": {
        "trainer": "trl_ext",
        "pg_loss_type": "reinforce_with_baseline",
        "normalize_by_std": True,
        "advantage_eps": 1e-5,  # the lecture's constant
        "beta": 0.0,
    },
    "normalized_exact": {
        "trainer": "trl_ext",
        "pg_loss_type": "reinforce_with_baseline",
        "normalize_by_std": True,
        "advantage_eps": 1e-5,
        "beta": 0.0,
        "reward_weights": [0.0, 1.0],
    },
}
PANELS = (
    ("rewards/sort_shaped_reward/mean", "shaped reward, train batch (max 2N-1)"),
    ("rewards/sort_exact_reward/mean", "all-or-nothing reward, train batch"),
    ("entropy", "entropy (nats/token)"),
)


@dataclass
class SortArguments(tasks.SortingTaskArguments):
    """The sorting task's options, plus the arms and how often to evaluate them."""

    arms: list[str] = field(
        default_factory=lambda: ["raw", "centered", "normalized", "normalized_exact"],
        metadata={"help": f"Arms: names from {sorted(SORT_ARMS)} or JSON objects (trl_ext.compare.parse_arms)."},
    )
    eval_every: int = field(default=10, metadata={"help": "Held-out evaluation every this many steps (+0, +last)."})


@cli.recipe("grpo_sort", (SortArguments, trl.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, comparison=True)
def main(run, script_args, training_args, model_args, command=None):
    compare, models = trl_ext.compare, trl_ext.models
    with cli.user_input("--arms: "):
        arms = compare.parse_arms(script_args.arms, presets=SORT_ARMS)
    task = tasks.load_task(script_args, max_new_tokens=training_args.max_completion_length, task="sort")
    for arm in arms:  # each arm's own batch sizes
        with cli.user_input(f"--arms {arm.name}: "):
            task.check_fills_one_step(compare.arm_config(training_args, arm), f", arm {arm.name}")
    tokenizer = models.load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    steps = compare.eval_steps(training_args.max_steps, script_args.eval_every)
    results = compare.run_comparison(
        arms,
        training_args,
        lambda: models.load_model_and_tokenizer(model_args),
        task,
        tokenizer,
        steps,
        curve_keys=[key for key, _ in PANELS] + ["reward", "completions/mean_length"],
        warn=run.warn,
    )
    if not PartialState().is_main_process:
        return
    setup = compare.setup_summary(
        training_args,
        model_args,
        steps,
        first={
            "task": task.dataset,
            "train prompts": len(task.train),
            "held-out prompts (accuracy = exact match, greedy)": len(task.test),
            "reward_weights [shaped, exact] (unless the arm sets them)": training_args.reward_weights,
        },
    )
    report.finish_comparison(
        run,
        results,
        setup,
        panels=PANELS,
        command=command,
        title=f"Sorting {script_args.num_numbers} numbers: raw vs centered vs normalized rewards, shaped vs exact",
    )


if __name__ == "__main__":
    cli.main(main)
