"""GRPO on math problems with verifiable rewards: evaluate, train with trl_ext.GRPOTrainer, evaluate again.

    uv run python recipes/grpo_math.py                            # CPU default: embedded model, arithmetic
    uv run --extra gpu accelerate launch recipes/grpo_math.py --config recipes/configs/grpo_math_gsm8k.yaml    # GPU: Qwen2.5-Math, vLLM
    uv run python recipes/grpo_math.py --dataset_name data/gsm8k.jsonl --max_steps 2   # any GSM8K/MATH file

Options: recipes/configs/grpo_math_cpu.yaml holds the recipe's defaults; a --config file is layered over them (it
replaces only what it sets) and flags override both. Data, options and --output_dir are checked before the model is
loaded. Writes metrics.json (results, command, resolved configs, versions, phase times), eval_before.jsonl and
eval_after.jsonl (every held-out problem, response and extracted answer), training_curves.png, TensorBoard logs,
checkpoints and the trained model (or adapter) with its model card into --output_dir.

Stopping and resuming: Ctrl-C stops at once and prints the resume command; --resume_from_checkpoint true continues
from the latest checkpoint in --output_dir and reuses the saved before-evaluation. A folder holding a finished run
is never overwritten unless --overwrite_output_dir is given.
"""

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import DistributedType, PartialState
from rich.console import Console
from rich.table import Table

