"""Expert iteration (CS336 A5 handout, Algorithm 2): sample, keep the correct outputs, SFT on them, repeat.

    uv run python recipes/expert_iteration.py                                # CPU default: embedded model, arithmetic
    uv run python recipes/expert_iteration.py --n_ei_steps 5 --num_generations 4 --sft_epochs 2
    uv run --extra gpu accelerate launch --config_file accelerate_configs/single_process.yaml \\
        recipes/expert_iteration.py --config recipes/configs/expert_iteration_math.yaml   # GPU: Qwen2.5-Math-1.5B, vLLM

For each of --n_ei_steps: sample --ei_batch_size training questions, generate --num_generations (G) outputs per
question from the current policy, keep those whose reward is 1, and fine-tune on them with trl_ext.SFTTrainer
(completion-only, gradient clipping max_grad_norm, --sft_epochs epochs). No hand-written generation or training:
rollouts come from trl_ext.GRPOTrainer.sample (GRPO's own generation path: transformers `generate`, or vLLM with
--use_vllm), the SFT is a TRL trainer. Held-out greedy accuracy is measured before training and after every EI step,
and the mean token entropy of each step's sampled responses under the policy that sampled them
(trl_ext.objective.course.mean_response_entropy).

Writes metrics.json (accuracy_before, accuracy_after, n_eval, ei_steps: per step generated/kept samples, held-out
accuracy, response entropy; plus the command, resolved configs, library versions and phase times), ei_curves.png,
experiment.md and the final model into --output_dir.

Options: recipes/configs/expert_iteration_cpu.yaml holds the recipe's defaults; a --config file is layered over them
(it replaces only what it sets) and flags (every trl_ext.SFTConfig option too) override both. Options, data and
--output_dir are checked before the model is loaded; a folder holding a finished run (metrics.json) is not
overwritten unless --overwrite_output_dir. Expert iteration cannot be resumed: the loop keeps no checkpoints (each
EI step's SFT is a fresh trainer and the sampled questions depend on the whole run so far), so
--resume_from_checkpoint is refused; Ctrl-C stops at once.
"""

import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import trl
from accelerate import PartialState
from datasets import Dataset

import trl_ext
from trl_ext import cli, report, tasks

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "expert_iteration_cpu.yaml"
HELP = {  # inherited trl_ext.SFTConfig options this recipe treats its own way
    "resume_from_checkpoint": "Refused: expert iteration keeps no checkpoints (each EI step's SFT is a fresh trainer), "
    "so it cannot be resumed.",
    "max_steps": "Refused (leave it unset): the SFT of each EI step runs --sft_epochs epochs over its kept samples.",
    "num_train_epochs": "Not read: set from --sft_epochs.",
}
NOT_RESUMABLE = (
    "expert iteration keeps no checkpoints (each EI step's SFT is a fresh trainer and the questions it "
    "samples depend on the whole run so far)",
    "run",
)
PANELS = (
    ("accuracy", "held-out accuracy after EI step (greedy)"),
    ("entropy", "response entropy per EI step (nats/token)"),
)


