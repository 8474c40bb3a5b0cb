"""Upstream trl.GRPOTrainer next to trl_ext.GRPOTrainer settings: same model, data, seed, prompts and step budget.

    uv run python recipes/compare_upstream.py   # CPU default: embedded SmolLM2, 2-digit addition, 3 arms
    uv run --extra gpu accelerate launch recipes/compare_upstream.py --config recipes/configs/compare_upstream_gsm8k.yaml    # GPU
    uv run python recipes/compare_upstream.py --arms trl course kl_k3 --max_steps 40 --eval_every 20

Without --config the CPU config recipes/configs/compare_upstream_cpu.yaml is used; any flag overrides it. Arms are
preset names (trl_ext.compare.ARM_PRESETS: trl, course, no_std, masked_normalize, dr_grpo, kl_k3) or mappings
(YAML) / JSON objects (command line) such as '{"name": "lr_high", "preset": "course", "learning_rate": 5e-5}'.
Writes comparison.json, comparison.md and comparison.png into --output_dir, and each arm's tensorboard logs into
--output_dir/<arm> (`tensorboard --logdir <output_dir>` shows the arms side by side).

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
from grpo_math import (  # the math recipe's data options and loaders
    REWARDS,
    MathScriptArguments,
    load_data,
    train_source,
)

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
from trl_ext.compare import arm_config, parse_arms, run_comparison, write_comparison
from trl_ext.eval import evaluate_math
from trl_ext.models import DEFAULT_MODEL, load_model_and_tokenizer, load_tokenizer
from trl_ext.experiment import write_recipe_record

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "compare_upstream_cpu.yaml"


@dataclass
class CompareArguments(MathScriptArguments):
    """The math recipe's data options, plus the arms and how often to evaluate them."""

    arms: list[str] = field(
        default_factory=lambda: ["trl", "course", "dr_grpo"],
        metadata={"help": "Arms, run in this order: preset names or JSON objects (see trl_ext.compare.parse_arms)."},
    )
    eval_every: int = field(
        default=10, metadata={"help": "Held-out greedy evaluation every this many steps, plus step 0 and the last."}
    )


def main(script_args, training_args, model_args, command=None, speed=None):
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    refuse_comparison_resume(training_args)
    run = RecipeRun("compare_upstream", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir,
                    result_file="comparison.json")
    check_model_options(model_args)
    if training_args.max_steps <= 0:
        raise RecipeError(f"--max_steps {training_args.max_steps}: a comparison needs a fixed step budget (>= 1)")
    with user_input("--arms: "):
        arms = parse_arms(script_args.arms)
    with run.phase("load_data"), user_input("--dataset_name: " if script_args.dataset_name else ""):
        train, test, reward_name = load_data(script_args)
    for arm in arms:  # each arm's own batch sizes
        with user_input(f"--arms {arm.name}: "):
            config = arm_config(training_args, arm)
        check_fills_one_step(len(train), config, f"{train_source(script_args, test)}, arm {arm.name}", "prompts")
    state = PartialState()
    tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    train_reward, eval_reward = REWARDS[reward_name]
    eval_fn = partial(
        evaluate_math,
        tokenizer=tokenizer,
        dataset=test,
        reward_fn=eval_reward,
        max_new_tokens=training_args.max_completion_length,
        batch_size=script_args.eval_batch_size,
        disable_progress=True,
    )
    steps = training_args.max_steps
    eval_steps = sorted({0, steps, *range(script_args.eval_every, steps, script_args.eval_every)})

    results = run_comparison(
        arms, training_args, lambda: load_model_and_tokenizer(model_args), train, train_reward, eval_fn, eval_steps
    )
    if not state.is_main_process:
        return
    setup = {
        "model": model_args.model_name_or_path or DEFAULT_MODEL,
        "dataset": script_args.dataset_name or f"generated {script_args.arithmetic_digits}-digit addition",
        "reward": reward_name,
        "train prompts": len(train),
        "held-out problems": len(test),
        "steps per arm": steps,
        "held-out evaluation at steps": eval_steps,
        "completions per step": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * state.num_processes,
        "num_generations": training_args.num_generations,
        "max_completion_length": training_args.max_completion_length,
        "learning_rate": training_args.learning_rate,
        "temperature": training_args.temperature,
        "seed": training_args.seed,
        "device": str(state.device) + (f" x {state.num_processes}" if state.num_processes > 1 else ""),
        # the same for every arm: threads and precision are set once, before the arms' configs are derived
        **({"threads": speed["threads"], "precision": speed["precision"]} if speed else {}),
    }
    paths = write_comparison(
        results, training_args.output_dir, setup, title="GRPO: upstream TRL vs trl_ext settings", command=command
    )
    add_provenance(paths["json"], run)
    write_recipe_record(training_args.output_dir, "Upstream TRL vs trl_ext", script_args, training_args, model_args, command=command)
    print((Path(paths["md"])).read_text())
    print(f"Wrote {', '.join(str(p) for p in paths.values())}")


def parse_args(argv=None):
    return parse_recipe_args((CompareArguments, trl.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__, COMPARISON_HELP)


if __name__ == "__main__":
    command = ("uv run accelerate launch recipes/compare_upstream.py " + shlex.join(sys.argv[1:])).strip()
    # threads and precision are set once, before the arms' configs are derived, so every arm runs on the same ones
    recipe_main(main, parse_args, speed_defaults=DEFAULT_CONFIG, command=command)