import trl_ext
from trl_ext import rewards
from trl_ext.recipe_utils import (
    RecipeArguments,
    RecipeError,
    RecipeRun,
    check_fills_one_step,
    check_model_options,
    parse_recipe_args,
    plot_curves,
    recipe_main,
    user_input,
    write_model_card,
)
from trl_ext.data import load_math_dataset, make_arithmetic_dataset
from trl_ext.eval import evaluate_math
from trl_ext.models import load_model, load_model_and_tokenizer
from trl_ext.experiment import write_recipe_record
from trl_ext.profiling import PhaseTimer, StepProfiler, format_breakdown, time_breakdown
from trl_ext.runtime import name_loaded_weights

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_cpu.yaml"
# reward name -> (TRL reward function for training, course reward_fn for evaluation)
REWARDS = {
    "arithmetic": (rewards.arithmetic_reward, rewards.gsm8k_reward_fn),
    "gsm8k": (rewards.gsm8k_reward, rewards.gsm8k_reward_fn),
    "math": (rewards.math_reward, rewards.math_reward_fn),
    "r1_zero": (rewards.r1_zero_reward, rewards.r1_zero_reward_fn),
}
# reward name -> the answer its grader reads from a response (recorded as "extracted" in eval_*.jsonl)
EXTRACTORS = {
    "arithmetic": rewards.extract_last_number,
    "gsm8k": rewards.extract_last_number,
    "math": rewards.extract_math_answer,
    "r1_zero": lambda response: rewards.extract_math_answer(response) if "</think> <answer>" in response else None,
}
PANELS = (
    ("reward", "reward (train batch)"),
    ("eval_accuracy", "held-out accuracy (greedy)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
)


@dataclass
class MathScriptArguments(trl.ScriptArguments, RecipeArguments):
    """Data and evaluation options of the recipe; ``dataset_name`` None means generated arithmetic."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A local .jsonl/.json/.parquet file (GSM8K columns question/answer, MATH columns "
                  "problem/solution or answer) or a Hugging Face Hub dataset id; unset = generated arithmetic."},
    )
    dataset_kind: str | None = field(
        default=None,
        metadata={"help": "'gsm8k', 'math' or 'arithmetic' (question + integer answer); inferred from the columns "
                  "when unset."},
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


def load_data(script_args, tokenizer=None):
    """Train and held-out splits with ``prompt`` and ``answer`` columns, and the reward name that grades them.

    ``--dataset_name`` unset: generated arithmetic. A local .jsonl/.json/.parquet file: its last rows are held out
    (at most a fifth). Anything else: a hub dataset, held out = ``--dataset_test_split``. ``tokenizer`` is unused
    (kept for callers that pass it). Raises RecipeError for an unknown ``--reward`` before reading any data.
    """
    if script_args.reward is not None and script_args.reward not in REWARDS:
        raise RecipeError(f"--reward {script_args.reward!r} is not supported; expected one of {sorted(REWARDS)}")
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
            if len(train) < 2:
                raise RecipeError(f"--dataset_name {script_args.dataset_name}: {len(train)} usable row(s); need at "
                                  "least 2 (training rows plus held-out rows)")
            held_out = max(1, min(script_args.num_eval, len(train) // 5))
            test, train = train.select(range(len(train) - held_out, len(train))), train.select(range(len(train) - held_out))
        else:
            test = load_math_dataset(script_args.dataset_name, split=script_args.dataset_test_split, max_rows=script_args.num_eval, **load)
        kind = "math" if "problem" in train.column_names else "gsm8k"
    name = script_args.reward or ("r1_zero" if script_args.template == "r1_zero" else kind)
    return train, test, name


def train_source(script_args, test) -> str:
    """Where the training prompts come from, in the user's flags (for messages)."""
    if script_args.dataset_name is None:
        return f"--num_train_problems {script_args.num_train_problems}"
    if Path(script_args.dataset_name).is_file():
        held_out = f"{len(test)} row{'s' if len(test) != 1 else ''}"
        return f"--dataset_name {script_args.dataset_name} (its last {held_out} held out for evaluation)"
    return f"--dataset_name {script_args.dataset_name} (split {script_args.dataset_train_split})"


def main(script_args, training_args, model_args, speed=None):
    # everything that can be checked without the model comes first: folder, checkpoint, options, data
    wall_start = time.perf_counter()
    timer = PhaseTimer()  # per-phase wall seconds of the whole job -> metrics.json "time_breakdown"
    run = RecipeRun(
        "grpo_math", training_args.output_dir,
        {"script_args": script_args, "training_args": training_args, "model_args": model_args},
        overwrite=script_args.overwrite_output_dir, resume=training_args.resume_from_checkpoint,
    )
    check_model_options(model_args)
    with run.phase("load_data"), user_input("--dataset_name: " if script_args.dataset_name else ""):
        train, test, reward_name = load_data(script_args)
    check_fills_one_step(len(train), training_args, train_source(script_args, test), "prompts")
    train_reward, eval_reward = REWARDS[reward_name]
    model_name = model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct"

    state = PartialState()
    console = Console(soft_wrap=True)
    with run.phase("load_model"), timer.phase("model_load"):
        model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    if speed:  # --dtype auto: the checkpoint's own dtype, known now
        speed["precision"] = name_loaded_weights(speed["precision"], training_args, model_args.dtype, model)
    max_new_tokens = training_args.max_completion_length

    def evaluate(m, desc):
        with timer.phase("evaluation"):
            return evaluate_math(
                m, tokenizer, test, eval_reward, max_new_tokens, script_args.eval_batch_size, desc,
                extract_fn=EXTRACTORS[reward_name],
            )

    if model_args.load_in_4bit or model_args.load_in_8bit:
        pass  # bitsandbytes placed the weights already
    elif state.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        model.to(state.device)  # evaluate on the GPU when there is one; sharded engines place the model themselves
    before = None
    if state.is_main_process:
        # a resumed run reuses the before-evaluation its first run saved (eval_before.json), if it was of the
        # same model, held-out rows, budget and reward
        held_out = hashlib.sha256(json.dumps([test["prompt"], test["answer"]], default=str).encode()).hexdigest()
        key = {"model": model_name, "held_out_sha256": held_out, "max_new_tokens": max_new_tokens, "reward": reward_name,
               "template": script_args.template}
        with run.phase("eval_before"):
            before = run.reuse_or_compute("eval_before", key, lambda: evaluate(model, "eval before"))
    trainer = trl_ext.GRPOTrainer(
        model=model, reward_funcs=train_reward, args=training_args, train_dataset=train,
        processing_class=tokenizer, peft_config=peft_config,
    )
    run.attach(trainer, first_logs={"eval_accuracy": before["accuracy"], "eval_format_rate": before["format_rate"]} if before else None)
    StepProfiler(timer).attach(trainer)
    with run.phase("train"):
        trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    with run.phase("save"):
        trainer.save_model(training_args.output_dir)
    if not state.is_main_process:
        return
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        # parameters are sharded across ranks that have returned: evaluate the full checkpoint just saved instead
        trained = load_model(training_args.output_dir, dtype=model_args.dtype).to(state.device)
    else:
        # without accelerate's autocast wrapper: both evaluations run in the model's own dtype (fp32 by default)
        trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    with run.phase("eval_after"):
        after = evaluate(trained, "eval after")
    run.log_after_training(trainer, {"eval_accuracy": after["accuracy"], "eval_format_rate": after["format_rate"]})

    out = Path(training_args.output_dir)
    for name, result in (("before", before), ("after", after)):
        with open(out / f"eval_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in result["records"])
    dataset = script_args.dataset_name or "generated arithmetic"
    write_model_card(trainer, out, model_args.model_name_or_path, dataset)
    steps = trainer.state.global_step
    plot = plot_curves(
        trainer.state.log_history, PANELS, out / "training_curves.png",
        points={"eval_accuracy": [(0, before["accuracy"]), (steps, after["accuracy"])]},
    )
    metrics = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "format_rate_before": before["format_rate"],
        "format_rate_after": after["format_rate"],
        "n_eval": after["n"],
        "train_steps": steps,
        "train_seconds": run.phase_seconds["train"],
        "eval_examples_per_second": after["examples_per_second"],
        "model": model_name,
        "dataset": dataset,
        "reward": reward_name,
        "runtime": {**(speed or {}), "processes": state.num_processes,
                    "distributed_type": str(trainer.accelerator.distributed_type)},  # FSDP shows here, not in PartialState
        "time_breakdown": time_breakdown(timer, time.perf_counter() - wall_start),
        "log_history": trainer.state.log_history,
    }
    run.write_metrics(metrics)

    n = metrics["n_eval"]
    table = Table(title=f"GRPO on {dataset} ({n} held-out problem{'s' if n != 1 else ''}, greedy)")
    for column in ("", "accuracy", "format rate"):
        table.add_column(column)
    table.add_row("before", f"{before['accuracy']:.1%}", f"{before['format_rate']:.1%}")
    table.add_row("after", f"{after['accuracy']:.1%}", f"{after['format_rate']:.1%}")
    console.print(table)
    console.print(
        f"{run.steps_summary(steps, metrics['train_seconds'])}; gain {after['accuracy'] - before['accuracy']:+.1%}. "
        f"Example after: {after['examples'][0]['response']!r} (answer {after['examples'][0]['answer']})",
        markup=False,
    )
    if "eval_before" in run.reused:
        console.print("(before-evaluation reused from the first run of this folder: eval_before.json)")
    speed = metrics["runtime"]
    console.print(
        f"Where the {metrics['time_breakdown']['total']:.0f} s went"
        + (f" ({speed['threads']} threads, {speed['precision']})" if "threads" in speed else "") + ":\n"
        + format_breakdown(metrics["time_breakdown"]),
        markup=False,
    )
    write_recipe_record(out, "GRPO on math problems", script_args, training_args, model_args)
    console.print(f"Wrote {out / 'metrics.json'}, {plot.name if plot else 'no plot'} and the trained model to {out}", markup=False)


def parse_args(argv=None):
    return parse_recipe_args((MathScriptArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__)


if __name__ == "__main__":
    recipe_main(main, parse_args, speed_defaults=DEFAULT_CONFIG)
