"""GRPO memory and speed on one GPU, trl_ext against upstream TRL, with no download: a model with the
Qwen2.5-1.5B architecture and random weights, built directly on the GPU.

    python scripts/gpu_bench.py --out bench.json                        # GPU machine (scripts/gpu_check.sh runs it)
    python scripts/gpu_bench.py --device cpu --tiny --out bench.json    # CPU dry run: tiny model, same code path

Each run builds the model from QWEN2_5_1_5B (the public config.json values of Qwen/Qwen2.5-1.5B) with seed 0, adds
LoRA r 16 (alpha 32) on all linear layers, and trains a few GRPO steps with G = 8 completions of one prompt per step
(per_device_train_batch_size = G, one micro-batch per generation batch), bf16, gradient checkpointing, beta 0,
transformers generation (no vLLM: its wheel cannot travel). Random weights rarely sample the end-of-sequence
token, and the EOS is suppressed besides (``generation_kwargs={"suppress_tokens": [eos]}``), so every completion
runs to ``max_completion_length``: the worst case for memory, and the same work for both trainers. The tokenizer is
the embedded SmolLM2 one (49152 tokens; sampled ids beyond it decode to nothing, which only the toy reward sees).
trl_ext runs with the course options that equal TRL's ``loss_type="grpo"``, ``scale_rewards="group"``
(grpo_clip + normalize_by_std + masked_mean, advantage_eps 1e-4), so the figures compare implementations, not
algorithms. QLoRA (4-bit NF4 base through trl_ext.models.load_model, as the recipes load it) runs when
bitsandbytes is installed and the device is CUDA; its random bf16 checkpoint is written once to a temporary folder.

Measured per run, each run after the previous one's memory was freed:
- peak memory: ``torch.cuda.max_memory_allocated`` over the whole run (generation and training) minus what was
  allocated before the run started, and ``max_memory_reserved`` (the caching allocator's pool, closer to what
  nvidia-smi shows without the CUDA context);
- step time: wall time of each optimizer step (generation + scoring + forward/backward), CUDA-synchronized; the
  first step pays for warm-up and is reported apart; ``median_step_s`` is over the steps after it;
- generated tokens/s: completion tokens of the timed steps / the time spent in ``trainer._generate``;
- the estimate of scripts/memory_estimate.py for the same model, method, G, completion and prompt length.

Time budget (``--budget-s``, default 210 s on CUDA): runs go in priority order (LoRA 256 for both trainers, LoRA
1024 for trl_ext, QLoRA 256, then LoRA 1024 for upstream and QLoRA 1024), and a run whose predicted time (the last run
of the same completion length, or 4x
a run of a quarter of the length) would pass the budget is skipped and listed as such. Planned, not measured (no
GPU has run this yet): on an H200 a 1.5B model generates 8 sequences at roughly 15-30 ms per token with
transformers, so a step of 256 tokens takes about 5-8 s and one of 1024 about 20-30 s; 2 steps per run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN2_5_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    use_sliding_window=False,
)
"""Qwen/Qwen2.5-1.5B's config.json (architecture Qwen2ForCausalLM; q/k/v biases are Qwen2's default)."""

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    use_sliding_window=False,
)
"""The --tiny dry run's shape (vocab: the tokenizer's)."""

LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_memory_estimate():
    """scripts/memory_estimate.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parent / "memory_estimate.py"
    spec = importlib.util.spec_from_file_location("memory_estimate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("memory_estimate", module)  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def model_config(tokenizer, tiny: bool):
    """The Qwen2Config of the bench (or of the dry run); special token ids are the tokenizer's."""
    from transformers import Qwen2Config

    values = dict(TINY, vocab_size=len(tokenizer)) if tiny else QWEN2_5_1_5B
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return Qwen2Config(**values, **special)


def build_model(config, device: str, seed: int = 0):
    """Random weights (seed fixed: both trainers get the same model), in bf16, allocated directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def prompts_dataset(tokenizer, prompt_tokens: int, n: int):
    """n distinct plain-text prompts of exactly `prompt_tokens` tokens each (checked)."""
    from datasets import Dataset

    rows = []
    for i in range(n):
        ids = tokenizer(f"{i} " + " word" * prompt_tokens, add_special_tokens=False)["input_ids"][:prompt_tokens]
        rows.append(tokenizer.decode(ids))
    lengths = {len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rows}
    if lengths != {prompt_tokens}:
        raise RuntimeError(f"bench prompts should all be {prompt_tokens} tokens, got lengths {sorted(lengths)}")
    return Dataset.from_dict({"prompt": rows})


def length_mod5_reward(completions, **kwargs):
    """Cheap deterministic reward that varies across random completions: character length modulo 5."""
    return [float(len(text) % 5) for text in completions]


def run_one(trainer_name: str, method: str, completion_length: int, args, tokenizer, config, qlora_dir) -> dict:
    """One bench run; returns its record (see the module docstring)."""
    import torch
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback

    import trl_ext

    cuda = args.device == "cuda"
    recipe_path_error = None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()

    if method == "qlora":
        from trl_ext.models import load_model

        quantization = trl.get_quantization_config(
            trl.ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", dtype="bfloat16")
        )
        try:  # the recipes' path: no device_map, bitsandbytes places the weights
            model = load_model(qlora_dir, dtype="bfloat16", quantization_config=quantization)
        except Exception as error:  # record it, then load as TRL's scripts do
            recipe_path_error = f"{type(error).__name__}: {error}"
            model = load_model(
                qlora_dir, dtype="bfloat16", quantization_config=quantization, device_map=trl.get_kbit_device_map()
            )
    else:
        model = build_model(config, args.device)
    build_s = time.perf_counter() - start

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="gpu_bench-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.num_generations,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=completion_length,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        epsilon=0.2,
        bf16=True,
        use_cpu=not cuda,
        gradient_checkpointing=True,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_vllm=False,
    )
    if trainer_name == "trl_ext":
        grpo_args = trl_ext.GRPOConfig(
            pg_loss_type="grpo_clip",
            normalize_by_std=True,
            length_normalization="masked_mean",
            advantage_eps=1e-4,
            **common,
        )
        trainer_cls = trl_ext.GRPOTrainer
    else:
        grpo_args = trl.GRPOConfig(loss_type="grpo", scale_rewards="group", **common)
        trainer_cls = trl.GRPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, *_, **__):
            sync()
            self._t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            self.step_s.append(time.perf_counter() - self._t0)

    timer = Timer()
    trainer = trainer_cls(
        model=model, reward_funcs=length_mod5_reward, args=grpo_args, processing_class=tokenizer,
        train_dataset=prompts_dataset(tokenizer, args.prompt_tokens, args.steps), peft_config=LoraConfig(**LORA),
        callbacks=[timer],
    )  # fmt: skip
    generate_s: list[float] = []
    generate = trainer._generate  # TRL 1.16's generation entry point (both trainers inherit it)

    def timed_generate(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        sync()
        generate_s.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    generated = [entry["completions/mean_length"] * args.num_generations for entry in logs]
    timed = timer.step_s[1:]
    record = {
        "trainer": trainer_name,
        "method": method,
        "num_generations": args.num_generations,
        "max_completion_length": completion_length,
        "prompt_tokens": args.prompt_tokens,
        "steps": len(timer.step_s),
        "build_s": round(build_s, 3),
        "first_step_s": round(timer.step_s[0], 3) if timer.step_s else None,
        "step_s": [round(s, 3) for s in timer.step_s],
        "median_step_s": round(statistics.median(timed), 3) if timed else None,
        "generate_s": [round(s, 3) for s in generate_s],
        "completion_tokens_per_step": generated,
        "generated_tokens_per_s": round(sum(generated[1:]) / sum(generate_s[1:]), 1)
        if timed and len(generate_s) > 1
        else None,
        "train_tokens_per_s": round(sum(generated[1:]) / sum(timed), 1) if timed else None,
        "loss": [entry.get("loss") for entry in logs],
        "grad_norm": [entry.get("grad_norm") for entry in logs],
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "run_s": None,
    }
    if recipe_path_error is not None:
        record["recipe_load_path_error"] = recipe_path_error
    if cuda:
        GiB = 1024**3
        record["peak_allocated_gib"] = round((torch.cuda.max_memory_allocated() - baseline) / GiB, 3)
        record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 3)
        record["baseline_allocated_gib"] = round(baseline / GiB, 3)
    generate = None  # the timing closure's reference to the trainer, released with it
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    record["run_s"] = round(time.perf_counter() - start, 1)
    return record


def add_estimate(record: dict, spec, memory_estimate) -> None:
    """Put scripts/memory_estimate.py's prediction for the run's settings beside the measured peak."""
    est = memory_estimate.estimate_memory(
        spec, record["method"], record["num_generations"], record["max_completion_length"],
        max_prompt_length=record["prompt_tokens"], per_device_train_batch_size=record["num_generations"],
        steps_per_generation=1, gradient_checkpointing=True, lora_r=LORA["r"], lora_target_modules="all-linear",
    ).as_gib()  # fmt: skip
    record["estimate_gib"] = {k: round(v, 3) for k, v in est.items()}
    # max_memory_allocated holds tensors only: compare it with the estimate less its fixed CUDA-context allowance
    tensors = est["total"] - est["overhead"]
    record["estimate_tensors_gib"] = round(tensors, 3)
    if record.get("peak_allocated_gib") is not None:
        record["measured_over_estimate"] = round(record["peak_allocated_gib"] / tensors, 3)


def plan(args, bnb_ok: bool) -> list[tuple[str, str, int]]:
    """(trainer, method, completion length) in priority order: both trainers at the shortest length (the step-time
    ratio), trl_ext at each longer length (memory against the estimate), QLoRA at the shortest, then the rest."""
    lengths = sorted(args.completion_lengths)
    first = [("trl_ext", "lora", lengths[0]), ("trl", "lora", lengths[0])]
    first += [("trl_ext", "lora", length) for length in lengths[1:]]
    first += [("trl_ext", "qlora", lengths[0])]
    rest = [("trl", "lora", length) for length in lengths[1:]] + [
        ("trl_ext", "qlora", length) for length in lengths[1:]
    ]
    return [r for r in first + rest if r[1] in args.methods and (r[1] != "qlora" or bnb_ok)]


def predicted_s(done: list[dict], length: int) -> float:
    """Time of the next run of this completion length, from the runs so far (0 when nothing is known)."""
    same = [r["run_s"] for r in done if r["max_completion_length"] == length]
    if same:
        return max(same)
    if done:
        last = done[-1]
        return last["run_s"] * length / last["max_completion_length"]
    return 0.0


def markdown(result: dict) -> str:
    rows = [
        "| trainer | method | G | T | median step s | first step s | gen tokens/s | peak alloc GiB | peak reserved GiB "
        "| estimate GiB (tensors / total) | measured / estimate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, f="{:.2f}": "n/a" if v is None else f.format(v)  # noqa: E731
    for r in result["runs"]:
        rows.append(
            f"| {r['trainer']} | {r['method']} | {r['num_generations']} | {r['max_completion_length']} | "
            f"{fmt(r['median_step_s'])} | "
            f"{fmt(r['first_step_s'])} | {fmt(r['generated_tokens_per_s'], '{:.0f}')} | "
            f"{fmt(r.get('peak_allocated_gib'))} | "
            f"{fmt(r.get('peak_reserved_gib'))} | {r['estimate_tensors_gib']:.2f} / {r['estimate_gib']['total']:.2f} | "
            f"{fmt(r.get('measured_over_estimate'))} |"
        )
    rows.append("")
    for key, ratio in result["step_time_ratio_trl_ext_over_trl"].items():
        rows.append(f"- trl_ext / upstream TRL median step time, {key}: {ratio}")
    rows += [f"- skipped: {skipped}" for skipped in result["skipped"]]
    rows.append(
        f"- {result['device']}; {result['model']} ({result['parameters']:,} parameters); {result['total_s']} s in all"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="dry run: tiny Qwen2 model, short prompts/completions")
    parser.add_argument(
        "--tokenizer",
        default=os.environ.get("TRL_EXT_TEST_TOKENIZER_DIR") or None,
        help="tokenizer folder; default $TRL_EXT_TEST_TOKENIZER_DIR, else the embedded one",
    )
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per run (the first is reported apart)")
    parser.add_argument("--num-generations", type=int, default=None, help="G (default 8; --tiny 4)")
    parser.add_argument("--completion-lengths", type=int, nargs="+", default=None, help="default 256 1024; --tiny 8 16")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 256; --tiny 16")
    parser.add_argument("--methods", nargs="+", choices=("lora", "qlora"), default=["lora", "qlora"])
    parser.add_argument(
        "--budget-s", type=float, default=None, help="wall-time budget (default 210 on CUDA, none on CPU)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here (and a .md table beside it)")
    args = parser.parse_args(argv)
    args.num_generations = args.num_generations or (4 if args.tiny else 8)
    args.completion_lengths = args.completion_lengths or ([8, 16] if args.tiny else [256, 1024])
    args.prompt_tokens = args.prompt_tokens or (16 if args.tiny else 256)
    budget = args.budget_s if args.budget_s is not None else (210.0 if args.device == "cuda" else math.inf)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: --device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
    from trl_ext.models import load_tokenizer

    memory_estimate = load_memory_estimate()
    tokenizer = load_tokenizer(args.tokenizer)
    config = model_config(tokenizer, args.tiny)
    spec = memory_estimate.ModelSpec.from_hf_config(config.to_dict(), name="qwen2.5-1.5b" if not args.tiny else "tiny")
    if not args.tiny:
        assert spec == memory_estimate.PRESETS["qwen2.5-1.5b"], "bench config and memory_estimate preset disagree"
    bnb_ok = args.device == "cuda" and importlib.util.find_spec("bitsandbytes") is not None
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "versions": {
            name: package_version(name)
            for name in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets")
        },
        "model": "tiny Qwen2 (dry run)" if args.tiny else "Qwen2.5-1.5B architecture, random weights",
        "parameters": spec.num_parameters(),
        "lora": LORA,
        "budget_s": budget,
        "runs": [],
        "skipped": [],
    }
    if "qlora" in args.methods and not bnb_ok:
        result["skipped"].append(
            "qlora: needs bitsandbytes and a CUDA device" + ("" if args.device == "cuda" else " (CPU dry run)")
        )

    t_start = time.perf_counter()
    qlora_dir = None
    for trainer_name, method, length in plan(args, bnb_ok):
        elapsed = time.perf_counter() - t_start
        need = predicted_s(result["runs"], length)
        if elapsed + need > budget:
            result["skipped"].append(
                f"{trainer_name} {method} T={length}: predicted {need:.0f} s, {elapsed:.0f} of {budget:.0f} s used"
            )
            continue
        if method == "qlora" and qlora_dir is None:
            qlora_dir = tempfile.mkdtemp(prefix="gpu_bench-qwen-")
            build_model(config, args.device).save_pretrained(qlora_dir)
            tokenizer.save_pretrained(qlora_dir)
            gc.collect()
            torch.cuda.empty_cache()
        print(f"== {trainer_name} {method} G={args.num_generations} T={length}", flush=True)
        try:
            record = run_one(trainer_name, method, length, args, tokenizer, config, qlora_dir)
        except Exception as error:  # record and go on: one broken arm must not hide the others' figures
            result["skipped"].append(f"{trainer_name} {method} T={length}: failed with {type(error).__name__}: {error}")
            print(f"   failed: {type(error).__name__}: {error}", flush=True)
            continue
        add_estimate(record, spec, memory_estimate)
        result["runs"].append(record)
        print(
            "   "
            + json.dumps(
                {
                    k: record.get(k)
                    for k in (
                        "median_step_s",
                        "generated_tokens_per_s",
                        "peak_allocated_gib",
                        "estimate_tensors_gib",
                        "run_s",
                    )
                }
            ),
            flush=True,
        )

    ratios = {}
    for r in result["runs"]:
        if r["trainer"] != "trl_ext" or r["median_step_s"] is None:
            continue
        up = next(
            (
                u
                for u in result["runs"]
                if u["trainer"] == "trl"
                and (u["method"], u["max_completion_length"]) == (r["method"], r["max_completion_length"])
            ),
            None,
        )
        if up and up["median_step_s"]:
            ratios[f"{r['method']} T={r['max_completion_length']}"] = round(r["median_step_s"] / up["median_step_s"], 3)
    result["step_time_ratio_trl_ext_over_trl"] = ratios
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    table = markdown(result)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0 if result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
