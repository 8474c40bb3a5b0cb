"""GPU (or CPU) memory of GRPO training with trl_ext, estimated from first principles.

For a decoder-only transformer (Llama/Qwen2 layout: RMSNorm, grouped-query attention, SwiGLU MLP) trained with
``trl_ext.GRPOTrainer`` on one GPU, the estimate adds up, in bytes:

- weights: full fine-tuning keeps fp32 master weights (4 B/param; bf16 autocast computes); LoRA keeps the frozen
  base in bf16 (2 B/param); QLoRA stores the base's decoder-layer linear weights in 4-bit NF4 (0.5 B/param plus the
  block-wise quantization constants, Dettmers et al. 2023 "QLoRA", section 3: one fp32 absmax per 64 weights,
  or with double quantization one 8-bit absmax per 64 plus one fp32 per 64 x 256) and the rest (embeddings, LM head,
  norms, biases) in bf16;
- trainable state with AdamW: weights (fp32) + gradients (fp32) + two moments (fp32) = 16 B per trainable parameter
  (Rajbhandari et al. 2020 "ZeRO", section 3.1); for LoRA/QLoRA the trainable parameters are the adapters,
  r x (d_in + d_out) per adapted linear layer (Hu et al. 2021 "LoRA"), which PEFT keeps in fp32 -- except on a
  quantized base, where TRL 1.16's trainers cast them to bf16 (QLoRA paper's recommendation), so their weights,
  gradients and AdamW moments (kept in the parameter's dtype) take 2 + 2 + 4 = 8 B; gradients exist only during
  the backward pass (TRL's Trainer frees them at each optimizer step);
- QLoRA's dequantized weight: bitsandbytes' 4-bit layer materializes its weight in the compute dtype for each
  forward and again in the backward (``dequantize_4bit`` then a matmul), one layer at a time: the largest linear
  layer's weight in the compute dtype;
- KV cache while generating (transformers ``generate``): keys and values of every layer for every token of every
  sequence of the generation batch, 2 x layers x kv_heads x head_dim x (prompt + completion) x 2 B per sequence.
  TRL generates the whole generation batch at once: per_device_train_batch_size x steps_per_generation sequences
  (steps_per_generation defaults to gradient_accumulation_steps);
- activations of the training forward/backward on a micro-batch of ``per_device_train_batch_size`` sequences:
  without gradient checkpointing each layer keeps, per token, its two norm inputs and outputs, Q, K, V, the
  attention output and the MLP's gate, up, SiLU and product tensors, 2 x (6 h + 2 h_kv + 4 I) bytes in bf16 (a
  Llama/SwiGLU recount of Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4, with flash/SDPA
  attention so no s^2 scores are kept); with gradient checkpointing (GRPOConfig's default) each layer keeps only its
  bf16 input, and one layer's full activations exist at a time during recomputation;
- LM head: TRL 1.16 computes per-token log-probabilities with a chunked kernel that never builds the full
  (batch, length, vocab) logits (``trl.kernels.chunked_logprob``); its workspace is one bf16 tile of
  min(tokens, 4096) x min(vocab, 32768);
- a reference model only for full fine-tuning with ``beta > 0`` (a second copy of the weights); with LoRA the
  reference is the base with the adapter disabled, which costs nothing;
- vLLM colocate, when asked: vLLM takes ``vllm_gpu_memory_utilization`` x the card's memory for its own bf16 copy of
  the weights and its KV cache, for the whole run (the transformers KV cache is then not needed; vLLM schedules the
  generation batch within its share);
- a fixed 1 GiB for the CUDA context and allocator fragmentation; on the CPU (``--device cpu``) instead the
  process itself -- Python with torch, transformers, TRL, PEFT and bitsandbytes imported: 0.9 GiB measured as max
  RSS (:data:`CPU_PROCESS_BYTES`) -- with the compute dtype the run's (``--dtype float32`` for the CPU recipes:
  the non-quantized weights, the KV cache, activations and the LM-head tile in 4 bytes).

Generation and the backward pass do not overlap, so the peak is the larger of (persistent + KV cache) and
(persistent + gradients + activations + LM-head workspace). The result is an estimate for planning (what fits on a
24 GB card, which knob to turn), not an allocator trace: expect real peaks within roughly +-20%.

    uv run python scripts/memory_estimate.py --model qwen2.5-1.5b --method lora --num-generations 8 \
        --max-completion-length 512
    uv run python scripts/memory_estimate.py --config-json path/to/config.json --method qlora
    uv run python scripts/memory_estimate.py --table          # the table in docs/scaling.md
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

GiB = 1024**3
METHODS = ("full", "lora", "qlora")
BF16 = 2  # bytes
FP32 = 4
CUDA_OVERHEAD_BYTES = 1 * GiB
"""CUDA context, cuBLAS workspaces and allocator fragmentation: a fixed allowance."""
CPU_PROCESS_BYTES = 0.9 * GiB
"""A CPU training process before its model: max RSS of Python 3.11 with torch 2.15, transformers 5.24, TRL 1.16, PEFT
0.21, bitsandbytes 0.50.2 and trl_ext's recipe imported and one matmul run (885 MiB measured, Intel Xeon, 2 cores)."""
NF4_BYTES = 0.5
NF4_CONSTANTS = {False: 4 / 64, True: 1 / 64 + 4 / (64 * 256)}
"""Bytes per 4-bit weight spent on quantization constants, without / with double quantization (QLoRA, section 3)."""
LM_HEAD_TILE = (4096, 32768)
"""(tokens, vocabulary) of one tile of TRL 1.16's chunked log-prob kernel (TOKEN_CHUNK_SIZE, chunk_size)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama/Qwen2-style decoder. ``head_dim`` defaults to ``hidden_size // num_heads``.

    ``qkv_bias``: Qwen2 has biases on the q, k and v projections, Llama none.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{self.name}: {f} must be a positive integer, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"{self.name}: hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "give head_dim"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def layer_linears(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each linear layer of one decoder layer, by the usual module name."""
        h, i, d = self.hidden_size, self.intermediate_size, self.dim_per_head
        return {
            "q_proj": (h, self.num_heads * d),
            "k_proj": (h, self.num_kv_heads * d),
            "v_proj": (h, self.num_kv_heads * d),
            "o_proj": (self.num_heads * d, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_weight_parameters(self) -> int:
        """Weights of the decoder layers' linear layers (what bitsandbytes quantizes; biases excluded)."""
        return self.num_layers * sum(d_in * d_out for d_in, d_out in self.layer_linears().values())

    def num_parameters(self) -> int:
        """All parameters, tied embeddings counted once (as ``sum(p.numel() for p in model.parameters())``)."""
        h, d = self.hidden_size, self.dim_per_head
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        per_layer_other = bias + 2 * h  # q/k/v biases, input and post-attention RMSNorm
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.linear_weight_parameters() + self.num_layers * per_layer_other + h  # + final norm

    def lora_parameters(self, r: int, target_modules: str | list[str] = "all-linear") -> int:
        """LoRA adapter parameters, r x (d_in + d_out) per adapted linear layer (A: d_in x r, B: r x d_out).

        ``target_modules``: "all-linear" (every linear layer of the decoder layers, as PEFT's "all-linear", which
        leaves out the LM head) or a list of module names such as ["q_proj", "v_proj"] (PEFT's default for these
        architectures).
        """
        if r <= 0:
            raise ValueError(f"lora_r must be a positive integer, got {r}")
        linears = self.layer_linears()
        names = list(linears) if target_modules == "all-linear" else list(target_modules)
        unknown = sorted(set(names) - set(linears))
        if unknown:
            raise ValueError(
                f"lora target modules {unknown} are not linear layers of {self.name}; expected 'all-linear' or names "
                f"from {sorted(linears)}"
            )
        return self.num_layers * sum(r * sum(linears[n]) for n in names)

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "custom") -> ModelSpec:
        """Build from a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral and similar layouts)."""
        try:
            return cls(
                name=name,
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=config["num_attention_heads"],
                num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                intermediate_size=config["intermediate_size"],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                head_dim=config.get("head_dim"),
            )
        except KeyError as missing:
            raise ValueError(f"config for {name!r} lacks the field {missing}, needed for the estimate") from None


# Shapes from the models' config.json files on the Hugging Face Hub.
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2-135m", 49152, 576, 30, 9, 3, 1536, tie_word_embeddings=True),
        ModelSpec("qwen2.5-0.5b", 151936, 896, 24, 14, 2, 4864, tie_word_embeddings=True, qkv_bias=True),
        ModelSpec("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 8960, tie_word_embeddings=True, qkv_bias=True),
        ModelSpec("qwen2.5-3b", 151936, 2048, 36, 16, 2, 11008, tie_word_embeddings=True, qkv_bias=True),
        ModelSpec("qwen2.5-7b", 152064, 3584, 28, 28, 4, 18944, tie_word_embeddings=False, qkv_bias=True),
    )
}
"""Qwen2.5-Math-1.5B and Qwen2.5-1.5B-Instruct share qwen2.5-1.5b's shape; the -Instruct models share theirs."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per component; see the module docstring for each formula."""

    weights: float
    adapter_weights: float
    gradients: float
    optimizer_state: float
    reference_model: float
    vllm: float
    kv_cache: float
    activations: float
    lm_head_workspace: float
    overhead: float
    dequantized_weight: float = 0.0

    @property
    def persistent(self) -> float:
        """Held for the whole run: weights, adapters, optimizer state, reference model, vLLM, overhead."""
        return (
            self.weights
            + self.adapter_weights
            + self.optimizer_state
            + self.reference_model
            + self.vllm
            + self.overhead
        )

    @property
    def generation_peak(self) -> float:
        return self.persistent + self.kv_cache + self.dequantized_weight

    @property
    def training_peak(self) -> float:
        return self.persistent + self.gradients + self.activations + self.lm_head_workspace + self.dequantized_weight

    @property
    def total(self) -> float:
        """Peak memory: the larger of the generation and the training phase."""
        return max(self.generation_peak, self.training_peak)

    def as_gib(self) -> dict[str, float]:
        parts = {f.name: getattr(self, f.name) / GiB for f in fields(self)}
        return {
            **parts,
            "generation_peak": self.generation_peak / GiB,
            "training_peak": self.training_peak / GiB,
            "total": self.total / GiB,
        }


