"""A Bradley-Terry reward model (trl_ext.RewardTrainer) on the bundled preference pairs.

    uv run python recipes/reward_model.py    # embedded SmolLM2-135M-Instruct, CPU, a few minutes
    uv run python recipes/reward_model.py --config my.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct

Without `--config`, `recipes/configs/reward_model.yaml` is used; command-line flags override it. The causal LM is
loaded as a sequence classifier with one output (a fresh scalar head on the pretrained body), trained on
`recipes/data/preferences_train.jsonl` (format: trl_ext.data.preferences; the per-pair `margin` column is used
unless `--use_margin false`) and evaluated before and after on the held-out `preferences_test.jsonl`: pairwise
accuracy (fraction of pairs with r_chosen > r_rejected), mean reward margin and the Bradley-Terry loss. Writes
`metrics.json` and the trained model into `output_dir` (the model is what recipes/rlhf.py can load as a reward).

A `--config` file is layered over the recipe's defaults (it replaces only what it sets; flags override both). Data,
options and `--output_dir` are checked before the model is loaded. `--resume_from_checkpoint true` continues from the
latest checkpoint in `--output_dir` (the before-evaluation saved by the first run is reused); a finished run is
never overwritten unless `--overwrite_output_dir` is given. metrics.json also records the command, the resolved
configs, library versions and phase times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl import ModelConfig, get_peft_config

from trl_ext.data.preferences import load_preference_dataset
from trl_ext.models import load_tokenizer, resolve_model_name_or_path
from trl_ext.recipe_utils import (
    RecipeArguments,
    RecipeRun,
    check_fills_one_step,
    check_model_options,
    file_digest,
    parse_recipe_args,
    recipe_main,
    user_input,
    write_model_card,
    write_report,
)
from trl_ext.trainers.reward import RewardConfig, RewardTrainer
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
    use_margin: bool = field(default=True, metadata={"help": "Use the per-pair margin column in the loss."})
    skip_bad_rows: bool = field(
        default=False, metadata={"help": "Drop malformed rows with one counted warning instead of failing."}
    )


def load_pairs(path: str, script_args: ScriptArguments):
    dataset = load_preference_dataset(path, script_args.conversational, script_args.skip_bad_rows)
    if not script_args.conversational:  # plain text: TRL appends the response to the prompt as is
        dataset = dataset.map(lambda row: {"prompt": row["prompt"] + "\n"})
    if not script_args.use_margin and "margin" in dataset.column_names:
        dataset = dataset.remove_columns("margin")
    return dataset


def evaluate(trainer) -> dict:
    metrics = trainer.evaluate()
    return {
        "pairwise_accuracy": metrics["eval_accuracy"],
        "reward_margin": metrics["eval_margin"],
        "bt_loss": metrics["eval_loss"],
        "mean_reward": metrics["eval_mean_reward"],
    }


def main(script_args: ScriptArguments, training_args: RewardConfig, model_args: ModelConfig) -> dict:
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    run = RecipeRun("reward_model", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir,
                    resume=training_args.resume_from_checkpoint)
    check_model_options(model_args)
    with run.phase("load_data"):
        with user_input("--train_file: "):
            train = load_pairs(script_args.train_file, script_args)
        with user_input("--test_file: "):
            test = load_pairs(script_args.test_file, script_args)
    check_fills_one_step(len(train), training_args, f"--train_file {script_args.train_file}", "pairs")
    model_path = resolve_model_name_or_path(model_args.model_name_or_path)  # embedded model -> local checkpoint
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
    }
    tokenizer = load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    with run.phase("load_model"):  # the trainer loads the model from model_path
        trainer = RewardTrainer(
            model=model_path,
            args=training_args,
            train_dataset=train,
            eval_dataset=test,
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
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
    trainer.save_model(training_args.output_dir)

    if not trainer.accelerator.is_main_process:
        return {}
    write_model_card(trainer, training_args.output_dir, model_args.model_name_or_path, script_args.train_file)
    report = {
        "recipe": "reward_model",
        "model": model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
        "train_pairs": len(train),
        "test_pairs": len(test),
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
        f"Bradley-Terry reward model, {len(test)} held-out pairs",
        before,
        after,
        run=run,
        keys=("pairwise_accuracy", "reward_margin", "bt_loss"),
    )
    write_recipe_record(output_dir, "Bradley-Terry reward model", script_args, training_args, model_args)
    console.print(
        f"Trained on {len(train)} pairs: {run.steps_summary(train_output.global_step, train_seconds)}. "
        f"Wrote the model and metrics.json to {output_dir}"
    )
    return report


def parse_args(argv: list[str] | None = None):
    return parse_recipe_args((ScriptArguments, RewardConfig, ModelConfig), HERE / "configs" / "reward_model.yaml", argv, __doc__)


if __name__ == "__main__":
    recipe_main(main, parse_args)
