"""TRL's ``scale_rewards="batch"`` on two real processes, with a group split between them (issue 45): the std that
scales every advantage is the std of the whole generation batch -- both processes' rewards, gathered -- as upstream
``trl.GRPOTrainer`` (1.16) computes it, not of one process's rewards.

The test launches this file with ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml`` (gloo on
CPU). In each process the ``__main__`` block builds ``trl_ext.GRPOTrainer`` from an upstream ``trl.GRPOConfig`` with
``scale_rewards="batch"`` and scores one generation batch of 3 groups of 4 (process 0 holds group A and the first
half of group B, process 1 the second half of B and group C), and writes the rewards its reward function saw and the
advantages it got. The test computes the advantages independently, in NumPy over the 12 rewards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"
OUT_ENV = "TRL_EXT_TEST_BATCH_STD_DIR"
PROMPTS = ["Count to 3:"] * 4 + ["Count to 4:"] * 4 + ["Count to 5:"] * 4  # 3 groups of 4, in order
EPS = 1e-4  # TRL 1.16's scale_rewards='batch' adds 1e-4 (hard-coded); trl_ext's advantage_eps default on its config


def _launched(out: Path, model_dir: str) -> None:
    import trl
    from accelerate import PartialState
    from datasets import Dataset

    import trl_ext

    seen: list[float] = []

    def characters(completions, **kwargs) -> list[float]:
        rewards = [float(len(c)) for c in completions]
        seen.extend(rewards)
        return rewards

    tokenizer = trl_ext.models.load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    args = trl.GRPOConfig(
        output_dir=str(out / "run"),
        scale_rewards="batch",
        per_device_train_batch_size=3,
        num_generations=4,
        steps_per_generation=2,  # generation batch: 2 processes x 3 x 2 = 12 completions, 3 groups
        max_completion_length=8,
        temperature=1.5,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = trl_ext.GRPOTrainer(
        model=model_dir,
        reward_funcs=characters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    rank = PartialState().process_index
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[6 * rank : 6 * rank + 6]])
    report = {
        "num_processes": PartialState().num_processes,
        "estimator": str(trainer.args.advantage_estimator),
        "advantage_eps": trainer.args.advantage_eps,
        "rewards": seen,
        "advantages": inputs["advantages"].tolist(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _launched(Path(os.environ[OUT_ENV]), sys.argv[1])
    sys.exit(0)


import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tiny import tiny_model_for_tests  # noqa: E402


@pytest.mark.slow  # ~80 s here: two processes each load torch, TRL and a model
def test_batch_std_is_the_std_of_both_processes_rewards_with_a_group_split_between_them(tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model_for_tests(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    env = {**os.environ, OUT_ENV: str(tmp_path), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), __file__, str(model_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"accelerate launch exited with {proc.returncode}\n--- stderr ---\n{proc.stderr[-8000:]}")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert ranks[0]["estimator"] == "batch_std" and ranks[0]["advantage_eps"] == EPS
    assert [len(r["rewards"]) for r in ranks] == [6, 6]  # each process scored its own 6 completions

    # independently: group means over consecutive blocks of 4 of the 12 rewards in process order, divided by the
    # unbiased std of all 12 (torch.std's default, TRL's nanstd) + 1e-4
    rewards = np.array(ranks[0]["rewards"] + ranks[1]["rewards"], dtype=np.float64)
    centred = rewards - np.repeat(rewards.reshape(3, 4).mean(axis=1), 4)
    expected = centred / (rewards.std(ddof=1) + EPS)
    got = np.array(ranks[0]["advantages"] + ranks[1]["advantages"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    # the case tells the rules apart: the split group B's mean needs both processes' rewards, and a std of one
    # process's rewards would give other advantages
    assert len(set(rewards[4:8])) > 1 and rewards[4:6].mean() != rewards[4:8].mean()
    for r in range(2):
        local = centred[6 * r : 6 * r + 6] / (rewards[6 * r : 6 * r + 6].std(ddof=1) + EPS)
        assert np.abs(local - expected[6 * r : 6 * r + 6]).max() > 1e-3, r
