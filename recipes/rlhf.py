"""The RLHF loop of the course supplement: a Bradley-Terry reward model, then GRPO against it with adaptive KL.

    uv run accelerate launch recipes/rlhf.py                          # CPU: embedded model, bundled pairs, minutes
    uv run accelerate launch recipes/rlhf.py --reward_model_path outputs/reward_model   # reuse a trained reward model

1. Reward model: loaded from --reward_model_path, or trained now by recipes/reward_model.py (its default config).
2. Policy: trl_ext.GRPOTrainer with the reward model as its reward function (TRL scores prompt + completion with a
   sequence-classification model) and the adaptive KL coefficient (kl_target, Ziegler et al. 2019).
3. Report: reward-model score of greedy answers to held-out prompts before/after, KL to the reference and beta over
   training; metrics.json and rlhf.png in --output_dir.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.recipe_utils import parse_recipe_args  # noqa: E402
from trl_ext.data.preferences import load_preference_rows  # noqa: E402
from trl_ext.eval import generate_completions  # noqa: E402
from trl_ext.models import load_tokenizer, resolve_model_name_or_path  # noqa: E402
from trl_ext.experiment import write_recipe_record

HERE = Path(__file__).parent
DEFAULT_CONFIG = HERE / "configs" / "rlhf.yaml"


@dataclass
class RLHFArguments:
    reward_model_path: str | None = field(
        default=None, metadata={"help": "A trained sequence-classification reward model; None trains one first."}
    )
    train_file: str = field(default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "RL prompts."})
    test_file: str = field(default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out prompts."})


def prompts_from(path: str) -> list[str]:
    """Unique prompts of a preference file, as plain text followed by a newline (how the reward model saw them)."""
    return list(dict.fromkeys(row["prompt"] + "\n" for row in load_preference_rows(path)))


@torch.no_grad()
def reward_scores(reward_model, tokenizer, prompts: list[str], completions: list[str]) -> list[float]:
    """Scalar reward of each prompt + completion, as TRL computes it for a model reward function."""
    batch = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return reward_model(**batch).logits[:, 0].tolist()


def train_reward_model(output_dir: Path) -> Path:
    sys.path.insert(0, str(HERE))
    import reward_model as recipe

    recipe.main(*recipe.parse_args(["--output_dir", str(output_dir)]))
    return output_dir


def main(script_args, training_args, model_args):
    console = Console()
    out = Path(training_args.output_dir)
    rm_path = Path(script_args.reward_model_path or train_reward_model(out / "reward_model"))
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()
    rm_tokenizer = load_tokenizer(str(rm_path))

    train_prompts, test_prompts = prompts_from(script_args.train_file), prompts_from(script_args.test_file)
    policy_path = resolve_model_name_or_path(model_args.model_name_or_path)  # a path: TRL reloads it as the reference
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    trainer = trl_ext.GRPOTrainer(
        model=policy_path,
        reward_funcs=reward_model,
        reward_processing_classes=rm_tokenizer,
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": train_prompts}),
        processing_class=tokenizer,
    )

    def score(desc):
        model = trainer.accelerator.unwrap_model(trainer.model)
        completions = generate_completions(model, tokenizer, test_prompts, training_args.max_completion_length, desc=desc)
        return sum(reward_scores(reward_model, rm_tokenizer, test_prompts, completions)) / len(test_prompts), completions

    before, _ = score("eval before")
    trainer.train()
    after, completions_after = score("eval after")
    trainer.save_model(str(out))
    if not trainer.accelerator.is_main_process:
        return
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    curves = {key: [(e["step"], e[key]) for e in logs if key in e] for key in ("reward", "kl", "beta")}
    metrics = {
        "reward_model": str(rm_path),
        "rm_score_before": before,
        "rm_score_after": after,
        "n_eval_prompts": len(test_prompts),
        "kl_final": curves["kl"][-1][1] if curves["kl"] else None,
        "beta_initial": training_args.beta,
        "beta_final": trainer.beta,
        "train_steps": trainer.state.global_step,
        "curves": curves,
        "example_after": {"prompt": test_prompts[0], "completion": completions_after[0]},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, (key, label) in zip(axes, [("reward", "reward-model score (train)"), ("kl", "KL to reference (k3)"), ("beta", "beta (adaptive)")]):
        if curves[key]:
            ax.plot(*zip(*curves[key]), marker="o")
        ax.set_title(label)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "rlhf.png", dpi=120)
    write_recipe_record(out, "RLHF: reward model, then GRPO with an adaptive KL coefficient", script_args, training_args, model_args)
    console.print(
        f"reward-model score on {len(test_prompts)} held-out prompts: {before:.3f} -> {after:.3f}; "
        f"KL {metrics['kl_final']}; beta {training_args.beta} -> {trainer.beta:.4f} after {metrics['train_steps']} steps. "
        f"Wrote {out / 'metrics.json'} and {out / 'rlhf.png'}"
    )


if __name__ == "__main__":
    main(*parse_recipe_args((RLHFArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG))
