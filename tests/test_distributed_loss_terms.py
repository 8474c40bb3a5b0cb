"""TRL's entropy mask and adaptive entropy bonus on two real processes: trl_ext.GRPOTrainer given an upstream
``trl.GRPOConfig`` with ``top_entropy_quantile=0.2`` and ``use_adaptive_entropy=True`` ends with upstream's weights,
under DDP with gradient accumulation.

Both options reach across processes: the entropy threshold is the quantile of every process's response-token
entropies (upstream's ``get_high_entropy_mask`` gathers them), and the adaptive controller's entropy is the mean over
every process's micro-batches of the optimizer step (a sum and a count reduced across processes). The test launches
this file with ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml`` (gloo on CPU). In each process
the ``__main__`` block trains, one after another from the same saved tiny model and seed: upstream ``trl.GRPOTrainer``,
``trl_ext.GRPOTrainer`` with the same upstream config, and trl_ext with the threshold taken over this process's
tokens only (what a mask without the gather would do). A generation batch of 16 completions (2 processes x 2 per
micro-batch x steps_per_generation 4) feeds 2 optimizer steps of 2 accumulated micro-batches. Each process writes its
digests, the controller's state and the largest weight differences; the test reads them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import largest_difference, param_digest, tiny_model_reports_of_two_processes, write_rank_report

OUT_ENV = "TRL_EXT_TEST_LOSS_TERMS_DIR"
ENTROPY_OPTIONS = dict(
    top_entropy_quantile=0.2,
    # the entropy (about 10.8 nats) stays below the target: the coefficient grows after every step and is applied
    # from the second step on
    use_adaptive_entropy=True,
    entropy_coef=0.2,
    entropy_coef_delta=0.3,
    entropy_coef_max=0.7,
    entropy_target=50.0,
)


def _local_entropy_mask(entropies, mask, threshold):
    """The entropy mask with the quantile of this process's tokens alone (no gather)."""
    import torch

    local = entropies[mask.bool()].float()
    return (entropies * mask.float() >= torch.quantile(local, threshold)) & mask.bool()


def _train(trainer_cls, model_dir: str, tokenizer, output_dir: Path, local_quantile: bool = False):
    """tests/test_grpo_upstream_options.py's run with the entropy options: weights, digest, the controller's state."""
    from test_grpo_upstream_options import ONE_REWARD, train

    import trl_ext

    trainers = []

    def prepare(trainer):
        trainers.append(trainer)
        if trainer_cls is trl_ext.GRPOTrainer:
            trainer.args.advantage_eps = 1e-4  # TRL hard-codes 1e-4 (trl_ext's default is the course's 1e-6)
        if local_quantile:
            trainer.get_high_entropy_mask = _local_entropy_mask

    _, params, logs = train(trainer_cls, tokenizer, model_dir, output_dir, ONE_REWARD, ENTROPY_OPTIONS, prepare)
    (trainer,) = trainers
    state = {
        "entropy_coef": trainer.entropy_coef,
        "last_world_entropy": trainer._last_world_entropy,
        "logged_entropy_coef": [e["entropy_coef"] for e in logs],
        "policy_loss": [e["policy_loss"] for e in logs],
    }
    return params, param_digest(params), state


def _launched(out: Path, model_dir: str) -> None:
    import trl

    import trl_ext

    tokenizer = trl_ext.models.load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    upstream, upstream_digest, upstream_state = _train(trl.GRPOTrainer, model_dir, tokenizer, out / "a")
    ours, ours_digest, ours_state = _train(trl_ext.GRPOTrainer, model_dir, tokenizer, out / "b")
    local, _, _ = _train(trl_ext.GRPOTrainer, model_dir, tokenizer, out / "c", local_quantile=True)
    report = {"upstream_digest": upstream_digest, "ours_digest": ours_digest}
    report.update(upstream_state=upstream_state, ours_state=ours_state)
    report.update(
        ours_vs_upstream=largest_difference(ours, upstream), local_vs_upstream=largest_difference(local, upstream)
    )
    write_rank_report(out, report)


if __name__ == "__main__":
    _launched(Path(os.environ[OUT_ENV]), sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402


@pytest.mark.slow
def test_entropy_mask_and_adaptive_bonus_on_two_processes_train_as_upstream(tokenizer, tmp_path):
    ranks = tiny_model_reports_of_two_processes(__file__, tokenizer, tmp_path, OUT_ENV, timeout=900)
    assert [r["num_processes"] for r in ranks] == [2, 2]
    # DDP: both ranks hold the same weights, for each trainer
    assert ranks[0]["upstream_digest"] == ranks[1]["upstream_digest"]
    assert ranks[0]["ours_digest"] == ranks[1]["ours_digest"]
    for r in ranks:
        assert r["ours_vs_upstream"] < 1e-6
        # the threshold over both processes' tokens, not each one's, decides the mask: it shows
        assert r["local_vs_upstream"] > 1e-4
        # the controller: the coefficient after each step by hand (0.2 + 0.3, then capped at 0.7), and the entropy
        # of the last step, reduced over both processes: the same on both ranks, and upstream's
        for state in (r["upstream_state"], r["ours_state"]):
            assert state["logged_entropy_coef"] == pytest.approx([0.5, 0.7])
            assert state["entropy_coef"] == pytest.approx(0.7)
        assert r["ours_state"]["last_world_entropy"] == pytest.approx(
            r["upstream_state"]["last_world_entropy"], abs=1e-5
        )
        assert r["ours_state"]["policy_loss"] == pytest.approx(r["upstream_state"]["policy_loss"], abs=1e-6)
    assert ranks[0]["ours_state"]["last_world_entropy"] == ranks[1]["ours_state"]["last_world_entropy"]
    assert 0 < ranks[0]["ours_state"]["last_world_entropy"] < 50.0
