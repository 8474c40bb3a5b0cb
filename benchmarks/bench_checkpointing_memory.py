"""Peak memory and CPU seconds of a few GRPO steps, with and without gradient checkpointing, upstream and trl_ext.

    uv run python benchmarks/bench_checkpointing_memory.py                 # CPU: embedded SmolLM2, ~15 minutes
    uv run python benchmarks/bench_checkpointing_memory.py --rounds 1 --steps 2 --output results.json

Issue 41: TRL's default ``gradient_checkpointing=True`` used to turn trl_ext's prompt sharing and packing off for the
training forward. This runs the same user script four ways -- ``trl.GRPOTrainer`` and ``trl_ext.GRPOTrainer``, each
with checkpointing on (TRL's default, transformers' default ``use_reentrant=False``) and off -- each in a process of
its own (peak RSS is per process), the four in turn, ``--rounds`` times (A B C D, then B C D A, ...), so a busy
machine slows all alike. Every run gets the same unchanged ``trl.GRPOConfig`` but for the run's size (steps, batch,
completion length), the CPU, fp32 (the main job's precision) and the checkpointing switch, the embedded model and the
main job's two-digit additions with its reward; trl_ext gets the upstream config itself, as a user would pass it.

Reported per run: the process's peak resident set size (``getrusage`` ``ru_maxrss``: what ``/usr/bin/time -v``
prints as "Maximum resident set size"), its RSS just before the trainer was built (model and data loaded), the
process CPU seconds and wall seconds of ``trainer.train()``, the logged losses, and for trl_ext how many training
forwards ran packed (one row; with checkpointing: the prompts inside it, no cache). Medians over rounds; the ratios
trl_ext / upstream are per round. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

RUNS = (("trl", True), ("trl_ext", True), ("trl", False), ("trl_ext", False))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (completions per step)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="each of the four runs this many times, in rotating order")
    p.add_argument("--output", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "trainer,checkpointing": one run, JSON out
    return p.parse_args()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def one_run(kind: str, checkpointing: bool, args) -> dict:
    import tempfile

    import torch
    import trl

    import trl_ext
    from trl_ext.data import make_arithmetic_dataset
    from trl_ext.models import load_model, load_tokenizer
    from trl_ext.rewards import arithmetic_reward

    tokenizer = load_tokenizer()
    dataset = make_arithmetic_dataset(args.steps * args.batch_size, seed=0, tokenizer=tokenizer)
    model = load_model(None)
    config = trl.GRPOConfig(  # TRL's defaults but for the size, the CPU, fp32 and the switch measured
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=checkpointing,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    cls = trl.GRPOTrainer if kind == "trl" else trl_ext.GRPOTrainer
    packed = []  # rows of each training forward (with gradient) of the policy
    model.register_forward_pre_hook(
        lambda m, a, kw: packed.append(kw["input_ids"].size(0)) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    before = rss_bytes()
    trainer = cls(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.train()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "trainer": kind,
        "gradient_checkpointing": checkpointing,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        "rss_before_trainer_gib": before / 2**30,
        "train_cpu_seconds": cpu,
        "train_wall_seconds": wall,
        "losses": [entry["loss"] for entry in logs],
        "rewards": [entry["reward"] for entry in logs],
        "training_forwards": len(packed),
        "packed_training_forwards": sum(rows == 1 for rows in packed),
    }


def main():
    args = parse_args()
    if args.one:
        kind, checkpointing = args.one.split(",")
        print(json.dumps(one_run(kind, checkpointing == "1", args)))
        return
    results = []
    for round_index in range(args.rounds):
        order = RUNS[round_index % len(RUNS) :] + RUNS[: round_index % len(RUNS)]
        for kind, checkpointing in order:
            command = [sys.executable, __file__, "--one", f"{kind},{int(checkpointing)}"]
            for name in ("steps", "batch_size", "num_generations", "max_completion_length"):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            load = os.getloadavg()[0]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run.update(round=round_index, load_average_at_start=load)
            results.append(run)
            print(
                f"round {round_index} {kind:8s} checkpointing={checkpointing!s:5s} peak RSS "
                f"{run['peak_rss_gib']:.2f} GiB (before trainer {run['rss_before_trainer_gib']:.2f}), train "
                f"{run['train_cpu_seconds']:.1f} CPU s / {run['train_wall_seconds']:.1f} s, packed forwards "
                f"{run['packed_training_forwards']}/{run['training_forwards']}, load {load:.1f}",
                flush=True,
            )
    summary = {}
    for kind, checkpointing in RUNS:
        runs = [r for r in results if r["trainer"] == kind and r["gradient_checkpointing"] == checkpointing]
        summary[f"{kind}/checkpointing={checkpointing}"] = {
            key: statistics.median(r[key] for r in runs)
            for key in ("peak_rss_gib", "rss_before_trainer_gib", "train_cpu_seconds", "train_wall_seconds")
        }
    ratios = {}
    for checkpointing in (True, False):
        for key in ("peak_rss_gib", "train_cpu_seconds"):
            per_round = [
                next(
                    r
                    for r in results
                    if r["round"] == i and r["trainer"] == "trl_ext" and r["gradient_checkpointing"] == checkpointing
                )[key]
                / next(
                    r
                    for r in results
                    if r["round"] == i and r["trainer"] == "trl" and r["gradient_checkpointing"] == checkpointing
                )[key]
                for i in range(args.rounds)
            ]
            ratios[f"trl_ext/trl {key} checkpointing={checkpointing}"] = statistics.median(per_round)
    print(json.dumps({"median": summary, "ratio": ratios}, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"settings": vars(args), "runs": results, "median": summary, "ratio": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