def estimate_memory(
    model: ModelSpec,
    method: str,
    num_generations: int,
    max_completion_length: int,
    *,
    max_prompt_length: int = 256,
    per_device_train_batch_size: int | None = None,
    steps_per_generation: int = 1,
    gradient_checkpointing: bool = True,
    lora_r: int = 16,
    lora_target_modules: str | list[str] = "all-linear",
    use_bnb_nested_quant: bool = False,
    beta: float = 0.0,
    vllm_gpu_memory_gib: float | None = None,
    overhead_bytes: float = CUDA_OVERHEAD_BYTES,
    compute_bytes: int = BF16,
) -> MemoryEstimate:
    """Estimate the peak GPU memory of one GRPO training process.

    Args:
        model: the model's shape (``PRESETS[...]`` or ``ModelSpec.from_hf_config``).
        method: "full" (fp32 master weights, bf16 autocast), "lora" (bf16 base) or "qlora" (4-bit NF4 base).
        num_generations: group size G; sets the default micro-batch.
        max_completion_length: completion tokens per sequence.
        max_prompt_length: prompt tokens per sequence (default 256; GSM8K/MATH prompts with a template are
            100-300 tokens).
        per_device_train_batch_size: sequences per training micro-batch; default ``num_generations``.
        steps_per_generation: micro-batches per generation batch (TRL's default: gradient_accumulation_steps);
            transformers generation holds per_device_train_batch_size x steps_per_generation sequences at once.
            Default 1.
        gradient_checkpointing: GRPOConfig's default True.
        lora_r, lora_target_modules: adapter rank and targets (ignored for "full").
        use_bnb_nested_quant: QLoRA double quantization (trl.ModelConfig's ``use_bnb_nested_quant``).
        beta: KL weight; > 0 with "full" adds a reference copy of the weights.
        vllm_gpu_memory_gib: memory given to a colocated vLLM engine (``vllm_gpu_memory_utilization`` x card
            memory); None (default) means generation with transformers.
        overhead_bytes: fixed allowance for the CUDA context and fragmentation (default 1 GiB); on the CPU, the
            process's own memory (``CPU_PROCESS_BYTES``).
        compute_bytes: bytes per element of the run's dtype (default 2, bf16; 4 for ``--dtype float32``): the
            frozen base's non-quantized weights (LoRA/QLoRA), the KV cache, activations, the LM-head tile and
            QLoRA's dequantized weight. Full fine-tuning keeps fp32 master weights either way.

    Returns:
        A ``MemoryEstimate``; ``.total`` is the peak in bytes, ``.as_gib()`` every part in GiB.

    Raises:
        ValueError: unknown ``method``, non-positive sizes, LoRA targets that are not linear layers, or a vLLM
            share too small to hold its bf16 weights and the KV cache of one sequence.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}; expected one of {METHODS}")
    batch = num_generations if per_device_train_batch_size is None else per_device_train_batch_size
    sizes = {
        "num_generations": num_generations,
        "max_completion_length": max_completion_length,
        "max_prompt_length": max_prompt_length,
        "per_device_train_batch_size": batch,
        "steps_per_generation": steps_per_generation,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")

    n = model.num_parameters()
    h, layers = model.hidden_size, model.num_layers
    kv_width = model.num_kv_heads * model.dim_per_head
    seq_len = max_prompt_length + max_completion_length

    if method == "full":
        weights = FP32 * n
        trainable = n
        adapter_weights = 0.0
    else:
        trainable = model.lora_parameters(lora_r, lora_target_modules)
        if method == "lora":
            weights = compute_bytes * n
        else:
            quantized = model.linear_weight_parameters()
            weights = quantized * (NF4_BYTES + NF4_CONSTANTS[use_bnb_nested_quant]) + compute_bytes * (n - quantized)
    trainable_bytes = BF16 if method == "qlora" else FP32  # TRL casts a quantized model's adapters to bf16
    adapter_weights = 0.0 if method == "full" else trainable_bytes * trainable
    gradients = trainable_bytes * trainable
    optimizer_state = 2 * trainable_bytes * trainable
    largest_linear = max(d_in * d_out for d_in, d_out in model.layer_linears().values())
    dequantized_weight = largest_linear * compute_bytes if method == "qlora" else 0.0
    reference_model = weights if (beta > 0 and method == "full") else 0.0

    kv_per_sequence = 2 * layers * kv_width * seq_len * compute_bytes
    kv_cache = kv_per_sequence * batch * steps_per_generation
    vllm = 0.0
    if vllm_gpu_memory_gib is not None:
        needed = BF16 * n + kv_per_sequence
        if vllm_gpu_memory_gib * GiB < needed:
            raise ValueError(
                f"vllm_gpu_memory_gib={vllm_gpu_memory_gib} cannot hold the bf16 weights of {model.name} and the KV "
                f"cache of one sequence ({needed / GiB:.2f} GiB); raise vllm_gpu_memory_utilization"
            )
        vllm = vllm_gpu_memory_gib * GiB
        kv_cache = 0.0  # vLLM's KV cache lives inside its share

    tokens = batch * seq_len
    per_token_layer = compute_bytes * (6 * h + 2 * kv_width + 4 * model.intermediate_size)
    if gradient_checkpointing:
        activations = layers * tokens * h * compute_bytes + tokens * per_token_layer
    else:
        activations = layers * tokens * per_token_layer
    completion_tokens = batch * max_completion_length
    lm_head_workspace = min(completion_tokens, LM_HEAD_TILE[0]) * min(model.vocab_size, LM_HEAD_TILE[1]) * compute_bytes

    return MemoryEstimate(
        weights=weights,
        adapter_weights=adapter_weights,
        gradients=gradients,
        optimizer_state=optimizer_state,
        reference_model=reference_model,
        vllm=vllm,
        kv_cache=kv_cache,
        activations=activations,
        lm_head_workspace=lm_head_workspace,
        overhead=overhead_bytes,
        dequantized_weight=dequantized_weight,
    )


TABLE_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
TABLE_SHAPES = ((8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (16, 1024))  # (num_generations, completion)


def markdown_table(models=TABLE_MODELS, methods=METHODS, shapes=TABLE_SHAPES, **kwargs) -> str:
    """Peak GiB for each model x method (rows) and (group size, completion length) (columns), as markdown."""
    header = "| model | method | " + " | ".join(f"G={g}, T={t}" for g, t in shapes) + " |"
    lines = [header, "|" + "---|" * (len(shapes) + 2)]
    for name in models:
        for method in methods:
            cells = [f"{estimate_memory(PRESETS[name], method, g, t, **kwargs).total / GiB:.1f}" for g, t in shapes]
            lines.append(f"| {name} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", default="qwen2.5-1.5b", choices=sorted(PRESETS), help="preset shape (default qwen2.5-1.5b)"
    )
    source.add_argument("--config-json", type=Path, help="a Hugging Face config.json instead of a preset")
    parser.add_argument("--method", default="lora", choices=METHODS)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--per-device-train-batch-size", type=int, default=None, help="default: --num-generations")
    parser.add_argument("--steps-per-generation", type=int, default=1, help="TRL default: gradient_accumulation_steps")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-target-modules", default="all-linear", help="'all-linear' or comma-separated names")
    parser.add_argument("--use-bnb-nested-quant", action="store_true")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--vllm-gpu-memory-gib", type=float, default=None, help="vLLM colocate share in GiB")
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the process's own memory, not a CUDA context"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the run's --dtype")
    parser.add_argument("--table", action="store_true", help="print the markdown table of docs/scaling.md and exit")
    args = parser.parse_args(argv)

    if args.table:
        print(markdown_table())
        return 0
    spec = (
        PRESETS[args.model]
        if args.config_json is None
        else ModelSpec.from_hf_config(
            json.loads(args.config_json.read_text()), args.config_json.parent.name or "custom"
        )
    )
    targets = (
        args.lora_target_modules if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")
    )
    estimate = estimate_memory(
        spec,
        args.method,
        args.num_generations,
        args.max_completion_length,
        max_prompt_length=args.max_prompt_length,
        per_device_train_batch_size=args.per_device_train_batch_size,
        steps_per_generation=args.steps_per_generation,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        lora_r=args.lora_r,
        lora_target_modules=targets,
        use_bnb_nested_quant=args.use_bnb_nested_quant,
        beta=args.beta,
        vllm_gpu_memory_gib=args.vllm_gpu_memory_gib,
        overhead_bytes=CPU_PROCESS_BYTES if args.device == "cpu" else CUDA_OVERHEAD_BYTES,
        compute_bytes=FP32 if args.dtype == "float32" else BF16,
    )
    print(f"{spec.name}: {spec.num_parameters() / 1e9:.3f} B parameters, method {args.method}")
    for part, gib in estimate.as_gib().items():
        print(f"  {part:<18} {gib:8.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
