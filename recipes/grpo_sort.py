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

import shlex
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trl
from accelerate import PartialState

from trl_ext.recipe_utils import (
    COMPARISON_HELP,
    RecipeArguments,
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
from trl_ext.compare import arm_config, parse_arms, run_comparison, write_comparison
from trl_ext.data.sorting import SORT_INSTRUCTION, make_sorting_dataset
from trl_ext.eval import evaluate_math
from trl_ext.models import DEFAULT_MODEL, load_model_and_tokenizer, load_tokenizer
from trl_ext.rewards import sort_exact_reward, sort_shaped_reward, sort_shaped_reward_fn
from trl_ext.experiment import write_recipe_record

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_sort_cpu.yaml"

SORT_ARMS = {
    "raw": {"trainer": "trl_ext", "pg_loss_type": "no_baseline", "beta": 0.0},
    "centered": {"trainer": "trl_ext", "pg_loss_type": "reinforce_with_baseline", "normalize_by_std": False, "beta": 0.0},
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
class SortArguments(RecipeArguments):
    """Task, evaluation and arm options."""

    num_numbers: int = field(default=3, metadata={"help": "N, numbers per prompt."})
    max_number: int = field(default=99, metadata={"help": "Numbers are drawn from 0..max_number (distinct)."})
    num_train_problems: int = field(default=1000, metadata={"help": "Training prompts."})
    num_eval: int = field(default=50, metadata={"help": "Held-out prompts evaluated greedily."})
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    instruction: str = field(default=SORT_INSTRUCTION, metadata={"help": "Appended to each question."})
    arms: list[str] = field(
        default_factory=lambda: ["raw", "centered", "normalized", "normalized_exact"],
        metadata={"help": f"Arms: names from {sorted(SORT_ARMS)} or JSON objects (trl_ext.compare.parse_arms)."},
    )
    eval_every: int = field(default=10, metadata={"help": "Held-out evaluation every this many steps (+0, +last)."})


def main(script_args, training_args, model_args, command=None):
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    refuse_comparison_resume(training_args)
    run = RecipeRun("grpo_sort", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir,
                    result_file="comparison.json")
    check_model_options(model_args)
    if training_args.max_steps <= 0:
        raise RecipeError(f"--max_steps {training_args.max_steps}: a comparison needs a fixed step budget (>= 1)")
    with user_input("--arms: "):
        arms = parse_arms(script_args.arms, presets=SORT_ARMS)
    state = PartialState()
    data = dict(num_numbers=script_args.num_numbers, high=script_args.max_number, instruction=script_args.instruction)
    train = make_sorting_dataset(script_args.num_train_problems, seed=0, split="train", **data)
    test = make_sorting_dataset(script_args.num_eval, seed=1, split="test", **data)
    for arm in arms:  # each arm's own batch sizes
        with user_input(f"--arms {arm.name}: "):
            config = arm_config(training_args, arm)
        check_fills_one_step(len(train), config, f"--num_train_problems {script_args.num_train_problems}, arm {arm.name}", "prompts")
    tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    eval_fn = partial(
        evaluate_math,
        tokenizer=tokenizer,
        dataset=test,
        reward_fn=sort_shaped_reward_fn,
        max_new_tokens=training_args.max_completion_length,
        batch_size=script_args.eval_batch_size,
        disable_progress=True,
    )
    steps = training_args.max_steps
    eval_steps = sorted({0, steps, *range(script_args.eval_every, steps, script_args.eval_every)})
    curve_keys = [key for key, _ in PANELS] + ["reward", "completions/mean_length"]
    results = run_comparison(
        arms,
        training_args,
        lambda: load_model_and_tokenizer(model_args),
        train,
        [sort_shaped_reward, sort_exact_reward],
        eval_fn,
        eval_steps,
        curve_keys=curve_keys,
    )
    if not state.is_main_process:
        return
    setup = {
        "model": model_args.model_name_or_path or DEFAULT_MODEL,
        "task": f"sort {script_args.num_numbers} distinct numbers from 0..{script_args.max_number}",
        "train prompts": len(train),
        "held-out prompts (accuracy = exact match, greedy)": len(test),
        "steps per arm": steps,
        "held-out evaluation at steps": eval_steps,
        "completions per step": training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps,
        "num_generations": training_args.num_generations,
        "reward_weights [shaped, exact] (unless the arm sets them)": training_args.reward_weights,
        "learning_rate": training_args.learning_rate,
        "seed": training_args.seed,
    }
    paths = write_comparison(
        results,
        training_args.output_dir,
        setup,
        title=f"Sorting {script_args.num_numbers} numbers: raw vs centered vs normalized rewards, shaped vs exact",
        panels=PANELS,
        command=command,
    )
    add_provenance(paths["json"], run)
    write_recipe_record(training_args.output_dir, "Sorting experiment", script_args, training_args, model_args, command=command)
    print(Path(paths["md"]).read_text())
    print(f"Wrote {', '.join(str(p) for p in paths.values())}")


def parse_args(argv=None):
    return parse_recipe_args((SortArguments, trl.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__, COMPARISON_HELP)


if __name__ == "__main__":
    command = ("uv run accelerate launch recipes/grpo_sort.py " + shlex.join(sys.argv[1:])).strip()
    recipe_main(main, parse_args, command=command)
