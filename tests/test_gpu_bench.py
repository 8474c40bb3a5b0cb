"""scripts/gpu_bench.py without a GPU: its model is Qwen2.5-1.5B's shape, and its --device cpu --tiny dry run."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import trl_ext

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_bench_model_has_qwen2_5_1_5b_shape_and_parameter_count(tokenizer):
    bench, estimate = load("gpu_bench"), load("memory_estimate")
    config = bench.model_config(tokenizer, tiny=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    # embeddings 151936 x 1536 (tied) + 28 x (linear 46,792,704 + q/k/v biases 2048 + norms 3072) + final norm 1536
    count = sum(p.numel() for p in model.parameters())
    assert count == 233_373_696 + 28 * (46_792_704 + 2048 + 3072) + 1536 == 1_543_714_304
    assert estimate.ModelSpec.from_hf_config(config.to_dict(), name="qwen2.5-1.5b") == estimate.PRESETS["qwen2.5-1.5b"]
    # LoRA r 16 on the 7 linear layers: 16 x (d_in + d_out) summed = 16 x 34,560 per layer
    assert estimate.PRESETS["qwen2.5-1.5b"].lora_parameters(16) == 28 * 16 * (3072 + 1792 + 1792 + 3072 + 3 * 10496)


@pytest.mark.slow
def test_cpu_dry_run_trains_both_trainers_with_the_same_math(tmp_path, monkeypatch):
    bench = load("gpu_bench")
    out = tmp_path / "bench.json"
    assert (
        bench.main(["--device", "cpu", "--tiny", "--steps", "2", "--completion-lengths", "8", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    runs = {r["trainer"]: r for r in result["runs"]}
    assert set(runs) == {"trl_ext", "trl"}
    for r in runs.values():
        assert r["steps"] == 2 and len(r["generate_s"]) == 2
        assert r["completion_tokens_per_step"] == [4 * 8, 4 * 8]  # EOS suppressed: every completion runs to T
        assert r["generated_tokens_per_s"] > 0 and r["median_step_s"] > 0
        assert 0 < r["estimate_tensors_gib"] < r["estimate_gib"]["total"]
        assert r["trainable_parameters"] == 2 * 16 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))  # LoRA r16, tiny
    # identical math: the same model, seed and samples give the same loss and gradient norm at every step -- up to
    # bf16 rounding (2^-8): under gradient checkpointing trl_ext's log-prob forwards run prompts and completions as
    # one packed sequence (trl_ext.speed.packing), other matmul shapes than TRL's padded rows under bf16 autocast
    # (measured: 3.2e-4 relative on the gradient norm)
    assert runs["trl_ext"]["loss"] == pytest.approx(runs["trl"]["loss"], abs=1e-6)
    assert runs["trl_ext"]["grad_norm"] == pytest.approx(runs["trl"]["grad_norm"], rel=2**-8)
    # with TRL's padded rows (pack_completions=False) the gradient norms agree to the last bit that matters
    unpacked = tmp_path / "unpacked.json"
    monkeypatch.setattr(trl_ext, "GRPOConfig", functools.partial(trl_ext.GRPOConfig, pack_completions=False))
    assert (
        bench.main(["--device", "cpu", "--tiny", "--steps", "2", "--completion-lengths", "8", "--out", str(unpacked)])
        == 0
    )
    plain = {r["trainer"]: r for r in json.loads(unpacked.read_text())["runs"]}
    assert plain["trl_ext"]["grad_norm"] == pytest.approx(plain["trl"]["grad_norm"], rel=1e-6)
    assert plain["trl_ext"]["loss"] == pytest.approx(plain["trl"]["loss"], abs=1e-6)
    assert "lora T=8" in result["step_time_ratio_trl_ext_over_trl"]
    assert any(s.startswith("qlora:") for s in result["skipped"])
    assert "| trl_ext | lora | 4 | 8 |" in out.with_suffix(".md").read_text()
