"""recipes/rlhf.py end to end on tiny models: reward model as the GRPO reward, adaptive beta, report and plot; and how
it gets its reward model when none is given (recipes/reward_model.py as a command of its own)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trl
from transformers import LlamaForSequenceClassification

import trl_ext
from trl_ext.cli import RecipeError
from trl_ext.data.preferences import unique_prompts
from trl_ext.functional import adaptive_kl_coefficient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import rlhf  # noqa: E402


@pytest.mark.slow
def test_rlhf_runs_with_a_reward_model_and_adapts_beta(tiny_model, tokenizer, tmp_path):
    policy_dir, rm_dir = tmp_path / "policy", tmp_path / "rm"
    tiny_model.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    reward_model = LlamaForSequenceClassification(
        tiny_model.config.__class__(**{**tiny_model.config.to_dict(), "num_labels": 1})
    )
    reward_model.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    out = tmp_path / "out"
    parser = trl.TrlParser((rlhf.RLHFArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    args = parser.parse_args_and_config(
        [
            "--config",
            str(rlhf.DEFAULT_CONFIG),
            "--reward_model_path",
            str(rm_dir),
            "--model_name_or_path",
            str(policy_dir),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "4",
            "--report_to",
            "none",
        ]
    )
    rlhf.main(*args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == 2 and metrics["n_eval_prompts"] == len(
        unique_prompts(rlhf.RLHFArguments.test_file)
    )
    # the reward model scored every completion: train rewards are real numbers, not the 0 of a missing reward
    assert len(metrics["curves"]["reward"]) == 2 and len(metrics["curves"]["kl"]) == 2
    # beta followed the proportional controller from 0.05 (4 samples per step, horizon 100, target 0.02)
    beta = 0.05
    for (_, kl), (_, logged) in zip(metrics["curves"]["kl"], metrics["curves"]["beta"]):
        beta = adaptive_kl_coefficient(beta, kl, 0.02, 100, n_steps=4)
        assert logged == pytest.approx(beta, rel=1e-4)
    assert metrics["beta_final"] == pytest.approx(beta, rel=1e-4)
    assert (out / "rlhf.png").stat().st_size > 10_000


def test_the_reward_model_is_its_own_command_reused_resumed_or_retrained(tmp_path, monkeypatch, capsys):
    from accelerate import PartialState

    PartialState()  # set up before the launch variables below, which only the reward model's command must not see
    launch = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "ACCELERATE_MIXED_PRECISION": "no",
        "TORCHELASTIC_RUN_ID": "x",
    }
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    commands, status = [], [0]

    def run(command, env):
        commands.append((command, env))
        return subprocess.CompletedProcess(command, status[0])

    monkeypatch.setattr(subprocess, "run", run)
    folder = tmp_path / "reward_model"
    script = [sys.executable, str(ROOT / "recipes" / "reward_model.py"), "--output_dir", str(folder)]
    assert rlhf.train_reward_model(folder) == folder  # nothing there: trained with the recipe's defaults
    ((command, env),) = commands
    assert command == script and not set(launch) & set(env) and env["PATH"] == os.environ["PATH"]
    (folder / "checkpoint-3").mkdir(parents=True)  # cut short: resumed from its own last checkpoint
    rlhf.train_reward_model(folder)
    assert commands[-1][0] == [*script, "--resume_from_checkpoint", "true"]
    (folder / "metrics.json").write_text("{}")  # finished: reused, unless --overwrite_output_dir
    rlhf.train_reward_model(folder)
    assert len(commands) == 2 and f"Reusing the reward model trained before in {folder}" in capsys.readouterr().out
    rlhf.train_reward_model(folder, overwrite=True)
    assert commands[-1][0] == [*script, "--overwrite_output_dir"]
    status[0] = 2
    with pytest.raises(RecipeError) as err:
        rlhf.train_reward_model(folder, overwrite=True)
    assert str(err.value) == (
        f"the reward model's training (recipes/reward_model.py --output_dir {folder} "
        "--overwrite_output_dir) exited with status 2; its messages are above (or pass "
        "--reward_model_path)"
    )


@pytest.mark.slow
def test_a_failing_reward_model_command_is_one_error_line(tmp_path, capfd):
    # the real command, which refuses a folder it cannot create before loading anything
    folder = tmp_path / "reward_model"
    folder.write_text("")
    with pytest.raises(RecipeError) as err:
        rlhf.train_reward_model(folder)
    assert str(err.value) == (
        f"the reward model's training (recipes/reward_model.py --output_dir {folder}) exited with "
        "status 2; its messages are above (or pass --reward_model_path)"
    )
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith(f"error: --output_dir {folder} is not writable")
