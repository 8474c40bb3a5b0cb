"""QLoRA on the CPU, for real: bitsandbytes' CPU backend under trl_ext's trainers and recipes.

The oracle is independent of the code under test: ``bitsandbytes.functional.dequantize_4bit`` turns the stored NF4
codes and block scales back into fp32 weights, and a plain fp32 model (or ``F.linear``) with those weights must give
what the 4-bit model gives. Checked here: the 4-bit layer's forward and backward (odd and block-unaligned shapes
included); that a 4-bit model stays trainable after an evaluation-mode forward (bitsandbytes >= 0.49 would switch an
AVX512-BF16 CPU to a bf16 kernel without backward; trl_ext.quantized); one GRPO and one SFT step on a 4-bit base
that change the adapters and nothing else; the saved adapter loaded back onto a 4-bit and onto an fp32 base; step-0
equality with LoRA on the dequantized fp32 weights; resume; trl_ext's CPU savings on a QLoRA model; 8-bit
(LLM.int8) training; the flag checks; and (slow) recipes/grpo_math.py with --load_in_4bit true --use_peft true.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import trl
from conftest import length_mod5_reward
from datasets import Dataset
from peft import LoraConfig, PeftModel
from test_grpo_trainer import COMMON, generation_batch, loss_and_grads, toy_dataset
from test_resume import check_resume, resume_args
from tiny import tiny_model_for_tests

import trl_ext
from trl_ext import machine, quantized
from trl_ext.models import load_model, load_model_and_tokenizer
from trl_ext.speed.shared_prompts import savings_decision

bnb = pytest.importorskip("bitsandbytes")  # the qlora extra; the dev group installs it on Linux x86_64
from bitsandbytes.functional import dequantize_4bit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def nf4_config(**overrides):
    """What the recipes pass for --load_in_4bit true (trl.get_quantization_config), fp32 compute (--dtype float32)."""
    return trl.get_quantization_config(trl.ModelConfig(load_in_4bit=True, dtype="float32", **overrides))


def no_autograd_fallback(caught):
    """torch's warning when a backward runs through bitsandbytes' gemv_4bit, which has no autograd kernel."""
    return [w for w in caught if "autograd kernel was not registered" in str(w.message)]


def dequantized_twin(model_4bit, model_dir):
    """A plain fp32 model from ``model_dir`` whose linear weights are the 4-bit model's, dequantized by bitsandbytes
    (the oracle: what the NF4 base computes, without bitsandbytes' layer)."""
    twin = load_model(model_dir)
    layers = dict(quantized.linear4bit_modules(model_4bit))
    assert len(layers) == 2 * len(LINEARS)
    with torch.no_grad():
        for name, layer in layers.items():
            weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
            twin.get_submodule(name.replace(".base_layer", "")).weight.copy_(weight)
    return twin


# ----------------------------------------------------------------------------------------------------------------
# The layers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape, bias", [((128, 64), False), ((37, 19), True)])  # 37 x 19 = 703: not whole blocks
def test_4bit_layer_forward_and_backward_are_the_dequantized_weights(quant_type, shape, bias):
    """F.linear(x, dequantize_4bit(W)) exactly, forward and input gradient; also after an evaluation-mode forward,
    once trl_ext.quantized.keep_trainable has run (without it, an AVX512-BF16 CPU would switch to bf16 there)."""
    d_in, d_out = shape
    plain = torch.nn.Linear(d_in, d_out, bias=bias)
    layer = bnb.nn.Linear4bit(d_in, d_out, bias=bias, compute_dtype=torch.float32, quant_type=quant_type)
    layer.load_state_dict(plain.state_dict())
    layer = layer.to("cpu")  # quantizes
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == (d_in * d_out + 1) // 2
    weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    assert weight.shape == (d_out, d_in)
    assert 0 < (weight - plain.weight).abs().max() < 0.25 * plain.weight.abs().max()  # quantized, not garbage
    assert quantized.keep_trainable(layer) == 1 and quantized.keep_trainable(layer) == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, d_in, generator=g, requires_grad=True)
    grad_out = torch.randn(3, 5, d_out, generator=g)
    for mode in ("train", "after an evaluation-mode forward"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(x)
            (out * grad_out).sum().backward()
        assert not no_autograd_fallback(caught), mode
        expected = torch.nn.functional.linear(x.detach(), weight, None if layer.bias is None else layer.bias.detach())
        assert torch.equal(out.detach(), expected), mode
        assert torch.equal(x.grad, grad_out.view(-1, d_out).matmul(weight).view_as(x)), mode
        x.grad = None
        layer.eval()
        with torch.no_grad():
            layer(x.detach()[:1, :1])  # one token: the shape bitsandbytes' CPU inference kernel serves
        layer.train()
        assert not quantized.is_repacked(layer)


@pytest.mark.skipif(not bnb.functional.has_avx512bf16(), reason="bitsandbytes repacks only on AVX512-BF16 CPUs")
def test_a_layer_repacked_before_trl_ext_saw_it_is_refused_with_the_reason():
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32).to("cpu")
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(1, 64))  # what bitsandbytes does on its own: repack for the bf16 inference kernel
    assert quantized.is_repacked(layer)
    with pytest.raises(ValueError, match=r"^the 4-bit layer '' \(1 of 1\) was repacked by bitsandbytes for its CPU"):
        quantized.keep_trainable(layer)


