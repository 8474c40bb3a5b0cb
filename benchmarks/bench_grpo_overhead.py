"""Overhead of trl_ext.GRPOTrainer over upstream trl.GRPOTrainer: step time and peak memory, one process, same math.

    uv run python benchmarks/bench_grpo_overhead.py                       # CPU: embedded SmolLM2, ~5 minutes
    uv run python benchmarks/bench_grpo_overhead.py --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16 \
        --batch-size 32 --num-generations 8 --max-completion-length 256 # GPU

Both trainers get the same model weights, prompts, reward and settings chosen so that the math is identical
(GRPO-Clip, std-normalized advantages with TRL's eps 1e-4, per-response token mean, beta 0): any difference is
overhead of the trl_ext seams. Not a test.

Step time: both trainers live side by side and take optimizer steps in lockstep (A B, then B A, ...), each step
preceded by the same seed, so both sample the same completions and a busy machine slows both alike. A step is
generation + reward + advantages + loss + backward + gradient clipping + AdamW step, driven directly through
``Trainer.training_step`` (Trainer's logging and callbacks, identical for both, are left out). Reported: median
seconds per step of each and the median of the per-pair ratios.

Peak memory: each trainer alone (the other deleted), order A B B A, a few steps each; CUDA max allocated on GPU,
else the increase of the process's peak RSS over its RSS before the trainer was built (trl_ext.compare.PeakMemory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import trl

import trl_ext
from trl_ext.compare import PeakMemory, release_memory
from trl_ext.data import make_arithmetic_dataset
from trl_ext.models import load_model, load_tokenizer
from trl_ext.rewards import arithmetic_reward


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="hub id or local path; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured step pairs first")
    p.add_argument("--pairs", type=int, default=10, help="measured step pairs")
    p.add_argument("--memory-steps", type=int, default=3, help="steps per memory measurement")
    p.add_argument("--output", default=None, help="also write the numbers to this JSON file")
    return p.parse_args()


def build(kind: str, args, tokenizer, dataset, out_dir: str):
    common = dict(
        output_dir=os.path.join(out_dir, kind),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        max_steps=10_000,
        temperature=1.0,
        beta=0.0,
        epsilon=0.2,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    if kind == "trl":
        config = trl.GRPOConfig(loss_type="grpo", scale_rewards="group", **common)
        cls = trl.GRPOTrainer
    else:
        config = trl_ext.GRPOConfig(
            pg_loss_type="grpo_clip", normalize_by_std=True, advantage_eps=1e-4, length_normalization="masked_mean",
            **common,
        )
        cls = trl_ext.GRPOTrainer
    model = load_model(args.model, dtype=args.dtype)
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = cls(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    trainer.create_optimizer_and_scheduler(num_training_steps=config.max_steps)
    trainer.current_gradient_accumulation_steps = 1
    trainer.bench_batches = iter(trainer.get_train_dataloader())
    trainer.bench_tokens = 0
    return trainer


def step(trainer, seed: int) -> float:
    """One optimizer step (generation included); returns its wall seconds."""
    batch = next(trainer.bench_batches)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    torch.manual_seed(seed)
    sync()
    start = time.perf_counter()
    trainer.training_step(trainer.model, batch, None)
    trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.model.zero_grad()
    trainer.state.global_step += 1
    sync()
    seconds = time.perf_counter() - start
    length = trainer._metrics["train"]["completions/mean_length"][-1]
    trainer.bench_tokens += round(length * trainer.args.per_device_train_batch_size)
    return seconds


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def measure_memory(kind: str, args, tokenizer, dataset, out_dir: str) -> int:
    release_memory()
    baseline = 0 if torch.cuda.is_available() else rss_bytes()
    meter = PeakMemory().start()
    trainer = build(kind, args, tokenizer, dataset, out_dir)
    for i in range(args.memory_steps):
        step(trainer, seed=10_000 + i)
    peak = meter.stop() - baseline
    del trainer
    release_memory()
    return peak


if __name__ == "__main__":
    args = parse_args()
    out_dir = "outputs/bench_grpo_overhead"
    tokenizer = load_tokenizer(args.model)
    dataset = make_arithmetic_dataset(2000, seed=0, split="train")
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {device}; model {args.model or 'embedded SmolLM2-135M-Instruct'} ({args.dtype}); "
          f"{args.batch_size} completions/step ({args.num_generations} per prompt), <= {args.max_completion_length} tokens")

    trainers = {"trl": build("trl", args, tokenizer, dataset, out_dir), "trl_ext": build("trl_ext", args, tokenizer, dataset, out_dir)}
    seconds: dict[str, list[float]] = {"trl": [], "trl_ext": []}
    for pair in range(args.warmup + args.pairs):
        order = ("trl", "trl_ext") if pair % 2 == 0 else ("trl_ext", "trl")
        this_pair = {kind: step(trainers[kind], seed=pair) for kind in order}
        if pair >= args.warmup:
            for kind, s in this_pair.items():
                seconds[kind].append(s)
        print(f"pair {pair + 1}/{args.warmup + args.pairs}{' (warm-up)' if pair < args.warmup else ''}: "
              f"trl {this_pair['trl']:.2f} s, trl_ext {this_pair['trl_ext']:.2f} s", flush=True)
    tokens = {k: t.bench_tokens for k, t in trainers.items()}
    del trainers
    release_memory()

    memory: dict[str, list[int]] = {"trl": [], "trl_ext": []}
    for kind in ("trl", "trl_ext", "trl_ext", "trl"):
        memory[kind].append(measure_memory(kind, args, tokenizer, dataset, out_dir))
        print(f"peak memory {kind}: {memory[kind][-1] / 2**20:.0f} MiB", flush=True)

    median = {k: statistics.median(v) for k, v in seconds.items()}
    pair_ratios = [b / a for a, b in zip(seconds["trl"], seconds["trl_ext"])]
    mem = {k: statistics.fmean(v) for k, v in memory.items()}
    result = {
        "device": device,
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "settings": vars(args),
        "median_step_seconds": median,
        "step_time_ratio_of_medians": median["trl_ext"] / median["trl"],
        "step_time_ratio_median_of_pairs": statistics.median(pair_ratios),
        "generated_tokens": tokens,
        "peak_memory_bytes": mem,
        "peak_memory_kind": "cuda_max_allocated" if torch.cuda.is_available() else "rss_peak_minus_baseline",
        "peak_memory_ratio": mem["trl_ext"] / mem["trl"],
        "step_seconds": seconds,
        "memory_runs_bytes": memory,
    }
    print()
    print(f"step time  trl {median['trl']:.3f} s   trl_ext {median['trl_ext']:.3f} s (medians of {args.pairs})")
    print(f"           ratio trl_ext/trl: {result['step_time_ratio_of_medians']:.3f} (of medians), "
          f"{result['step_time_ratio_median_of_pairs']:.3f} (median of per-pair ratios)   target <= 1.02")
    print(f"generated tokens  trl {tokens['trl']}   trl_ext {tokens['trl_ext']} (equal = same samples)")
    print(f"peak memory  trl {mem['trl'] / 2**20:.0f} MiB   trl_ext {mem['trl_ext'] / 2**20:.0f} MiB   "
          f"ratio {result['peak_memory_ratio']:.3f} ({result['peak_memory_kind']})   target <= 1.02")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
