"""Expert iteration (CS336 A5 handout, Algorithm 2): sample, keep the correct outputs, SFT on them, repeat.

    uv run accelerate launch recipes/expert_iteration.py                     # CPU default: embedded model, arithmetic
    uv run accelerate launch recipes/expert_iteration.py --n_ei_steps 5 --num_generations 4 --sft_epochs 2
    uv run --extra gpu accelerate launch recipes/expert_iteration.py \\
        --config recipes/configs/expert_iteration_math.yaml                  # GPU: Qwen2.5-Math-1.5B on MATH, vLLM

For each of --n_ei_steps: sample --ei_batch_size training questions, generate --num_generations (G) outputs per
question from the current policy, keep those whose reward is 1, and fine-tune on them with trl_ext.SFTTrainer
(completion-only, gradient clipping max_grad_norm, --sft_epochs epochs). No hand-written loop: generation goes
through trl_ext.GRPOTrainer's own sampler (TRL's `_generate`: transformers `generate`, or vLLM with --use_vllm), the
SFT is a TRL trainer. Held-out greedy accuracy is measured before training and after every EI step, and the mean
token entropy of each step's sampled responses under the policy that sampled them.

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

from __future__ import annotations

import copy
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trl
from accelerate import PartialState
from datasets import Dataset
from grpo_math import REWARDS, MathScriptArguments, load_data  # the math recipe's data options and loaders

import trl_ext
from trl_ext import course as C
from trl_ext.eval import evaluate_math
from trl_ext.experiment import git_state, write_experiment_record
from trl_ext.models import DEFAULT_MODEL, load_model_and_tokenizer
from trl_ext.recipe_utils import (
    RecipeError,
    RecipeRun,
    check_fills_one_step,
    check_model_options,
    parse_recipe_args,
    recipe_main,
    user_input,
    write_model_card,
)
from trl_ext.rewards import completion_text
from trl_ext.runtime import name_loaded_weights

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "expert_iteration_cpu.yaml"
HELP = {  # inherited trl_ext.SFTConfig options this recipe treats its own way
    "resume_from_checkpoint": "Refused: expert iteration keeps no checkpoints (each EI step's SFT is a fresh trainer), "
    "so it cannot be resumed.",
    "max_steps": "Refused (leave it unset): the SFT of each EI step runs --sft_epochs epochs over its kept samples.",
    "num_train_epochs": "Not read: set from --sft_epochs.",
}


@dataclass
class EIArguments(MathScriptArguments):
    """The math recipe's data options plus the expert-iteration loop and its sampling."""

    n_ei_steps: int = field(default=3, metadata={"help": "Expert-iteration steps (sample, filter, SFT)."})
    num_generations: int = field(default=8, metadata={"help": "G: outputs sampled per question."})
    ei_batch_size: int = field(default=16, metadata={"help": "Questions sampled (without replacement) per EI step."})
    sft_epochs: int = field(default=1, metadata={"help": "SFT epochs over each step's kept outputs (sets num_train_epochs)."})
    max_completion_length: int = field(default=20, metadata={"help": "Token budget of each sampled output (and of evaluation)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the rollouts."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of the rollouts (1.0 = off)."})
    use_vllm: bool = field(default=False, metadata={"help": "Sample with vLLM (GPU extra), as trl_ext.GRPOTrainer does."})
    vllm_mode: str = field(default="colocate", metadata={"help": "'colocate' or 'server', as in trl.GRPOConfig."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM memory share in colocate mode."})
    entropy_batch_size: int = field(default=32, metadata={"help": "Sequences per forward pass when measuring entropy."})

    def __post_init__(self):
        for name in ("n_ei_steps", "num_generations", "ei_batch_size", "sft_epochs", "max_completion_length", "entropy_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}; expected an integer >= 1")
        if self.temperature <= 0:
            raise ValueError(f"--temperature={self.temperature}; expected > 0 (expert iteration samples)")


def make_sampler(model, tokenizer, train, train_reward, script_args, training_args):
    """A trl_ext.GRPOTrainer used only for its sampler (`_generate`), so rollouts take GRPO's generation path."""
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
    sampler = trl_ext.GRPOTrainer(model=model, reward_funcs=train_reward, args=args, train_dataset=train, processing_class=tokenizer)
    sampler.model.train()  # "train" mode: TRL samples num_generations outputs per prompt
    return sampler


@torch.no_grad()
def mean_response_entropy(model, prompt_ids, completion_ids, pad_token_id, batch_size) -> float:
    """Mean next-token entropy (nats) over every response token, from the exact sampled token ids."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(prompt_ids), batch_size):
        seqs = [list(p) + list(c) for p, c in zip(prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size])]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        response = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
        for i, (seq, p) in enumerate(zip(seqs, prompt_ids[start : start + batch_size])):
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            response[i, len(p) - 1 : len(seq) - 1] = True  # labels that are response tokens
        out = C.get_response_log_probs(
            model, ids[:, :-1].to(device), ids[:, 1:].to(device), return_token_entropy=True, attention_mask=attention[:, :-1].to(device)
        )
        entropy = out["token_entropy"].cpu()
        total += float(entropy[response].sum())
        count += int(response.sum())
    model.train(was_training)
    return total / max(count, 1)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads): a measure of work that a busy machine does not inflate."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plot_ei(steps: list[dict], before: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_ent) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = [0] + [s["step"] for s in steps]
    ax_acc.plot(xs, [before] + [s["accuracy"] for s in steps], "o-")
    ax_acc.set_title("held-out accuracy (greedy)")
    ax_acc.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax_ent.plot([s["step"] for s in steps], [s["entropy"] for s in steps], "o-", color="tab:orange")
    ax_ent.set_title("mean token entropy of the sampled responses (nats)")
    for ax in (ax_acc, ax_ent):
        ax.set_xlabel("EI step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(script_args, training_args, model_args, speed=None):
    # everything that can be checked without the model comes first: resume, folder, options, data
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    if training_args.resume_from_checkpoint not in (None, "", "false", "False"):
        raise RecipeError(
            "--resume_from_checkpoint: expert iteration keeps no checkpoints (each EI step's SFT is a fresh trainer "
            "and the questions it samples depend on the whole run so far), so it cannot be resumed; run it again "
            "(add --overwrite_output_dir to replace an earlier run in the same --output_dir)"
        )
    run = RecipeRun("expert_iteration", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir)
    check_model_options(model_args)
    state = PartialState()
    if state.num_processes > 1:
        raise RecipeError("expert_iteration.py runs in one process (its SFT batches are small); launch without multi-process accelerate")
    if model_args.use_peft:
        raise RecipeError("--use_peft is not supported by expert_iteration.py yet (each EI step would wrap the model again)")
    if training_args.max_steps > 0:
        raise RecipeError(f"--max_steps {training_args.max_steps}: the SFT length is set by --sft_epochs; leave max_steps unset")
    training_args.num_train_epochs = script_args.sft_epochs
    git = git_state()  # the code this run starts from
    with run.phase("load_data"), user_input("--dataset_name: " if script_args.dataset_name else ""):
        train, test, reward_name = load_data(script_args)
    train_reward, eval_reward = REWARDS[reward_name]
    needed = script_args.n_ei_steps * script_args.ei_batch_size
    if needed > len(train):  # questions are drawn without replacement across the whole run
        raise RecipeError(
            f"--n_ei_steps {script_args.n_ei_steps} x --ei_batch_size {script_args.ei_batch_size} = {needed} questions, "
            f"but the training split has {len(train)}; lower one of them or use more training problems"
        )
    # each EI step's SFT trains on at most every sample of the step (all kept): too few for one batch trains nothing
    samples = script_args.ei_batch_size * script_args.num_generations
    check_fills_one_step(samples, training_args, f"--ei_batch_size {script_args.ei_batch_size} x --num_generations "
                         f"{script_args.num_generations} (an EI step's SFT set if every sample is kept)", "samples")
    with run.phase("load_model"):
        model, tokenizer, _ = load_model_and_tokenizer(model_args)
    if speed:  # --dtype auto: the checkpoint's own dtype, known now
        speed["precision"] = name_loaded_weights(speed["precision"], training_args, model_args.dtype, model)
    model.to(state.device)
    evaluate = lambda desc: evaluate_math(  # noqa: E731
        model, tokenizer, test, eval_reward, script_args.max_completion_length, script_args.eval_batch_size, desc, disable_progress=True
    )
    with run.phase("eval_before"):
        before = evaluate("eval before")
    print(f"before: held-out accuracy {before['accuracy']:.1%} on {before['n']} problems", flush=True)
    sampler = make_sampler(model, tokenizer, train, train_reward, script_args, training_args)
    rng = random.Random(training_args.seed)
    order = rng.sample(range(len(train)), len(train))
    steps, start, cpu_start = [], time.perf_counter(), cpu_seconds()
    log_history = []
    for step in range(1, script_args.n_ei_steps + 1):
        first = (step - 1) * script_args.ei_batch_size
        rows = [train[i % len(train)] for i in order[first : first + script_args.ei_batch_size]]
        prompts = [row["prompt"] for row in rows for _ in range(script_args.num_generations)]
        answers = [row["answer"] for row in rows for _ in range(script_args.num_generations)]
        t0 = time.perf_counter()
        sampler._last_loaded_step = -1  # the policy changed since the last call: make vLLM reload the weights
        with run.phase("sample"):
            prompt_ids, completion_ids, _, completions, *_ = sampler._generate(prompts)
        generation_seconds = time.perf_counter() - t0
        texts = [completion_text(c, i) for i, c in enumerate(completions)]
        rewards = [eval_reward(text, answer)["reward"] for text, answer in zip(texts, answers)]
        with run.phase("entropy"):
            entropy = mean_response_entropy(model, prompt_ids, completion_ids, tokenizer.pad_token_id, script_args.entropy_batch_size)
        kept = [i for i, r in enumerate(rewards) if r == 1.0]
        record = {
            "step": step,
            "questions": len(rows),
            "generated": len(texts),
            "kept": len(kept),
            "mean_reward": sum(rewards) / len(rewards),
            "entropy": entropy,
            "generation_seconds": generation_seconds,
        }
        if kept:
            conversational = not isinstance(prompts[0], str)
            sft_data = Dataset.from_dict({
                "prompt": [prompts[i] for i in kept],
                "completion": [[{"role": "assistant", "content": texts[i]}] if conversational else texts[i] for i in kept],
            })
            args = copy.copy(training_args)
            args.output_dir = str(Path(training_args.output_dir) / f"sft_step{step}")
            args.logging_dir = None
            t0 = time.perf_counter()
            trainer = trl_ext.SFTTrainer(model=model, args=args, train_dataset=sft_data, processing_class=tokenizer)
            run.attach(trainer)  # logs the last step; a Ctrl-C during a checkpoint write waits for it to complete
            with run.phase("sft"):
                result = trainer.train()
            record.update(sft_loss=result.training_loss, sft_steps=result.global_step, sft_seconds=time.perf_counter() - t0)
            log_history += [{**e, "ei_step": step} for e in trainer.state.log_history]
            del trainer
        else:
            record.update(sft_loss=None, sft_steps=0, sft_seconds=0.0)
        with run.phase("eval_steps"):
            result = evaluate(f"eval after EI step {step}")
        record.update(accuracy=result["accuracy"], format_rate=result["format_rate"])
        steps.append(record)
        print(
            f"EI step {step}: kept {len(kept)}/{len(texts)} samples (mean reward {record['mean_reward']:.3f}), response "
            f"entropy {entropy:.3f}, {record['sft_steps']} SFT steps, held-out accuracy {result['accuracy']:.1%}",
            flush=True,
        )
    train_seconds, train_cpu_seconds = time.perf_counter() - start, cpu_seconds() - cpu_start

    out = Path(training_args.output_dir)
    with run.phase("save"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        write_model_card(trl_ext.SFTTrainer, out, model_args.model_name_or_path,
                         script_args.dataset_name or "generated arithmetic")
    metrics = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": steps[-1]["accuracy"],
        "n_eval": before["n"],
        "ei_steps": steps,
        "train_seconds": train_seconds,
        "train_cpu_seconds": train_cpu_seconds,
        "model": model_args.model_name_or_path or DEFAULT_MODEL,
        "dataset": script_args.dataset_name or "generated arithmetic",
        "reward": reward_name,
        "runtime": speed or {},
        "log_history": log_history,
    }
    plot = plot_ei(steps, before["accuracy"], out / "ei_curves.png")
    se = lambda p: (p * (1 - p) / before["n"]) ** 0.5  # noqa: E731
    entropies = [s["entropy"] for s in steps]
    write_experiment_record(
        out, "Expert iteration", configs=(script_args, training_args, model_args),
        results=[
            ("held-out accuracy", f"{before['accuracy']:.1%} ± {100 * se(before['accuracy']):.1f}",
             f"{steps[-1]['accuracy']:.1%} ± {100 * se(steps[-1]['accuracy']):.1f}"),
            ("kept samples (first -> last EI step)", f"{steps[0]['kept']}/{steps[0]['generated']}", f"{steps[-1]['kept']}/{steps[-1]['generated']}"),
            ("response entropy (nats/token)", f"{entropies[0]:.3f}", f"{entropies[-1]:.3f}"),
            ("wall time (EI loop, s)", "", f"{train_seconds:.0f}"),
            ("CPU time (EI loop, s; all threads)", "", f"{train_cpu_seconds:.0f}"),
        ],
        results_header=("", "first / before", "last / after"),
        plots=[plot.name],
        observations=[
            f"Held-out accuracy per EI step: {', '.join(format(s['accuracy'], '.1%') for s in steps)} (n = {before['n']}).",
            f"Kept fraction per EI step: {', '.join(format(s['kept'] / s['generated'], '.0%') for s in steps)}.",
            "Response entropy " + ("fell" if entropies[-1] < entropies[0] else "did not fall") + f" from {entropies[0]:.3f} to {entropies[-1]:.3f} nats/token"
            + (" (collapsed)." if entropies[-1] < 0.1 or entropies[-1] < entropies[0] / 5 else "."),
        ],
        log_history=log_history,
        git=git,
    )
    run.write_metrics(metrics)  # last: its presence marks a finished run
    print(
        f"Expert iteration: held-out accuracy {before['accuracy']:.1%} -> {steps[-1]['accuracy']:.1%} "
        f"({before['n']} problems) in {train_seconds:.0f} s; wrote {out / 'metrics.json'}, {plot} and {out / 'experiment.md'}"
    )


def parse_args(argv=None):
    return parse_recipe_args((EIArguments, trl_ext.SFTConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__, HELP)


if __name__ == "__main__":
    # threads and CPU precision are chosen before main, so before the sampler's GRPOConfig copies bf16 from them
    recipe_main(main, parse_args, speed_defaults=DEFAULT_CONFIG)