def test_8bit_layer_trains_on_the_dequantized_int8_weights():
    """LLM.int8 on the CPU: in training, bitsandbytes computes F.linear(x, CB * SCB / 127) (MatMul8bitFp) and its
    input gradient; the int8 weights stay as loaded."""
    plain = torch.nn.Linear(64, 32, bias=False)
    layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.load_state_dict(plain.state_dict())
    layer = layer.to("cpu").train()
    codes = layer.weight.data.clone()
    assert codes.dtype == torch.int8
    scales = layer.weight.SCB.float()
    weight = codes.float().mul_(scales.unsqueeze(1).mul(1.0 / 127.0))  # the row-wise absmax code, by hand
    assert (weight - plain.weight).abs().max() <= plain.weight.abs().max() / 127
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g, requires_grad=True)
    grad_out = torch.randn(4, 32, generator=g)
    out = layer(x)
    (out * grad_out).sum().backward()
    torch.testing.assert_close(out, x.detach() @ weight.T, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, grad_out @ weight, atol=1e-6, rtol=1e-6)
    assert torch.equal(layer.weight.data, codes)


# ----------------------------------------------------------------------------------------------------------------
# Training on a 4-bit base: GRPO and SFT steps, the saved adapter, step 0 against the fp32 oracle
# ----------------------------------------------------------------------------------------------------------------


def base_state(model):
    """Every tensor of the model that is not a LoRA adapter (the 4-bit layers' codes and block scales included), by
    its name in the bare model (PEFT's wrapper adds ``base_model.model.`` and ``.base_layer``)."""
    state = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): t.detach().clone()
        for n, t in model.state_dict().items()
        if "lora_" not in n
    }
    assert state
    return state


