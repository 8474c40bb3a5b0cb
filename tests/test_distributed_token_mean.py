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

import os
import sys
from pathlib import Path

from conftest import largest_difference, param_digest, tiny_model_reports_of_two_processes, write_rank_report

OUT_ENV = "TRL_EXT_TEST_TOKEN_MEAN_DIR"


def _launched(out: Path, model_dir: str) -> None:
    import trl
    from test_grpo_upstream_options import ONE_REWARD, train  # tests/test_grpo_upstream_options.py's settings

    import trl_ext

    tokenizer = trl_ext.models.load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    _, upstream, logs = train(trl.GRPOTrainer, tokenizer, model_dir, out / "a", ONE_REWARD, dict(loss_type="dapo"))
    args, ours, _ = train(trl_ext.GRPOTrainer, tokenizer, model_dir, out / "b", ONE_REWARD, dict(loss_type="dapo"))
    assert args.advantage_eps == 1e-4  # from_upstream: TRL's hard-coded eps (the course's is 1e-6)
    _, local, _ = train(trl.GRPOTrainer, tokenizer, model_dir, out / "c", ONE_REWARD, dict(loss_type="bnpo"))
    report = {"upstream_digest": param_digest(upstream), "ours_digest": param_digest(ours)}
    report.update(ours_vs_upstream=largest_difference(ours, upstream), bnpo_vs_dapo=largest_difference(local, upstream))
    write_rank_report(out, dict(report, num_tokens=[e["num_tokens"] for e in logs if "num_tokens" in e]))


if __name__ == "__main__":
    _launched(Path(os.environ[OUT_ENV]), sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402


@pytest.mark.slow
def test_dapo_on_two_processes_with_accumulation_trains_as_upstream(tokenizer, tmp_path):
    ranks = tiny_model_reports_of_two_processes(__file__, tokenizer, tmp_path, OUT_ENV)
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
