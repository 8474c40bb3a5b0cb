"""scripts/memory_estimate.py against hand-worked values and against the parameter counts of real models.

The hand model ("hand" below): vocab V=100, hidden h=8, 2 layers, 2 heads of dim 4, 1 KV head (h_kv = 4),
MLP width I=16, tied embeddings, no biases.

  parameters: embedding 100*8 = 800; per layer q 8*8=64, k 8*4=32, v 32, o 64, gate 8*16=128, up 128, down 128
              (linear weights 576) + 2 norms of 8 = 592; 2 layers = 1184; final norm 8  ->  1992 (1152 linear)
  LoRA r=2, all-linear: r*(d_in+d_out) = q 32, k 24, v 24, o 32, gate 48, up 48, down 48 = 256 per layer -> 512
  prompt 6 + completion 10 = 16 tokens; G = 4 generations; micro-batch B = G = 4 -> 64 training tokens
  KV cache (B x 1 step per generation = 4 sequences): 2 (K,V) * 2 layers * 4 (h_kv) * 2 bytes = 32 B/token * 64 = 2048
  activations per token and layer: 2*(6h + 2h_kv + 4I) = 2*(48 + 8 + 64) = 240 B
      without checkpointing: 2 layers * 64 * 240 = 30720
      with: layer inputs 2 * 64 * 8 * 2 = 2048 + one layer 64 * 240 = 15360 -> 17408
  LM-head tile: min(4*10, 4096) * min(100, 32768) * 2 = 8000
  full:  weights 4*1992 = 7968, gradients 7968, AdamW 8*1992 = 15936
  lora:  weights 2*1992 = 3984, adapters 4*512 = 2048, gradients 2048, AdamW 4096
  qlora: 1152*(0.5 + 4/64) + 840*2 = 648 + 1680 = 2328; nested: 1152*(0.5 + 1/64 + 4/16384) + 1680 = 2274.28125;
         adapters in bf16 (TRL casts them on a quantized base): 2*512 = 1024, gradients 1024, AdamW 4*512 = 2048;
         the largest linear weight dequantized for one forward: gate/up/down 8*16 = 128 * 2 = 256
  fp32 compute (--dtype float32, the CPU recipes): every bf16 size above doubles (KV cache 4096, activations 34816,
         LM-head tile 16000, lora weights 7968, qlora 648 + 3360 = 4008, its dequantized weight 512)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "memory_estimate.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("memory_estimate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_estimate"] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


me = _load_script()
GiB = 1024**3
HAND = me.ModelSpec(
    "hand",
    vocab_size=100,
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=16,
    tie_word_embeddings=True,
)
HAND_SHAPE = dict(num_generations=4, max_completion_length=10, max_prompt_length=6, lora_r=2, overhead_bytes=0)


def hand(method, **overrides):
    return me.estimate_memory(HAND, method, **{**HAND_SHAPE, **overrides})


def test_hand_model_parameter_counts():
    assert HAND.num_parameters() == 1992
    assert HAND.linear_weight_parameters() == 1152
    assert HAND.lora_parameters(2) == 512
    assert HAND.lora_parameters(2, ["q_proj", "v_proj"]) == 2 * (32 + 24)


@pytest.mark.parametrize(
    "method, weights, adapters, gradients, optimizer, total",
    [
        # total = training peak = weights + adapters + optimizer + gradients + 17408 + 8000
        ("full", 7968, 0, 7968, 15936, 7968 + 15936 + 7968 + 17408 + 8000),
        ("lora", 3984, 2048, 2048, 4096, 3984 + 2048 + 4096 + 2048 + 17408 + 8000),
        ("qlora", 2328, 1024, 1024, 2048, 2328 + 1024 + 2048 + 1024 + 17408 + 8000 + 256),
    ],
)
def test_hand_worked_components(method, weights, adapters, gradients, optimizer, total):
    e = hand(method)
    dequantized = 256 if method == "qlora" else 0
    assert e.dequantized_weight == dequantized
    assert e.weights == weights
    assert e.adapter_weights == adapters
    assert e.gradients == gradients
    assert e.optimizer_state == optimizer
    assert e.kv_cache == 2048
    assert e.activations == 17408
    assert e.lm_head_workspace == 8000
    assert e.reference_model == 0 and e.vllm == 0
    assert e.generation_peak == weights + adapters + optimizer + 2048 + dequantized
    assert e.training_peak == total
    assert e.total == total


def test_hand_worked_variants():
    assert hand("qlora", use_bnb_nested_quant=True).weights == pytest.approx(2274.28125)
    assert hand("lora", gradient_checkpointing=False).activations == 30720
    assert hand("full", beta=0.04).reference_model == 7968  # a second fp32 copy
    assert hand("lora", beta=0.04).reference_model == 0  # the adapter is disabled instead
    assert hand("lora", overhead_bytes=me.CUDA_OVERHEAD_BYTES).total == 37584 + GiB


def test_hand_worked_fp32_compute_on_the_cpu():
    e = hand("qlora", compute_bytes=4, overhead_bytes=me.CPU_PROCESS_BYTES)
    assert (e.weights, e.kv_cache, e.activations, e.lm_head_workspace) == (4008, 4096, 34816, 16000)
    assert (e.adapter_weights, e.gradients, e.optimizer_state, e.dequantized_weight) == (1024, 1024, 2048, 512)
    assert e.total == 4008 + 1024 + 2048 + 1024 + 34816 + 16000 + 512 + me.CPU_PROCESS_BYTES
    assert hand("lora", compute_bytes=4).weights == 7968 and hand("full", compute_bytes=4).weights == 7968


def test_generation_phase_can_be_the_peak():
    # micro-batch 1 x 64 steps per generation = 64 sequences of 16 tokens in the KV cache: 64*16*32 = 32768;
    # training micro-batch of 1 sequence: activations 2*16*8*2 + 16*240 = 4352, LM-head tile 10*100*2 = 2000.
    e = hand("lora", per_device_train_batch_size=1, steps_per_generation=64)
    persistent = 3984 + 2048 + 4096
    assert e.kv_cache == 32768
    assert e.activations == 4352
    assert e.lm_head_workspace == 2000
    assert e.training_peak == persistent + 2048 + 4352 + 2000
    assert e.total == e.generation_peak == persistent + 32768


def test_vllm_colocate_share_replaces_the_kv_cache():
    e = hand("lora", vllm_gpu_memory_gib=1.0)
    assert e.vllm == GiB and e.kv_cache == 0
    assert e.total == 3984 + 2048 + 4096 + GiB + 2048 + 17408 + 8000
    # vLLM needs at least its bf16 weights (2*1992) plus one sequence's KV cache (16*32) = 4496 bytes
    assert hand("lora", vllm_gpu_memory_gib=4496 / GiB).vllm == pytest.approx(4496)
    with pytest.raises(ValueError, match="vllm_gpu_memory_gib"):
        hand("lora", vllm_gpu_memory_gib=4400 / GiB)


def test_kv_cache_of_qwen2_5_0_5b_by_hand():
    # 2 * 24 layers * 2 KV heads * 64 dims * 2 bytes = 12288 bytes per token; 8 * (256 + 512) tokens -> 72 MiB
    e = me.estimate_memory(me.PRESETS["qwen2.5-0.5b"], "lora", 8, 512)
    assert e.kv_cache == 12288 * 8 * 768 == 72 * 1024**2
    # TRL generates per_device_train_batch_size x steps_per_generation sequences at once: 8 x 4 = 32
    e = me.estimate_memory(me.PRESETS["qwen2.5-0.5b"], "lora", 8, 512, steps_per_generation=4)
    assert e.kv_cache == 12288 * 32 * 768


def _meta_model(spec):
    config_cls = Qwen2Config if spec.qkv_bias else LlamaConfig
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    with torch.device("meta"):  # shapes only, no memory
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(me.PRESETS))
def test_preset_parameter_counts_match_transformers(name):
    spec = me.PRESETS[name]
    assert sum(p.numel() for p in _meta_model(spec).parameters()) == spec.num_parameters()


@pytest.mark.parametrize("spec", [HAND, me.PRESETS["qwen2.5-0.5b"]], ids=["hand", "qwen2.5-0.5b"])
def test_lora_parameter_count_matches_peft(spec):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_meta_model(spec), LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == spec.lora_parameters(2)


def test_known_published_sizes():
    assert me.PRESETS["qwen2.5-0.5b"].num_parameters() == 494_032_768
    assert me.PRESETS["qwen2.5-7b"].num_parameters() == 7_615_616_512


def test_from_hf_config():
    qwen = {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True,
    }  # fmt: skip
    assert me.ModelSpec.from_hf_config(qwen, "q").num_parameters() == 494_032_768
    llama = {**qwen, "model_type": "llama", "attention_bias": False}
    assert me.ModelSpec.from_hf_config(llama).num_parameters() == 494_032_768 - 24 * (14 + 2 * 2) * 64
    with pytest.raises(ValueError, match="intermediate_size"):
        me.ModelSpec.from_hf_config({k: v for k, v in qwen.items() if k != "intermediate_size"})


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="method="):
        hand("adapter")
    with pytest.raises(ValueError, match="lm_head"):
        HAND.lora_parameters(2, ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="num_generations"):
        hand("lora", num_generations=0)
    with pytest.raises(ValueError, match="steps_per_generation"):
        hand("lora", steps_per_generation=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        me.ModelSpec("bad", 10, 8, 1, 2, 3, 16, tie_word_embeddings=True)


def test_table_and_cli(capsys):
    table = me.markdown_table(models=("qwen2.5-0.5b",), methods=("lora", "qlora"), shapes=((8, 256), (16, 1024)))
    lines = table.splitlines()
    assert len(lines) == 2 + 2
    cell = float(lines[3].split("|")[-2])
    assert cell == round(me.estimate_memory(me.PRESETS["qwen2.5-0.5b"], "qlora", 16, 1024).total / GiB, 1)
    assert me.main(["--model", "qwen2.5-7b", "--method", "qlora", "--num-generations", "8"]) == 0
    out = capsys.readouterr().out
    assert "7.616 B parameters" in out and "total" in out