def qlora_args(model_dir, **overrides):
    return trl.ModelConfig(
        model_name_or_path=str(model_dir),
        load_in_4bit=True,
        use_peft=True,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_target_modules=["all-linear"],
        **overrides,
    )


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tokenizer):
    """Two QLoRA GRPO steps through the recipes' loading path, after an evaluation-mode generate (what a recipe's
    before-evaluation does), then saved: the trainer, the base before training and the folders."""
    root = tmp_path_factory.mktemp("qlora")
    model_dir = root / "tiny"
    tiny_model_for_tests(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    model, tok, peft_config = load_model_and_tokenizer(qlora_args(model_dir), padding_side="left")
    model.eval()
    with torch.no_grad():
        model.generate(**tok(["Count to 3:"], return_tensors="pt"), max_new_tokens=2, do_sample=False)
    before = base_state(model)
    args = trl_ext.GRPOConfig(output_dir=str(root / "out"), **COMMON)
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    trainer = trl_ext.GRPOTrainer(
        model=model,
        reward_funcs=length_mod5_reward,
        args=args,
        train_dataset=toy_dataset(),
        processing_class=tok,
        peft_config=peft_config,
    )
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    trainer.save_model(str(root / "out"))
    return dict(
        trainer=trainer,
        before=before,
        adapters=adapters,
        warnings=caught,
        model_dir=model_dir,
        out=root / "out",
        tokenizer=tok,
    )


def test_a_qlora_grpo_step_trains_the_adapters_on_a_really_quantized_base(qlora_run):
    trainer = qlora_run["trainer"]
    model = trainer.model
    assert trainer.state.global_step == 2 and not no_autograd_fallback(qlora_run["warnings"])
    layers = quantized.linear4bit_modules(model)
    assert sorted({name.rsplit(".", 2)[-2] for name, _ in layers}) == sorted(LINEARS) and len(layers) == 14
    for name, layer in layers:
        assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad, name
        assert layer.weight.quant_state.quant_type == "nf4" and not quantized.is_repacked(layer), name
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(qlora_run["adapters"]) and len(trainable) == 2 * 14
    assert all("lora_A" in n or "lora_B" in n for n in trainable)
    after = base_state(model)
    assert after.keys() == qlora_run["before"].keys()
    for name, tensor in after.items():  # the quantized codes, their block scales, embeddings, norms: untouched
        assert torch.equal(tensor, qlora_run["before"][name]), name
    for name, start in qlora_run["adapters"].items():  # every adapter learned (B in step 1, A once B is not 0)
        assert not torch.equal(model.get_parameter(name).detach(), start), name


def test_the_saved_adapter_loads_onto_a_4bit_and_an_fp32_base_and_evaluates(qlora_run):
    out, model_dir, tok = qlora_run["out"], qlora_run["model_dir"], qlora_run["tokenizer"]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    trained = qlora_run["trainer"].model.eval()
    ids = tok(["Count to 3:", "Count to 12345:"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = trained(**ids).logits
        base_only = load_model(model_dir, quantization_config=nf4_config())(**ids).logits
        # onto a 4-bit base: PEFT loads the adapter (saved in bf16, as TRL trains QLoRA adapters) into fp32 layers
        upcast = PeftModel.from_pretrained(load_model(model_dir, quantization_config=nf4_config()), out).eval()
        trained_adapters = {n: p for n, p in trained.named_parameters() if "lora_" in n}
        loaded_adapters = {n: p for n, p in upcast.named_parameters() if "lora_" in n}
        assert trained_adapters.keys() == loaded_adapters.keys() and len(loaded_adapters) == 28
        for name, param in loaded_adapters.items():
            assert param.dtype == torch.float32 and torch.equal(param, trained_adapters[name].float()), name
        # cast back to bf16 as the trainer had them: the very computation of the trained model
        same = copy.deepcopy(upcast)
        for name, param in same.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(torch.bfloat16)
        assert torch.equal(same(**ids).logits, want)
        lora_effect = (want - base_only).abs().max()
        assert lora_effect > 1e-3  # the adapter changes the logits ...
        assert (upcast(**ids).logits - want).abs().max() < 0.05 * lora_effect  # ... and the LoRA branch's bf16 barely
        # onto the fp32 base holding the dequantized NF4 weights (the oracle): what the 4-bit base computes
        twin = PeftModel.from_pretrained(dequantized_twin(same.base_model.model, model_dir), out).eval()
        torch.testing.assert_close(twin(**ids).logits, upcast(**ids).logits, atol=1e-5, rtol=1e-5)
        # onto the original fp32 base (what a GPU user merges into): loads and evaluates, within NF4's rounding
        fp32 = PeftModel.from_pretrained(load_model(model_dir), out).eval()
        assert torch.isfinite(fp32(**ids).logits).all()
    prompts = ["Count to 3:", "Count to 4:"]
    answers = trl_ext.eval.generate_completions(same, tok, prompts, 6, disable_progress=True)
    assert answers == trl_ext.eval.generate_completions(trained, tok, prompts, 6, disable_progress=True)
    assert all(isinstance(a, str) for a in trl_ext.eval.generate_completions(fp32, tok, prompts, 6))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir) and config["r"] == 8


def test_step_0_loss_on_nf4_equals_lora_on_the_dequantized_fp32_weights(tokenizer, tiny_model_dir, tmp_path):
    """SFT's held-out loss at step 0 (trl_ext.SFTTrainer.evaluate): LoRA on the NF4 base and LoRA on a plain fp32
    model holding bitsandbytes' dequantized weights agree to 1e-6 (measured: bit-identical; both compute
    F.linear(x, W) with the same fp32 W, and a fresh adapter adds exactly 0); the original fp32 weights do not."""
    data = Dataset.from_dict({"prompt": ["Say hi.\n", "Add 2 and 3.\n"], "completion": ["Hi there!", "5."]})
    qlora, _, _ = load_model_and_tokenizer(qlora_args(tiny_model_dir))
    losses = {}
    for name, model in (
        ("nf4", qlora),
        ("dequantized fp32", dequantized_twin(qlora, tiny_model_dir)),
        ("original fp32", load_model(tiny_model_dir)),
    ):
        args = trl_ext.SFTConfig(
            output_dir=str(tmp_path / name), report_to="none", use_cpu=True, bf16=False, per_device_eval_batch_size=2
        )
        torch.manual_seed(0)
        trainer = trl_ext.SFTTrainer(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=data,
            processing_class=copy.deepcopy(tokenizer),
            peft_config=LoraConfig(**LORA),
        )
        losses[name] = trainer.evaluate()["eval_loss"]
    assert abs(losses["nf4"] - losses["dequantized fp32"]) <= 1e-6, losses
    assert abs(losses["nf4"] - losses["original fp32"]) > 1e-4, losses  # the oracle sees the quantization


def test_a_qlora_sft_step_trains_only_the_adapters(tokenizer, tiny_model_dir, tmp_path):
    model, tok, peft_config = load_model_and_tokenizer(qlora_args(tiny_model_dir))
    before = base_state(model)
    data = Dataset.from_dict({"prompt": ["Say hi.\n", "Add 2 and 3.\n"] * 2, "completion": ["Hi there!", "5."] * 2})
    args = trl_ext.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        safety_penalty_weight=0.0,
    )
    torch.manual_seed(0)
    trainer = trl_ext.SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft_config
    )
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(adapters) == 28
    trainer.train()
    for name, tensor in base_state(trainer.model).items():
        assert torch.equal(tensor, before[name]), name
    for name, start in adapters.items():
        assert not torch.equal(trainer.model.get_parameter(name).detach(), start), name
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e][-1] > 0


