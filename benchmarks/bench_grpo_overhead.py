"""trl_ext.GRPOTrainer against upstream trl.GRPOTrainer: step time and peak memory, one process, same math.

    uv run python benchmarks/bench_grpo_overhead.py                       # CPU: embedded SmolLM2, ~5 minutes
    uv run python benchmarks/bench_grpo_overhead.py --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16 \
        --batch-size 32 --num-generations 8 --max-completion-length 256 # GPU

Every trainer gets the same model weights, prompts, reward and settings chosen so that the math is identical
(GRPO-Clip, std-normalized advantages with TRL's eps 1e-4, per-response token mean, beta 0). Four trainers
(``KINDS``): upstream; ``trl_ext`` as shipped, which skips work the math does not need (``share_prompt_cache``: each
prompt's keys/values once per group; ``pack_completions``: no forward or backward of padding;
``skip_zero_advantage_rows``: no backward for rows with advantage 0), so its ratio to upstream shows that saving
(target < 1.00; the skipping part depends on how many groups have equal rewards, reported as
``frac_reward_zero_std``); ``trl_ext_shared``, prompt sharing alone; and ``trl_ext_unshared`` with all three off,
the same work as upstream, whose ratio is the overhead of the seams alone (target <= 1.02). Not a test.

Step time: the trainers live side by side and take optimizer steps in lockstep (A B C D, then B C D A, ...), each step
preceded by the same seed, so all sample the same completions and a busy machine slows both alike. A step is
generation + reward + advantages + loss + backward + gradient clipping + AdamW step, driven directly through
``Trainer.training_step`` (Trainer's logging and callbacks, identical for both, are left out). Reported: median
seconds per step of each and the median of the per-pair ratios.

Peak memory: each trainer alone (the other deleted), order A B B A, a few steps each; CUDA max allocated on GPU,
else the increase of the process's peak RSS over its RSS before the trainer was built (trl_ext.compare.PeakMemory).

Utilization: achieved model FLOP/s of a step over the machine's measured matmul peak, both in this process, at the
same dtype and thread count. Model FLOPs per step = 6 x P x (prompt + completion tokens) for the log-prob forward and
the backward, plus 2 x P x (prompt + completion tokens) for generation (prefill + decoding), with P the parameter
count (the tied LM head counted once) and only real (non-padding) tokens; attention's own FLOPs are left out (short
sequences). Peak = best of several ``torch.matmul`` of two 2048 x 2048 matrices (bf16 under --precision bf16).

Scaling (--scaling): the same lockstep measurement as the group size (4, 8, 16 completions per prompt, 2 prompts per
step) and the completion length (16, 64, 256 tokens, forced with min_new_tokens) grow, with each trainer's time per
phase (trl_ext.measurement.profiling); writes a JSON and a plot (docs/performance.png); trl_ext there shares prompts but
does not skip zero-advantage rows (see ``KINDS``). Threads follow trl_ext.runtime (every core); precision ``auto`` is
bf16 autocast where the CPU has bf16 instructions -- pass ``--precision fp32`` for the main job's setting.
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
from trl_ext import runtime
from trl_ext.compare import PeakMemory, release_memory
from trl_ext.data import make_arithmetic_dataset
from trl_ext.measurement.profiling import StepProfiler
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
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="fp32 weights, with bf16 autocast for 'bf16'; 'auto': bf16 where the CPU has bf16 instructions",
    )
    p.add_argument("--scaling", action="store_true", help="measure the scaling grid instead (see above)")
    p.add_argument("--skip-memory", action="store_true", help="leave out the peak-memory runs")
    return p.parse_args()


def build(kind: str, args, tokenizer, dataset, out_dir: str, **overrides):
    common = dict(
        output_dir=os.path.join(out_dir, kind),
        use_cpu=not torch.cuda.is_available(),
        bf16=args.precision == "bf16",
        cast_lm_head_to_fp32=args.precision == "bf16",  # log-probs stay fp32 (as trl_ext.runtime sets it)
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
    common.update(overrides)
    if kind == "trl":
        config = trl.GRPOConfig(loss_type="grpo", scale_rewards="group", **common)
        cls = trl.GRPOTrainer
    else:
        config = trl_ext.GRPOConfig(
            pg_loss_type="grpo_clip",
            normalize_by_std=True,
            advantage_eps=1e-4,
            length_normalization="masked_mean",
            share_prompt_cache=kind != "trl_ext_unshared",
            pack_completions=kind == "trl_ext",
            skip_zero_advantage_rows=kind == "trl_ext",
            **common,
        )
        cls = trl_ext.GRPOTrainer
    model = load_model(args.model, dtype=args.dtype)
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = cls(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    # as trainer.train() does: accelerate wraps the forward in autocast (bf16), for generation and the loss alike
    trainer.model = trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
    trainer.create_optimizer_and_scheduler(num_training_steps=config.max_steps)
    trainer.current_gradient_accumulation_steps = 1
    trainer.bench_batches = iter(trainer.get_train_dataloader())
    trainer.bench_tokens = 0
    trainer.bench_all_tokens = 0
    trainer.bench_profiler = StepProfiler().attach(trainer)
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
    # prompt + completion tokens without padding (TRL's cumulative num_tokens)
    trainer.bench_all_tokens = int(trainer._metrics["train"]["num_tokens"][-1])
    return seconds


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best FLOP/s of ``torch.matmul`` of two n x n matrices of ``dtype`` at this process's thread count."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def model_flops(trainer) -> float:
    """Model FLOPs of all measured-or-not steps so far: (6 + 2) x P x real tokens (see the module docstring)."""
    params = sum(p.numel() for p in trainer.model.parameters())
    return 8 * params * trainer.bench_all_tokens


KINDS = ("trl", "trl_ext", "trl_ext_shared", "trl_ext_unshared")
"""Upstream; trl_ext as shipped (share_prompt_cache, pack_completions and skip_zero_advantage_rows on); trl_ext with
prompt sharing only; trl_ext with all three off (the seams alone, the same work as upstream). What skipping saves
depends on how many groups have equal rewards (reported); the scaling grid uses "trl_ext_shared" (forced-length
completions of the base model almost never earn a reward, so skipping would drop nearly every backward and hide how a
step's cost grows)."""


def lockstep(trainers, args, label=""):
    """Step the trainers in rotating order; returns the measured seconds per trainer and per-step FLOPs."""
    kinds = list(trainers)
    seconds = {kind: [] for kind in kinds}
    flops = {kind: 0.0 for kind in kinds}
    for pair in range(args.warmup + args.pairs):
        order = kinds[pair % len(kinds) :] + kinds[: pair % len(kinds)]
        this_pair = {}
        for kind in order:
            before = model_flops(trainers[kind])
            this_pair[kind] = step(trainers[kind], seed=pair)
            if pair >= args.warmup:
                flops[kind] += model_flops(trainers[kind]) - before
        if pair >= args.warmup:
            for kind, s in this_pair.items():
                seconds[kind].append(s)
        times = ", ".join(f"{kind} {this_pair[kind]:.2f} s" for kind in kinds)
        print(
            f"{label}round {pair + 1}/{args.warmup + args.pairs}{' (warm-up)' if pair < args.warmup else ''}: {times}",
            flush=True,
        )
    return seconds, flops


SCALING_GRID = [(4, 16), (8, 16), (16, 16), (8, 64), (8, 256)]
"""(completions per prompt G, completion length T); 2 prompts per step, so 2G completions."""


def run_scaling(args, tokenizer, dataset, out_dir):
    rows = []
    for group, length in SCALING_GRID:
        overrides = dict(
            num_generations=group,
            per_device_train_batch_size=2 * group,
            max_completion_length=length,
            generation_kwargs={"min_new_tokens": length},
        )
        trainers = {k: build(k, args, tokenizer, dataset, out_dir, **overrides) for k in ("trl", "trl_ext_shared")}
        seconds, flops = lockstep(trainers, args, label=f"G={group} T={length}: ")
        row = {"group_size": group, "completion_length": length, "completions": 2 * group}
        for kind, trainer in trainers.items():
            total = trainer.bench_profiler.timer.seconds
            steps = args.warmup + args.pairs
            row[kind] = {
                "median_step_seconds": statistics.median(seconds[kind]),
                "mean_phase_seconds": {k: v / steps for k, v in total.items()},  # warm-up included
                "flops_per_second": flops[kind] / sum(seconds[kind]),
            }
        rows.append(row)
        print(
            f"G={group} T={length}: trl {row['trl']['median_step_seconds']:.2f} s, "
            f"trl_ext_shared {row['trl_ext_shared']['median_step_seconds']:.2f} s",
            flush=True,
        )
        del trainers
        release_memory()
        if args.output:  # keep what is done so far
            with open(args.output, "w") as f:
                json.dump({"rows": rows, "settings": vars(args), "threads": torch.get_num_threads()}, f, indent=2)
    return rows


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


def plot_scaling(rows, path):
    """Two panels: median step seconds vs group size (T=16) and vs completion length (G=8), upstream and trl_ext."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, fixed, label in (
        (axes[0], "group_size", ("completion_length", 16), "completions per prompt G (T=16)"),
        (axes[1], "completion_length", ("group_size", 8), "completion length T (G=8)"),
    ):
        sel = sorted((r for r in rows if r[fixed[0]] == fixed[1]), key=lambda r: r[key])
        for kind, style, name in (
            ("trl", "--o", "upstream trl"),
            ("trl_ext_shared", "-s", "trl_ext (share_prompt_cache)"),
        ):
            ax.plot([r[key] for r in sel], [r[kind]["median_step_seconds"] for r in sel], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    args = parse_args()
    out_dir = "outputs/bench_grpo_overhead"
    threads = runtime.configure_cpu_threads()
    if args.precision == "auto":
        args.precision = "bf16" if torch.cuda.is_available() or runtime.cpu_has_bf16() else "fp32"
    tokenizer = load_tokenizer(args.model)
    dataset = make_arithmetic_dataset(2000, seed=0, split="train")
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"device {device}; model {args.model or 'embedded SmolLM2-135M-Instruct'} ({args.dtype}); "
        f"{args.batch_size} completions/step ({args.num_generations} per prompt), <= {args.max_completion_length} "
        "tokens"
    )

    print(f"precision {args.precision}; threads {threads['threads']} ({threads['source']})")
    peak = matmul_peak_flops(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    print(f"matmul peak ({args.precision}, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s", flush=True)
    if args.scaling:
        rows = run_scaling(args, tokenizer, dataset, out_dir)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(
                    {
                        "rows": rows,
                        "settings": vars(args),
                        "threads": torch.get_num_threads(),
                        "matmul_peak_flops": peak,
                    },
                    f,
                    indent=2,
                )
        plot_scaling(rows, "docs/performance.png")
        raise SystemExit(0)

    trainers = {kind: build(kind, args, tokenizer, dataset, out_dir) for kind in KINDS}
    seconds, flops = lockstep(trainers, args)
    tokens = {k: t.bench_tokens for k, t in trainers.items()}
    achieved = {k: flops[k] / sum(seconds[k]) for k in seconds}
    phases = {k: dict(t.bench_profiler.timer.seconds) for k, t in trainers.items()}
    # share of groups whose rewards were all equal (their rows have advantage 0): what skip_zero_advantage_rows skips
    zero_std = statistics.fmean(trainers["trl_ext"]._metrics["train"]["frac_reward_zero_std"])
    del trainers
    release_memory()

    memory: dict[str, list[int]] = {kind: [] for kind in KINDS}
    for kind in () if args.skip_memory else KINDS + KINDS[::-1]:
        memory[kind].append(measure_memory(kind, args, tokenizer, dataset, out_dir))
        print(f"peak memory {kind}: {memory[kind][-1] / 2**20:.0f} MiB", flush=True)

    median = {k: statistics.median(v) for k, v in seconds.items()}
    pair_ratios = {k: statistics.median(b / a for a, b in zip(seconds["trl"], seconds[k])) for k in KINDS[1:]}
    mem = {k: statistics.fmean(v) if v else float("nan") for k, v in memory.items()}
    result = {
        "device": device,
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "settings": vars(args),
        "median_step_seconds": median,
        "step_time_ratio_of_medians": {k: median[k] / median["trl"] for k in KINDS[1:]},
        "step_time_ratio_median_of_pairs": pair_ratios,
        "generated_tokens": tokens,
        "peak_memory_bytes": mem,
        "peak_memory_kind": "cuda_max_allocated" if torch.cuda.is_available() else "rss_peak_minus_baseline",
        "peak_memory_ratio": {k: mem[k] / mem["trl"] for k in KINDS[1:]},
        "step_seconds": seconds,
        "memory_runs_bytes": memory,
        "precision": args.precision,
        "threads": torch.get_num_threads(),
        "matmul_peak_flops": peak,
        "achieved_model_flops": achieved,
        "utilization": {k: v / peak for k, v in achieved.items()},
        "phase_seconds": phases,
        "frac_reward_zero_std": zero_std,
    }
    print()
    print(
        f"step time (median of {args.pairs}), ratio to trl (of medians / median of per-round ratios), generated "
        f"tokens (equal = same samples), peak memory and its ratio ({result['peak_memory_kind']}):"
    )
    for kind in KINDS:
        ratios = (
            ""
            if kind == "trl"
            else (f"  ratio {result['step_time_ratio_of_medians'][kind]:.3f} / {pair_ratios[kind]:.3f}")
        )
        mem_ratio = "" if kind == "trl" else f" (ratio {result['peak_memory_ratio'][kind]:.3f})"
        print(
            f"  {kind:17s} {median[kind]:.3f} s{ratios}   tokens {tokens[kind]}   "
            f"memory {mem[kind] / 2**20:.0f} MiB{mem_ratio}"
        )
    print(
        "  targets: trl_ext_unshared (the seams alone) <= 1.02; trl_ext (skips work the math does not need) < 1.00;"
        f" groups with equal rewards (rows skipped by trl_ext): {zero_std:.0%}"
    )
    print(
        f"utilization (model FLOP/s over the {peak / 1e9:.1f} GFLOP/s matmul peak, {args.precision}, "
        f"{torch.get_num_threads()} threads; the same model FLOPs counted for every trainer):"
    )
    for kind in KINDS:
        print(f"  {kind:17s} {achieved[kind] / 1e9:.1f} GFLOP/s = {result['utilization'][kind]:.1%}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
