"""recipes/rlhf.py end to end on tiny models: reward model as the GRPO reward, adaptive beta, report and plot."""

import json
import sys
from pathlib import Path

import pytest
import trl
from transformers import LlamaForSequenceClassification

import trl_ext
from trl_ext.functional import adaptive_kl_coefficient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import rlhf  # noqa: E402


@pytest.mark.slow
def test_rlhf_runs_with_a_reward_model_and_adapts_beta(tiny_model, tokenizer, tmp_path):
    policy_dir, rm_dir = tmp_path / "policy", tmp_path / "rm"
    tiny_model.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    reward_model = LlamaForSequenceClassification(tiny_model.config.__class__(**{**tiny_model.config.to_dict(), "num_labels": 1}))
    reward_model.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    out = tmp_path / "out"
    parser = trl.TrlParser((rlhf.RLHFArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    args = parser.parse_args_and_config([
        "--config", str(rlhf.DEFAULT_CONFIG), "--reward_model_path", str(rm_dir), "--model_name_or_path", str(policy_dir),
        "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "4",
        "--report_to", "none",
    ])
    rlhf.main(*args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["n_eval_prompts"] == len(rlhf.prompts_from(rlhf.RLHFArguments.test_file))
    # the reward model scored every completion: train rewards are real numbers, not the 0 of a missing reward
    assert len(metrics["curves"]["reward"]) == 2 and len(metrics["curves"]["kl"]) == 2
    # beta followed the proportional controller from 0.05 (4 samples per step, horizon 100, target 0.02)
    beta = 0.05
    for (_, kl), (_, logged) in zip(metrics["curves"]["kl"], metrics["curves"]["beta"]):
        beta = adaptive_kl_coefficient(beta, kl, 0.02, 100, n_steps=4)
        assert logged == pytest.approx(beta, rel=1e-4)
    assert metrics["beta_final"] == pytest.approx(beta, rel=1e-4)
    assert (out / "rlhf.png").stat().st_size > 10_000
