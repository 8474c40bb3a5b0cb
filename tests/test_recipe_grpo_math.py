"""recipes/grpo_math.py end to end on a tiny model, and its zero-argument defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trl
import yaml

import trl_ext

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import grpo_math  # noqa: E402


def test_zero_argument_run_uses_the_cpu_config():
    parser = trl.TrlParser((grpo_math.MathScriptArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(["--config", str(grpo_math.DEFAULT_CONFIG)])
    assert model_args.model_name_or_path is None  # the embedded SmolLM2-135M-Instruct
    assert script_args.dataset_name is None and script_args.num_eval >= 200  # generated arithmetic, >= 200 held out
    # fp32 on purpose (bf16 autocast learned less, see the config); an explicit bf16 key, so trl_ext.runtime keeps it
    assert training_args.use_cpu and not training_args.bf16
    assert yaml.safe_load(grpo_math.DEFAULT_CONFIG.read_text())["bf16"] is False
    assert (training_args.pg_loss_type, training_args.loss_type, training_args.scale_rewards) == ("grpo_clip", "grpo", "group")
    assert training_args.save_strategy == "steps"  # a crash mid-run leaves a loadable checkpoint


@pytest.mark.parametrize("name", ["grpo_math_math.yaml", "grpo_math_gsm8k.yaml"])
def test_gpu_configs_parse(name):
    parser = trl.TrlParser((grpo_math.MathScriptArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    path = grpo_math.DEFAULT_CONFIG.parent / name
    # bf16 and vLLM need a GPU to validate; everything else is checked as written
    assert yaml.safe_load(path.read_text())["use_vllm"] is True
    overrides = ["--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
    script_args, training_args, model_args = parser.parse_args_and_config(["--config", str(path), *overrides])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-Math-1.5B"
    assert script_args.template == "r1_zero" and training_args.pg_loss_type == "reinforce_with_baseline"
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256


@pytest.mark.slow
def test_recipe_runs_on_a_local_gsm8k_file(tiny_model, tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"Ann has {a} apples and buys {a + 3} more. How many now?", "answer": f"{a} + {a + 3}\n#### {2 * a + 3}"} for a in range(1, 13)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", str(ROOT / "recipes" / "grpo_math.py"),
        "--dataset_name", str(data), "--model_name_or_path", str(model_dir), "--max_steps", "2", "--num_eval", "4",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "6",
        "--output_dir", str(out), "--report_to", "none", "--save_steps", "1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # accelerate then exports its default 1
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["n_eval"] == 2  # 12 rows: the last 12 // 5 = 2 held out
    assert 0.0 <= metrics["accuracy_before"] <= 1.0 and 0.0 <= metrics["accuracy_after"] <= 1.0
    assert metrics["reward"] == "gsm8k"
    assert "accuracy" in proc.stdout and "before" in proc.stdout
    assert len((out / "eval_after.jsonl").read_text().splitlines()) == 2
    # every core by default (accelerate exported OMP_NUM_THREADS=1 on its own), and where the time went
    assert metrics["runtime"]["threads_source"].startswith("default") and metrics["runtime"]["threads"] >= 1
    breakdown = metrics["time_breakdown"]
    for phase in ("model_load", "evaluation", "generation", "logprob_forward", "backward", "optimizer"):
        assert breakdown[phase] > 0, phase
    assert breakdown["reward"] >= 0  # a regex over 4 short completions: can round to 0 ms
    assert sum(v for k, v in breakdown.items() if k != "total") == pytest.approx(breakdown["total"], abs=0.02)
    assert "Where the" in proc.stdout
    assert (out / "model.safetensors").exists() and list(out.glob("checkpoint-*"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the saved model loads
