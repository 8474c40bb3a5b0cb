"""GRPO on math problems with verifiable rewards: evaluate, train with trl_ext.GRPOTrainer, evaluate again.

    accelerate launch recipes/grpo_math.py                                   # CPU default: embedded model, arithmetic
    accelerate launch recipes/grpo_math.py --config recipes/configs/grpo_math_gsm8k.yaml    # GPU: Qwen2.5-Math, vLLM
    accelerate launch recipes/grpo_math.py --dataset_name data/gsm8k.jsonl --max_steps 2   # any GSM8K/MATH file

Without --config the CPU config recipes/configs/grpo_math_cpu.yaml is used; any flag overrides it. Writes
metrics.json, eval_before.jsonl, eval_after.jsonl and the trained model (or adapter) into --output_dir.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import DistributedType, PartialState
from rich.console import Console
from rich.table import Table

import trl_ext
from trl_ext.recipe_utils import parse_recipe_args
from trl_ext import rewards
from trl_ext.data import load_math_dataset, make_arithmetic_dataset
from trl_ext.eval import evaluate_math
from trl_ext.models import load_model, load_model_and_tokenizer
from trl_ext.profiling import PhaseTimer, StepProfiler, format_breakdown, time_breakdown
from trl_ext.runtime import apply_speed_defaults

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_cpu.yaml"
# reward name -> (TRL reward function for training, course reward_fn for evaluation)
REWARDS = {
    "arithmetic": (rewards.arithmetic_reward, rewards.gsm8k_reward_fn),
    "gsm8k": (rewards.gsm8k_reward, rewards.gsm8k_reward_fn),
    "math": (rewards.math_reward, rewards.math_reward_fn),
    "r1_zero": (rewards.r1_zero_reward, rewards.r1_zero_reward_fn),
}


@dataclass
class MathScriptArguments(trl.ScriptArguments):
    """Data and evaluation options of the recipe; ``dataset_name`` None means generated arithmetic."""

    dataset_kind: str | None = field(
        default=None, metadata={"help": "'gsm8k' or 'math'; inferred from the columns when unset."}
    )
    template: str = field(
        default="chat", metadata={"help": "Prompt template: 'chat' (instruct models), 'r1_zero' or 'question_only'."}
    )
    instruction: str | None = field(
        default="Answer with just the number.", metadata={"help": "Appended to each question; empty for none."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message for 'chat'."})
    reward: str | None = field(
        default=None,
        metadata={"help": f"One of {sorted(REWARDS)}; default: r1_zero for that template, else by dataset kind."},
    )
    num_train_problems: int = field(default=2000, metadata={"help": "Generated arithmetic training problems."})
    arithmetic_digits: int = field(default=2, metadata={"help": "Digits per operand of generated problems."})
    num_eval: int = field(
        default=200,
        metadata={"help": "Held-out problems evaluated (greedy) before and after; a single local file holds out its "
                  "last rows (at most a fifth of it), a hub dataset uses dataset_test_split."},
    )
    eval_batch_size: int = field(default=50, metadata={"help": "Prompts per generate call during evaluation."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Drop malformed dataset rows with a warning."})


def load_data(script_args, tokenizer):
    """Train and held-out splits with ``prompt`` and ``answer`` columns, and the reward name that grades them."""
    common = dict(template=script_args.template, system_prompt=script_args.system_prompt, instruction=script_args.instruction or None)
    if script_args.dataset_name is None:
        gen = dict(digits=script_args.arithmetic_digits, **common)
        train = make_arithmetic_dataset(script_args.num_train_problems, seed=0, split="train", **gen)
        test = make_arithmetic_dataset(script_args.num_eval, seed=1, split="test", **gen)
        kind = "arithmetic"
    else:
        load = dict(kind=script_args.dataset_kind, config_name=script_args.dataset_config, skip_bad_rows=script_args.skip_bad_rows, **common)
        train = load_math_dataset(script_args.dataset_name, split=script_args.dataset_train_split, **load)
        if Path(script_args.dataset_name).is_file():  # one local file: hold out its last rows (at most a fifth)
            held_out = max(1, min(script_args.num_eval, len(train) // 5))
            test, train = train.select(range(len(train) - held_out, len(train))), train.select(range(len(train) - held_out))
        else:
            test = load_math_dataset(script_args.dataset_name, split=script_args.dataset_test_split, max_rows=script_args.num_eval, **load)
        kind = "math" if "problem" in train.column_names else "gsm8k"
    name = script_args.reward or ("r1_zero" if script_args.template == "r1_zero" else kind)
    if name not in REWARDS:
        raise ValueError(f"--reward {name!r} is not supported; expected one of {sorted(REWARDS)}")
    return train, test, name


def main(script_args, training_args, model_args, speed=None):
    wall_start = time.perf_counter()
    timer = PhaseTimer()  # per-phase wall seconds -> metrics.json "time_breakdown"
    state = PartialState()
    console = Console()
    with timer.phase("model_load"):
        model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    train, test, reward_name = load_data(script_args, tokenizer)
    train_reward, eval_reward = REWARDS[reward_name]
    max_new_tokens = training_args.max_completion_length

    def evaluate(m, desc):
        with timer.phase("evaluation"):
            return evaluate_math(m, tokenizer, test, eval_reward, max_new_tokens, script_args.eval_batch_size, desc)

    if model_args.load_in_4bit or model_args.load_in_8bit:
        pass  # bitsandbytes placed the weights already
    elif state.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        model.to(state.device)  # evaluate on the GPU when there is one; sharded engines place the model themselves
    before = evaluate(model, "eval before") if state.is_main_process else None
    trainer = trl_ext.GRPOTrainer(
        model=model, reward_funcs=train_reward, args=training_args, train_dataset=train,
        processing_class=tokenizer, peft_config=peft_config,
    )
    StepProfiler(timer).attach(trainer)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    trainer.save_model(training_args.output_dir)
    if not state.is_main_process:
        return
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        # parameters are sharded across ranks that have returned: evaluate the full checkpoint just saved instead
        trained = load_model(training_args.output_dir, dtype=model_args.dtype).to(state.device)
    else:
        # without accelerate's autocast wrapper: both evaluations run in the model's own dtype (fp32 by default)
        trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    after = evaluate(trained, "eval after")

    out = Path(training_args.output_dir)
    for name, result in (("before", before), ("after", after)):
        with open(out / f"eval_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in result["records"])
    metrics = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "format_rate_before": before["format_rate"],
        "format_rate_after": after["format_rate"],
        "n_eval": after["n"],
        "train_steps": trainer.state.global_step,
        "train_seconds": train_seconds,
        "eval_examples_per_second": after["examples_per_second"],
        "model": model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
        "dataset": script_args.dataset_name or "generated arithmetic",
        "reward": reward_name,
        "runtime": speed or {},
        "time_breakdown": time_breakdown(timer, time.perf_counter() - wall_start),
        "log_history": trainer.state.log_history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))

    table = Table(title=f"GRPO on {metrics['dataset']} ({metrics['n_eval']} held-out problems, greedy)")
    for column in ("", "accuracy", "format rate"):
        table.add_column(column)
    table.add_row("before", f"{before['accuracy']:.1%}", f"{before['format_rate']:.1%}")
    table.add_row("after", f"{after['accuracy']:.1%}", f"{after['format_rate']:.1%}")
    console.print(table)
    console.print(
        f"{metrics['train_steps']} steps in {train_seconds:.0f} s; gain {after['accuracy'] - before['accuracy']:+.1%}. "
        f"Example after: {after['examples'][0]['response']!r} (answer {after['examples'][0]['answer']})"
    )
    speed = metrics["runtime"]
    console.print(
        f"Where the {metrics['time_breakdown']['total']:.0f} s went"
        + (f" ({speed['threads']} threads, {speed['precision']})" if speed else "") + ":\n"
        + format_breakdown(metrics["time_breakdown"])
    )
    console.print(f"Wrote {out / 'metrics.json'} and the trained model to {out}")


if __name__ == "__main__":
    args = parse_recipe_args((MathScriptArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG)
    main(*args, speed=apply_speed_defaults(args[1], default_config=DEFAULT_CONFIG))
