"""Direct preference optimization (trl_ext.DPOTrainer, the course's per-instance DPO loss) on the bundled pairs.

    uv run python recipes/dpo.py    # embedded SmolLM2-135M-Instruct, CPU, a few minutes
    uv run python recipes/dpo.py --config my.yaml --label_smoothing 0.1    # cDPO

Without `--config`, `recipes/configs/dpo.yaml` is used; command-line flags override it. The reference is the
starting model (its log-probs precomputed once, `precompute_ref_log_probs`). Trained on
`recipes/data/preferences_train.jsonl` and evaluated before and after on `preferences_test.jsonl`: preference
accuracy (fraction of pairs whose implicit reward beta * (log pi - log pi_ref) is higher for the chosen response),
implicit reward margin (mean beta * h) and the DPO loss. Before training the policy is the reference, so every
implicit reward is 0: accuracy 0, margin 0, loss log 2. Writes `metrics.json` into `output_dir`.

A `--config` file is layered over the recipe's defaults (it replaces only what it sets; flags override both). Data,
options and `--output_dir` are checked before the model is loaded. `--resume_from_checkpoint true` continues from the
latest checkpoint in `--output_dir` (the before-evaluation saved by the first run is reused); a finished run is
never overwritten unless `--overwrite_output_dir` is given. metrics.json also records the command, the resolved
configs, library versions and phase times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl import ModelConfig

from trl_ext.data.preferences import load_preference_dataset
from trl_ext.models import load_model_and_tokenizer
from trl_ext.recipe_utils import (
    RecipeArguments,
    RecipeRun,
    check_fills_one_step,
    check_model_options,
    file_digest,
    parse_recipe_args,
    recipe_main,
    user_input,
    write_report,
)
from trl_ext.trainers.dpo import DPOConfig, DPOTrainer
from trl_ext.experiment import write_recipe_record

HERE = Path(__file__).parent


@dataclass
class ScriptArguments(RecipeArguments):
    train_file: str = field(
        default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "Training JSONL."}
    )
    test_file: str = field(default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out JSONL."})
    conversational: bool = field(
        default=False, metadata={"help": "Wrap pairs as chat turns (tokenizer chat template); default plain text."}
    )
    skip_bad_rows: bool = field(
        default=False, metadata={"help": "Drop malformed rows with one counted warning instead of failing."}
    )


def load_pairs(path: str, script_args: ScriptArguments):
    dataset = load_preference_dataset(path, script_args.conversational, script_args.skip_bad_rows)
    if not script_args.conversational:  # plain text: TRL appends the response to the prompt as is
        dataset = dataset.map(lambda row: {"prompt": row["prompt"] + "\n"})
    return dataset.remove_columns("margin") if "margin" in dataset.column_names else dataset  # DPO has no margin


def evaluate(trainer) -> dict:
    metrics = trainer.evaluate()
    return {
        "preference_accuracy": metrics["eval_rewards/accuracies"],
        "reward_margin": metrics["eval_rewards/margins"],
        "dpo_loss": metrics["eval_loss"],
        "logp_chosen": metrics["eval_logps/chosen"],
        "logp_rejected": metrics["eval_logps/rejected"],
    }


def main(script_args: ScriptArguments, training_args: DPOConfig, model_args: ModelConfig) -> dict:
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    run = RecipeRun("dpo", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir,
                    resume=training_args.resume_from_checkpoint)
    check_model_options(model_args)
    with run.phase("load_data"):
        with user_input("--train_file: "):
            train = load_pairs(script_args.train_file, script_args)
        with user_input("--test_file: "):
            test = load_pairs(script_args.test_file, script_args)
    check_fills_one_step(len(train), training_args, f"--train_file {script_args.train_file}", "pairs")
    with run.phase("load_model"):
        model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    run.attach(trainer)
    key = {"model": model_args.model_name_or_path, "test_file": file_digest(script_args.test_file),
           "script_args": asdict(script_args), "beta": getattr(training_args, "beta", None)}
    key["script_args"].pop("overwrite_output_dir")
    with run.phase("eval_before"):
        before = run.reuse_or_compute("eval_before", key, lambda: evaluate(trainer))
    with run.phase("train"):
        train_output = trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    train_seconds = run.phase_seconds["train"]
    with run.phase("eval_after"):
        after = evaluate(trainer)

    if not trainer.accelerator.is_main_process:
        return {}
    report = {
        "recipe": "dpo",
        "model": model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
        "train_pairs": len(train),
        "test_pairs": len(test),
        "beta": training_args.beta,
        "label_smoothing": training_args.label_smoothing,
        "train_seconds": round(train_seconds, 1),
        "train_steps": train_output.global_step,
        "train_loss": train_output.training_loss,
        "before": before,
        "after": after,
        "log_history": trainer.state.log_history,
        "script_args": asdict(script_args),
    }
    output_dir = Path(training_args.output_dir)
    console = write_report(
        output_dir,
        report,
        f"DPO (beta {training_args.beta}, label smoothing {training_args.label_smoothing}), "
        f"{len(test)} held-out pairs",
        before,
        after,
        run=run,
        keys=("preference_accuracy", "reward_margin", "dpo_loss", "logp_chosen", "logp_rejected"),
    )
    write_recipe_record(output_dir, "DPO", script_args, training_args, model_args)
    console.print(
        f"Trained on {len(train)} pairs: {run.steps_summary(train_output.global_step, train_seconds)}. "
        f"Wrote {output_dir / 'metrics.json'}"
    )
    return report


def parse_args(argv: list[str] | None = None):
    return parse_recipe_args((ScriptArguments, DPOConfig, ModelConfig), HERE / "configs" / "dpo.yaml", argv, __doc__)


if __name__ == "__main__":
    recipe_main(main, parse_args)