@pytest.mark.slow
def test_a_resumed_qlora_grpo_run_ends_bit_identical_to_the_uninterrupted_one(tokenizer, tiny_model_dir, tmp_path):
    """As tests/test_resume.py for the fp32 paths: stopped after its checkpoint at step 2 of 3 and resumed, the run
    ends with the same adapters (bf16, as TRL keeps QLoRA adapters) and the same logs, bit for bit."""
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"

    def build(output_dir, callbacks):
        model = load_model(tiny_model_dir, quantization_config=nf4_config())
        args = trl_ext.GRPOConfig(
            **resume_args(
                output_dir,
                3,
                2,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=8,
                learning_rate=1e-2,
                temperature=1.5,
            )
        )
        torch.manual_seed(0)
        return trl_ext.GRPOTrainer(
            model=model,
            reward_funcs=length_mod5_reward,
            args=args,
            train_dataset=toy_dataset(),
            processing_class=tok,
            peft_config=LoraConfig(**LORA),
            callbacks=callbacks,
        )

    straight, _ = check_resume(build, tmp_path, max_steps=3, stop_at=2)
    assert (tmp_path / "stopped" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert {p.dtype for p in straight.model.parameters() if p.requires_grad} == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------------
# trl_ext's CPU savings on a QLoRA model: exact or off
# ----------------------------------------------------------------------------------------------------------------


def test_savings_on_a_qlora_model_are_on_and_exact(tokenizer, tiny_model_dir, tmp_path):
    """share_prompt_cache, pack_completions and skip_zero_advantage_rows on a 4-bit base with active adapters (B set
    to random values): the probe turns sharing (generation) and skipping on, the one-sequence log-prob forward off
    (bitsandbytes rounds by shape), and loss and every adapter gradient equal the plain path's;
    prepack_linear_weights packs no 4-bit layer and leaves generation unchanged."""
    runs, batch = {}, None
    for savings in (True, False):
        torch.manual_seed(0)
        trainer = trl_ext.GRPOTrainer(
            model=load_model(tiny_model_dir, quantization_config=nf4_config()),
            reward_funcs=length_mod5_reward,
            args=trl_ext.GRPOConfig(
                output_dir=str(tmp_path / str(savings)),
                **COMMON,
                beta=0.0,
                share_prompt_cache=savings,
                pack_completions=savings,
                skip_zero_advantage_rows=savings,
                prepack_linear_weights=savings,
            ),
            train_dataset=toy_dataset(),
            processing_class=copy.deepcopy(tokenizer),
            peft_config=LoraConfig(**LORA),
        )
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.05)
        # gradient checkpointing is on (prepare_model_for_kbit_training): the log-prob forwards could share prompts
        # only in the one-sequence forward, which is off on bitsandbytes layers (they round by the matmul's shape)
        assert trainer._savings_now() == (savings, savings, False)
        if savings:
            assert "bitsandbytes' quantized layers" in (savings_decision(trainer.model).sequence or "")
        if savings:
            packer, packed = trainer._packed_linear, []
            packed_for = packer._packed_for
            packer._packed_for = lambda module, rows, seen=packed, pack=packed_for: (  # packed now
                seen.append(module) or pack(module, rows)
            )
            batch = generation_batch(trainer)  # sampled with the shared prompt cache and the packed weights
            names = {id(m): n for n, m in trainer.model.named_modules()}
            assert {names[id(m)] for m in packed} == {"base_model.model.lm_head"}  # no 4-bit layer, no bf16 adapter
        else:
            again = generation_batch(trainer)  # the same draws without any saving: the same completions
            assert torch.equal(again["completion_ids"], batch["completion_ids"])
        inputs = dict(batch, advantages=torch.tensor([0.0, 1.5, 0.0, -0.5]))  # rows 0 and 2 skipped with savings
        runs[savings] = loss_and_grads(trainer, inputs)
    (loss, grads), (loss_plain, grads_plain) = runs[True], runs[False]
    torch.testing.assert_close(loss, loss_plain, atol=1e-7, rtol=1e-6)
    assert loss != 0 and grads.keys() == grads_plain.keys() and len(grads) == 28
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.gpu
def test_a_qlora_grpo_step_on_the_gpu(tokenizer, tiny_model_dir, tmp_path):
    """What a GPU user runs: --load_in_4bit --use_peft with bf16 compute; bitsandbytes places the 4-bit base on the
    GPU itself. One step changes every adapter and no base tensor (scripts/gpu_check.sh runs it first; on the CPU
    only with TRL_EXT_GPU_TESTS_ON_CPU=1)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_args = qlora_args(tiny_model_dir, dtype="bfloat16")
    model, tok, peft_config = load_model_and_tokenizer(model_args, padding_side="left")
    layers = quantized.linear4bit_modules(model)
    assert len(layers) == 14 and {layer.weight.device.type for _, layer in layers} == {device}
    before = base_state(model)
    args = trl_ext.GRPOConfig(
        output_dir=str(tmp_path), **{**COMMON, "max_steps": 1, "bf16": True, "use_cpu": device == "cpu"}
    )
    torch.manual_seed(0)
    trainer = trl_ext.GRPOTrainer(
        model=model,
        reward_funcs=length_mod5_reward,
        args=args,
        train_dataset=toy_dataset(),
        processing_class=tok,
        peft_config=peft_config,
    )
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert trainer.state.global_step == 1 and len(lora_b) == 14
    for name, tensor in base_state(trainer.model).items():
        assert torch.equal(tensor, before[name]), name
    for name, start in lora_b.items():  # step 1 moves B (A's gradient is 0 while B is 0)
        param = trainer.model.get_parameter(name)
        assert param.device.type == device and not torch.equal(param.detach(), start), name


# ----------------------------------------------------------------------------------------------------------------
# 8-bit, and the flag checks
# ----------------------------------------------------------------------------------------------------------------


def test_a_qlora_8bit_grpo_step_trains_only_the_adapters(tokenizer, tiny_model_dir, tmp_path):
    model, tok, peft_config = load_model_and_tokenizer(
        trl.ModelConfig(
            model_name_or_path=tiny_model_dir,
            load_in_8bit=True,
            use_peft=True,
            lora_dropout=0.0,
            lora_target_modules=["all-linear"],
        ),
        padding_side="left",
    )
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(layers) == 14 and all(m.weight.dtype == torch.int8 for m in layers)
    before = base_state(model)
    torch.manual_seed(0)
    trainer = trl_ext.GRPOTrainer(
        model=model,
        reward_funcs=length_mod5_reward,
        args=trl_ext.GRPOConfig(output_dir=str(tmp_path), **COMMON),
        train_dataset=toy_dataset(),
        processing_class=tok,
        peft_config=peft_config,
    )
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    for name, tensor in base_state(trainer.model).items():
        if not name.endswith(".SCB"):  # bitsandbytes keeps the scales on the weight too; compared there
            assert torch.equal(tensor, before[name]), name
    for name, start in adapters.items():
        assert not torch.equal(trainer.model.get_parameter(name).detach(), start), name


def test_the_qlora_flags_pass_the_checks_on_a_cpu(monkeypatch, tmp_path):
    """With the locked bitsandbytes nothing of the QLoRA flag set is refused on a CPU; with an older one, exactly what
    it cannot do there, in one message naming each flag."""
    import importlib.metadata

    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_math

    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    flags = ["--load_in_4bit", "true", "--use_peft", "true", "--output_dir", str(tmp_path / "out")]
    flags += ["--bnb_4bit_quant_type", "fp4", "--optim", "paged_adamw_8bit"]
    _, _, model_args = grpo_math.main.parse_args(flags)
    assert model_args.load_in_4bit and model_args.use_peft
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "0.46.1" if n == "bitsandbytes" else real(n))
    with pytest.raises(trl_ext.cli.RecipeError) as err:
        grpo_math.main.parse_args(flags)
    extra = machine.QLORA_EXTRA
    assert str(err.value) == (
        "2 problems with the options (found before loading any model):\n"
        "  --bnb_4bit_quant_type fp4: bnb_4bit_quant_type fp4 on a CPU needs bitsandbytes >= 0.47.0, installed is "
        f"0.46.1 (RuntimeError: quant_type must be nf4 on CPU, got fp4); {extra}; pass `--bnb_4bit_quant_type nf4`\n"
        "  --optim paged_adamw_8bit: bitsandbytes optimizers on a CPU needs bitsandbytes >= 0.50.0, installed is "
        "0.46.1 (RuntimeError: All input tensors need to be on the same GPU, but found some tensors to not be on a "
        f"GPU); {extra}; pass `--optim adamw_torch`"
    )


def test_the_bitsandbytes_optimizers_are_transformers_own_list():
    from transformers.trainer_optimizer import _BITSANDBYTES_OPTIMIZERS

    assert machine.BITSANDBYTES_OPTIMIZERS == {o.value for o in _BITSANDBYTES_OPTIMIZERS}


# ----------------------------------------------------------------------------------------------------------------
# The recipe, end to end
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_math_trains_qlora_on_the_cpu_and_resumes(tiny_model, tokenizer, tmp_path):
    """recipes/grpo_math.py --load_in_4bit true --use_peft true: 2 steps with a checkpoint after each, an adapter
    saved and evaluated; then the same run killed after its first checkpoint and resumed with
    --resume_from_checkpoint true ends with the same adapter, bit for bit."""
    from safetensors.torch import load_file
    from test_recipe_grpo_math import _recipe_flags, _tiny_setup, _wait_for

    model_dir, data = _tiny_setup(tiny_model, tokenizer, tmp_path)
    qlora = ("--load_in_4bit", "true", "--use_peft", "true", "--lora_target_modules", "all-linear")
    flags = ("--save_steps", "1", "--report_to", "none", "--logging_steps", "1", *qlora)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def run(out, *extra):
        cmd = [sys.executable, *_recipe_flags(model_dir, data, out, *flags, *extra)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    straight = run(tmp_path / "straight", "--max_steps", "2")
    out = tmp_path / "straight"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["config"]["model_args"]["load_in_4bit"] is True
    assert 0.0 <= metrics["accuracy_after"] <= 1.0 and "eval_after" in metrics["phase_seconds"]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert "autograd kernel was not registered" not in straight.stderr
    assert "bf16 CPU inference kernel for 4-bit layers is off" in straight.stderr
    cut = tmp_path / "cut"
    killed = subprocess.Popen(
        [sys.executable, *_recipe_flags(model_dir, data, cut, *flags, "--max_steps", "2")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    _wait_for(cut / "checkpoint-1" / "trainer_state.json", killed)  # written last: the checkpoint is complete
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    run(cut, "--max_steps", "2", "--resume_from_checkpoint", "true")
    assert json.loads((cut / "metrics.json").read_text())["resumed_from"] == str(cut / "checkpoint-1")
    a = load_file(out / "adapter_model.safetensors")
    b = load_file(cut / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 28
    for name in a:
        assert torch.equal(a[name], b[name]), name
