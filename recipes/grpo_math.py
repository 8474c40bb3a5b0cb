"""GRPO on math problems with verifiable rewards: evaluate, train with trl_ext.GRPOTrainer, evaluate again.

    uv run python recipes/grpo_math.py                            # CPU default: embedded model, arithmetic
    uv run --extra gpu accelerate launch --config_file accelerate_configs/single_process.yaml recipes/grpo_math.py \
        --config recipes/configs/grpo_math_gsm8k.yaml             # GPU: Qwen2.5-Math, vLLM
    uv run python recipes/grpo_math.py --dataset_name data/gsm8k.jsonl --max_steps 2   # any GSM8K/MATH file

Options: recipes/configs/grpo_math_cpu.yaml holds the recipe's defaults; a --config file is layered over them (it
replaces only what it sets) and flags override both. Data, options and --output_dir are checked before the model is
loaded. Writes metrics.json (results, command, resolved configs, versions, phase times, the held-out curve
eval_curve), eval_before.jsonl (before training) and eval_after.jsonl (every held-out problem, response and
extracted answer), rollouts.jsonl (--rollout_samples of each step's rollouts with their scores),
training_curves.png, TensorBoard logs, checkpoints and the trained model (or adapter) with its model card into
--output_dir. --eval_every N also evaluates the held-out rows every N steps during training.

Stopping and resuming: Ctrl-C stops at once and prints the resume command; --resume_from_checkpoint true continues
from the latest checkpoint in --output_dir and reuses the saved before-evaluation. A folder holding a finished run
is never overwritten unless --overwrite_output_dir is given.
"""

from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import DistributedType, PartialState

import trl_ext
from trl_ext import cli, report, tasks

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_math_cpu.yaml"
PANELS = (
    ("reward", "reward (train batch)"),
    ("eval_accuracy", "held-out accuracy (greedy)"),
    ("eval_format_rate", "held-out format rate (greedy)"),
    ("entropy", "entropy (nats/token)"),
    ("completions/mean_length", "completion length (tokens)"),
)


@dataclass
class GRPOMathArguments(tasks.TaskArguments):
    """The task's options (--task, --task_config, data), plus held-out evaluation during training and the rollout
    samples."""

    eval_every: int | None = field(
        default=None,
        metadata={
            "help": "Also evaluate the held-out rows (greedy) after every this many optimizer steps, logged as "
            "eval_accuracy/eval_format_rate at that step (TensorBoard eval/accuracy, metrics.json's eval_curve, "
            "training_curves.png). Unset: before and after training only (each evaluation costs a held-out pass)."
        },
    )
    rollout_samples: int = field(
        default=4,
        metadata={
            "help": "Rollouts of each step written to rollouts.jsonl in --output_dir (step, prompt, response, "
            "reward, format_reward, answer_reward, answer, advantage); 0 for none."
        },
    )


@cli.recipe("grpo_math", (GRPOMathArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG)
def main(run, script_args, training_args, model_args, speed=None):
    # the decorator checked the folder, the checkpoint and the model's options; then the data, before the model loads
    with run.phase("load_data"):
        task = tasks.load_task(script_args, max_new_tokens=training_args.max_completion_length)
    task.check_fills_one_step(training_args)
    model_name = model_args.model_name_or_path or trl_ext.models.DEFAULT_MODEL
    state = PartialState()
    with run.phase("load_model", breakdown="model_load"):
        model, tokenizer, peft_config = trl_ext.models.load_model_and_tokenizer(model_args)
    run.watch(model)  # count every forward's work by phase: the roofline report in metrics.json
    trl_ext.runtime.note_loaded_weights(speed, training_args, model_args.dtype, model)  # --dtype auto: known now
    sharded = state.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if not (model_args.load_in_4bit or model_args.load_in_8bit or sharded):
        model.to(state.device)  # evaluate on the GPU when there is one; bitsandbytes and sharded engines place it
    before = None
    if state.is_main_process:  # a resumed run reuses the before-evaluation of the same model, rows, budget, reward
        with run.phase("eval_before", breakdown="evaluation"):
            before = run.reuse_or_compute(  # eval_before.jsonl now: what the warning below points at
                "eval_before",
                {"model": model_name, **task.fingerprint()},
                lambda: task.evaluate(model, tokenizer, "eval before", jsonl_path=run.output_dir / "eval_before.jsonl"),
            )
        run.warn(tasks.nothing_to_learn(before, task.reward_keys))  # no reward varies: nothing for GRPO to learn
    trainer = trl_ext.GRPOTrainer(  # model, reward functions, config, training rows
        model, task.reward_funcs, training_args, task.train, processing_class=tokenizer, peft_config=peft_config
    )
    run.attach(  # held-out accuracy at step 0 (and every --eval_every steps) in TensorBoard; rollouts.jsonl
        trainer,
        report.held_out_logs(before) if before else None,
        evaluate=lambda policy: task.evaluate(policy, tokenizer, progress=False),
        eval_every=script_args.eval_every,
        rollouts=script_args.rollout_samples,
    )
    run.profile(trainer)
    with run.phase("train"):
        trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    with run.phase("save"):
        trainer.save_model(training_args.output_dir)
    if not state.is_main_process:
        return
    if sharded:  # parameters are sharded across ranks that have returned: evaluate the full checkpoint just saved
        trained = trl_ext.models.load_model(training_args.output_dir, dtype=model_args.dtype).to(state.device)
    else:  # without accelerate's autocast wrapper: both evaluations run in the model's own dtype (fp32 by default)
        trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    with run.phase("eval_after", breakdown="evaluation"):
        after = task.evaluate(trained, tokenizer, "eval after")
    run.log_after_training(trainer, report.held_out_logs(after))
    steps, gain, example = trainer.state.global_step, after["accuracy"] - before["accuracy"], after["examples"][0]
    report.finish(
        run,
        {**report.held_out_metrics(before, after), "model": model_name, "dataset": task.dataset, "reward": task.name},
        [
            report.Record("GRPO on math problems"),
            report.accuracy_table(f"GRPO on {task.dataset}", before, after),
            report.ConsoleLines(
                f"{run.steps_summary(steps)}; gain {gain:+.1%}. "
                f"Example after: {example['response']!r} (answer {example['answer']})"
            ),
            report.ModelCard(model_args.model_name_or_path, task.dataset),
            report.Records({"eval_after": after["records"]}),  # eval_before.jsonl was written before training
            report.Curves("training_curves.png", PANELS),  # the held-out points of log_history marked
        ],
        trainer=trainer,
        speed=speed,
    )


if __name__ == "__main__":
    cli.main(main)