@dataclass
class EIArguments(tasks.TaskArguments):
    """The task's options (--task, --task_config, data) plus the expert-iteration loop and its sampling."""

    n_ei_steps: int = field(default=3, metadata={"help": "Expert-iteration steps (sample, filter, SFT)."})
    num_generations: int = field(default=8, metadata={"help": "G: outputs sampled per question."})
    ei_batch_size: int = field(default=16, metadata={"help": "Questions sampled (without replacement) per EI step."})
    sft_epochs: int = field(
        default=1, metadata={"help": "SFT epochs over each step's kept outputs (sets num_train_epochs)."}
    )
    max_completion_length: int = field(
        default=20, metadata={"help": "Token budget of each sampled output (and of evaluation)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the rollouts."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of the rollouts (1.0 = off)."})
    use_vllm: bool = field(
        default=False, metadata={"help": "Sample with vLLM (GPU extra), as trl_ext.GRPOTrainer does."}
    )
    vllm_mode: str = field(default="colocate", metadata={"help": "'colocate' or 'server', as in trl.GRPOConfig."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM memory share in colocate mode."})
    entropy_batch_size: int = field(default=32, metadata={"help": "Sequences per forward pass when measuring entropy."})

    def __post_init__(self):
        for name in (
            "n_ei_steps",
            "num_generations",
            "ei_batch_size",
            "sft_epochs",
            "max_completion_length",
            "entropy_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}; expected an integer >= 1")
        if self.temperature <= 0:
            raise ValueError(f"--temperature={self.temperature}; expected > 0 (expert iteration samples)")


def make_sampler(model, tokenizer, task, script_args, training_args):
    """A trl_ext.GRPOTrainer used only for ``sample``, so rollouts take GRPO's generation path (train mode: groups of
    num_generations)."""
    args = trl_ext.GRPOConfig(
        output_dir=str(Path(training_args.output_dir) / "sampler"),
        report_to="none",
        use_cpu=training_args.use_cpu,
        bf16=training_args.bf16,
        seed=training_args.seed,
        per_device_train_batch_size=script_args.num_generations,
        num_generations=script_args.num_generations,
        max_completion_length=script_args.max_completion_length,
        temperature=script_args.temperature,
        top_p=script_args.top_p,
        use_vllm=script_args.use_vllm,
        vllm_mode=script_args.vllm_mode,
        vllm_gpu_memory_utilization=script_args.vllm_gpu_memory_utilization,
        activation_checkpointing=False,
        save_strategy="no",
        log_completions=False,
    )
    sampler = trl_ext.GRPOTrainer(
        model=model, reward_funcs=task.reward_funcs, args=args, train_dataset=task.train, processing_class=tokenizer
    )
    sampler.model.train()
    return sampler


def sft(run, model, tokenizer, prompts, responses, training_args, step):
    """Fine-tune ``model`` on one EI step's kept (prompt, response) pairs with a fresh trl_ext.SFTTrainer (writing into
    --output_dir/sft_step{step}); returns the step's SFT fields and the trainer's log, each entry tagged with the
    step."""
    conversational = not isinstance(prompts[0], str)
    completions = [[{"role": "assistant", "content": r}] if conversational else r for r in responses]
    args = copy.copy(training_args)
    args.output_dir, args.logging_dir = str(Path(training_args.output_dir) / f"sft_step{step}"), None
    data = Dataset.from_dict({"prompt": prompts, "completion": completions})
    t0 = time.perf_counter()
    # the trainer's set-up (tokenizing the kept samples) and what train() does outside the profiled phases
    with run.phase("sft", breakdown="sft"):
        trainer = trl_ext.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        run.attach(trainer)  # logs the last step; a Ctrl-C during a checkpoint write waits for it to complete
        run.profile(trainer)  # its backward, optimizer and other train() seconds: the roofline's rows
        result = trainer.train()
    fields = {
        "sft_loss": result.training_loss,
        "sft_steps": result.global_step,
        "sft_seconds": time.perf_counter() - t0,
    }
    return fields, [{**e, "ei_step": step} for e in trainer.state.log_history]


def summary(before, steps, seconds, cpu_seconds):
    """What the report says of the EI steps, as report.finish outputs: experiment.md (its results, first step / before
    vs last step / after, and observations) and the closing console line."""
    se = lambda p: trl_ext.compare.monitoring.binomial_standard_error(p, before["n"])  # noqa: E731
    first, last = steps[0], steps[-1]
    rows = [
        (
            "held-out accuracy",
            f"{before['accuracy']:.1%} ± {100 * se(before['accuracy']):.1f}",
            f"{last['accuracy']:.1%} ± {100 * se(last['accuracy']):.1f}",
        ),
        (
            "kept samples (first -> last EI step)",
            f"{first['kept']}/{first['generated']}",
            f"{last['kept']}/{last['generated']}",
        ),
        ("response entropy (nats/token)", f"{first['entropy']:.3f}", f"{last['entropy']:.3f}"),
        ("wall time (EI loop, s)", "", f"{seconds:.0f}"),
        ("CPU time (EI loop, s; all threads)", "", f"{cpu_seconds:.0f}"),
    ]
    h0, h1 = first["entropy"], last["entropy"]
    observations = [
        f"Held-out accuracy per EI step: {', '.join(format(s['accuracy'], '.1%') for s in steps)} (n = {before['n']}).",
        f"Kept fraction per EI step: {', '.join(format(s['kept'] / s['generated'], '.0%') for s in steps)}.",
        f"Response entropy {'fell' if h1 < h0 else 'did not fall'} from {h0:.3f} to {h1:.3f} nats/token"
        + (" (collapsed)." if trl_ext.measurement.observations.entropy_collapsed(h0, h1) else "."),
    ]
    line = (
        f"Expert iteration: held-out accuracy {before['accuracy']:.1%} -> {last['accuracy']:.1%} ({before['n']} "
        "problems) "
        f"in {seconds:.0f} s"
    )
    return [
        report.Record("Expert iteration", (("", "first / before", "last / after"), rows), observations),
        report.ConsoleLines(line),
    ]


def check_options(script_args, training_args, model_args, train_rows: int) -> None:
    """What expert iteration refuses before the model loads: several processes, LoRA, --max_steps; more questions
    than the training split holds (they are drawn without replacement across the whole run); an EI step's SFT set
    that could not fill one optimizer step even if every sample were kept."""
    if PartialState().num_processes > 1:
        raise cli.RecipeError(
            "expert_iteration.py runs in one process (its SFT batches are small); launch without multi-process "
            "accelerate"
        )
    if model_args.use_peft:
        raise cli.RecipeError(
            "--use_peft is not supported by expert_iteration.py yet (each EI step would wrap the model again)"
        )
    if training_args.max_steps > 0:
        raise cli.RecipeError(
            f"--max_steps {training_args.max_steps}: the SFT length is set by --sft_epochs; leave max_steps unset"
        )
    n_steps, questions, group = script_args.n_ei_steps, script_args.ei_batch_size, script_args.num_generations
    if n_steps * questions > train_rows:
        raise cli.RecipeError(
            f"--n_ei_steps {n_steps} x --ei_batch_size {questions} = {n_steps * questions} questions, "
            f"but the training split has {train_rows}; lower one of them or use more training problems"
        )
    cli.check_fills_one_step(
        questions * group,
        training_args,
        f"--ei_batch_size {questions} x --num_generations {group} (an EI step's SFT set if every sample is kept)",
        "samples",
    )


def ei_step(run, step, batch, sampler, model, tokenizer, task, script_args, training_args) -> tuple[dict, list]:
    """One EI step on ``batch`` (its questions): sample G outputs per question from the current policy, keep those
    whose reward is 1, fine-tune on them (:func:`sft`), evaluate on the held-out set; returns the step's record and
    its SFT log."""
    group = script_args.num_generations
    rows = [dict(zip(batch, values)) for values in zip(*batch.values()) for _ in range(group)]  # G per question
    prompts = [row["prompt"] for row in rows]
    t0 = time.perf_counter()
    with run.phase("sample", breakdown="generation"):  # G outputs per question from the current policy
        prompt_ids, completion_ids, completions = sampler.sample(prompts)
    generation_seconds = time.perf_counter() - t0
    with run.phase("filter", breakdown="reward"):  # the task's judge on whole rows; keep the correct outputs
        texts = [trl_ext.rewards.completion_text(c, i) for i, c in enumerate(completions)]
        rewards = [task.score(text, row)["reward"] for text, row in zip(texts, rows)]
        kept = [i for i, r in enumerate(rewards) if r == 1.0]
    with run.phase("entropy", breakdown="entropy"):  # a forward over every sampled response
        entropy = trl_ext.objective.course.mean_response_entropy(
            model, prompt_ids, completion_ids, tokenizer.pad_token_id, script_args.entropy_batch_size
        )
    record = {
        "step": step,
        "questions": len(batch["prompt"]),
        "generated": len(texts),
        "kept": len(kept),
        "mean_reward": sum(rewards) / len(rewards),
        "entropy": entropy,
        "generation_seconds": generation_seconds,
        "sft_loss": None,
        "sft_steps": 0,
        "sft_seconds": 0.0,
    }
    log = []
    if kept:  # SFT on them
        fields, log = sft(
            run, model, tokenizer, [prompts[i] for i in kept], [texts[i] for i in kept], training_args, step
        )
        record.update(fields)
    with run.phase("eval_steps", breakdown="evaluation"):
        after = task.evaluate(model, tokenizer, f"eval after EI step {step}", progress=False)
    record.update(accuracy=after["accuracy"], format_rate=after["format_rate"])
    print(
        f"EI step {step}: kept {len(kept)}/{len(texts)} samples (mean reward {record['mean_reward']:.3f}), response "
        f"entropy {entropy:.3f}, {record['sft_steps']} SFT steps, held-out accuracy {after['accuracy']:.1%}",
        flush=True,
    )
    return record, log


@cli.recipe(
    "expert_iteration",
    (EIArguments, trl_ext.SFTConfig, trl.ModelConfig),
    DEFAULT_CONFIG,
    help_overrides=HELP,
    not_resumable=NOT_RESUMABLE,
)
def main(run, script_args, training_args, model_args, speed=None):
    # the decorator refused a resume, checked the folder and the model's options; then the data, before the model loads
    with run.phase("load_data"):
        task = tasks.load_task(script_args, max_new_tokens=script_args.max_completion_length)
    check_options(script_args, training_args, model_args, len(task.train))
    training_args.num_train_epochs = script_args.sft_epochs
    with run.phase("load_model", breakdown="model_load"):
        model, tokenizer, _ = trl_ext.models.load_model_and_tokenizer(model_args)
    trl_ext.runtime.note_loaded_weights(speed, training_args, model_args.dtype, model)  # --dtype auto: known now
    model.to(PartialState().device)
    run.watch(model)  # every forward's work by phase: the roofline report
    with run.phase("eval_before", breakdown="evaluation"):
        before = task.evaluate(model, tokenizer, "eval before", progress=False)
    print(f"before: held-out accuracy {before['accuracy']:.1%} on {before['n']} problems", flush=True)
    with run.phase("sampler_setup", breakdown="sampler_setup"):
        sampler = make_sampler(model, tokenizer, task, script_args, training_args)
    order = random.Random(training_args.seed).sample(range(len(task.train)), len(task.train))
    questions = script_args.ei_batch_size
    steps, log_history, start, cpu_start = [], [], time.perf_counter(), trl_ext.measurement.profiling.cpu_seconds()
    for step in range(1, script_args.n_ei_steps + 1):  # each step's questions, drawn without replacement
        batch = task.train[order[(step - 1) * questions : step * questions]]
        record, log = ei_step(run, step, batch, sampler, model, tokenizer, task, script_args, training_args)
        steps.append(record)
        log_history += log
    seconds, cpu_seconds = time.perf_counter() - start, trl_ext.measurement.profiling.cpu_seconds() - cpu_start
    with run.phase("save", breakdown="save"):
        model.save_pretrained(run.output_dir)
        tokenizer.save_pretrained(run.output_dir)
    report.plot_curves([{"step": 0, "accuracy": before["accuracy"]}, *steps], PANELS, run.output_dir / "ei_curves.png")
    report.finish(
        run,
        {
            "accuracy_before": before["accuracy"],
            "accuracy_after": steps[-1]["accuracy"],
            "n_eval": before["n"],
            "ei_steps": steps,
            "train_seconds": seconds,
            "train_cpu_seconds": cpu_seconds,
            "model": model_args.model_name_or_path or trl_ext.models.DEFAULT_MODEL,
            "dataset": task.dataset,
            "reward": task.name,
            "runtime": speed or {},
            "log_history": log_history,
        },
        [
            *summary(before, steps, seconds, cpu_seconds),
            report.ModelCard(model_args.model_name_or_path, task.dataset),
            report.Written("ei_curves.png"),
        ],
        trainer=trl_ext.SFTTrainer,
        log_history=log_history,
    )


if __name__ == "__main__":
    # threads and CPU precision are chosen before main (speed=), so before the sampler's GRPOConfig copies bf16
    cli.main(main)
