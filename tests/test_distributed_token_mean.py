"""DAPO's token-level loss on two real processes: trl_ext.GRPOTrainer given an upstream ``trl.GRPOConfig`` with TRL's
default ``loss_type="dapo"`` ends with upstream's weights, under DDP with gradient accumulation.

The test launches this file with ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml`` (gloo on
CPU). In each process the ``__main__`` block trains, one after another from the same saved tiny model and seed:
upstream ``trl.GRPOTrainer`` with ``loss_type="dapo"``, ``trl_ext.GRPOTrainer`` with the same upstream config, and
upstream with ``loss_type="bnpo"`` (the token mean of each process's micro-batch, not of the whole batch). A
generation batch of 16 completions (2 processes x 2 per micro-batch x steps_per_generation 4) feeds 2 optimizer steps
of 2 accumulated micro-batches; completions end early at random, so every micro-batch of every process holds another
number of tokens, and DAPO's denominator (all tokens of the batch, every process) differs from each local one.
Each process writes its digests and the largest weight differences; the test reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import length_mod5_reward, param_digest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"
OUT_ENV = "TRL_EXT_TEST_TOKEN_MEAN_DIR"


def _train(trainer_cls, model_dir: str, tokenizer, loss_type: str, output_dir: Path):
    import torch
    import trl
    from datasets import Dataset

    import trl_ext

    args = trl.GRPOConfig(
        output_dir=str(output_dir),
        loss_type=loss_type,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        optim="sgd",  # the weights move by the gradients themselves: equal weights mean equal gradients
        learning_rate=0.5,
        temperature=1.5,
        # a random model almost never ends early; +14 on the EOS logit (before temperature) ends ~1 token in 5
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 14.0]]},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": [f"Count to {i + 3}:" for i in range(8)]})
    trainer = trainer_cls(
        model=model_dir, reward_funcs=length_mod5_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    if trainer_cls is trl_ext.GRPOTrainer:
        assert trainer.args.advantage_eps == 1e-4  # from_upstream: TRL's hard-coded eps (the course's is 1e-6)
    torch.manual_seed(0)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    tokens = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, param_digest(model), tokens


def _launched(out: Path, model_dir: str) -> None:
    import copy

    import trl
    from accelerate import PartialState

    import trl_ext

    tokenizer = trl_ext.models.load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    upstream, upstream_digest, tokens = _train(trl.GRPOTrainer, model_dir, copy.deepcopy(tokenizer), "dapo", out / "a")
    ours, ours_digest, _ = _train(trl_ext.GRPOTrainer, model_dir, copy.deepcopy(tokenizer), "dapo", out / "b")
    local, _, _ = _train(trl.GRPOTrainer, model_dir, copy.deepcopy(tokenizer), "bnpo", out / "c")
    rank = PartialState().process_index
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "num_processes": PartialState().num_processes,
                "upstream_digest": upstream_digest,
                "ours_digest": ours_digest,
                "ours_vs_upstream": max((ours[n] - upstream[n]).abs().max().item() for n in upstream),
                "bnpo_vs_dapo": max((local[n] - upstream[n]).abs().max().item() for n in upstream),
                "num_tokens": tokens,
            }
        )
    )


if __name__ == "__main__":
    _launched(Path(os.environ[OUT_ENV]), sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402
from tiny import tiny_model_for_tests  # noqa: E402


@pytest.mark.slow
def test_dapo_on_two_processes_with_accumulation_trains_as_upstream(tokenizer, tmp_path):
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
    # DDP: both ranks hold the same weights, for each trainer
    assert ranks[0]["upstream_digest"] == ranks[1]["upstream_digest"]
    assert ranks[0]["ours_digest"] == ranks[1]["ours_digest"]
    for r in ranks:
        assert r["ours_vs_upstream"] < 1e-6
        # the whole batch's token count, not each process's, is the denominator: it shows
        assert r["bnpo_vs_dapo"] > 1e-4
    # the tokens trained differ from a full-length batch (16 x 12 = 192 per generation), so the counts mattered
    assert 0 < ranks[0]["num_tokens"][-1] < 192
