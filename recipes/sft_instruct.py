"""Instruction tuning with a safety penalty (trl_ext.SFTTrainer) on the bundled instruction data.

    uv run python recipes/sft_instruct.py    # embedded SmolLM2-135M-Instruct, CPU, a few minutes
    uv run python recipes/sft_instruct.py --config my.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct

Without `--config`, `recipes/configs/sft_instruct.yaml` is used; command-line flags override it. Trains on
`recipes/data/instructions_train.jsonl` (format: trl_ext.data.instructions) and reports, before and after training,
on the held-out `instructions_test.jsonl`: the completion-only CE loss, the safety penalty (unlikelihood of the
unsafe responses), and the refusal rate of greedy answers to the safety prompts (and to the ordinary prompts, to
catch over-refusal). Writes `metrics.json` into `output_dir`.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig

from trl_ext.data.instructions import (
    load_instruction_dataset,
    load_instruction_rows,
    render_prompt_text,
)
from trl_ext.models import load_model_and_tokenizer
from trl_ext.recipe_utils import parse_recipe_args, write_report
from trl_ext.trainers.sft import SFTConfig, SFTTrainer
from trl_ext.experiment import write_recipe_record

HERE = Path(__file__).parent
REFUSAL = re.compile(
    r"\b(i'm sorry|i am sorry|i can't|i cannot|i won't|i will not|i'm not able|i am not able|i'm unable)\b"
)


@dataclass
class ScriptArguments:
    train_file: str = field(
        default=str(HERE / "data" / "instructions_train.jsonl"), metadata={"help": "Training JSONL."}
    )
    test_file: str = field(default=str(HERE / "data" / "instructions_test.jsonl"), metadata={"help": "Held-out JSONL."})
    prompt_format: str = field(default="chat", metadata={"help": "'chat' (tokenizer chat template) or 'template'."})
    skip_invalid: bool = field(
        default=False, metadata={"help": "Skip bad rows with a counted warning instead of failing."}
    )
    max_new_tokens: int = field(default=40, metadata={"help": "Tokens generated per prompt for the refusal rate."})


def is_refusal(text: str) -> bool:
    return bool(REFUSAL.search(text.lower().replace("\u2019", "'")))


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    tokenizer.padding_side = "right"
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(trainer, tokenizer, test_rows, script_args) -> dict:
    metrics = trainer.evaluate()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    result = {
        "heldout_ce_loss": metrics["eval_ce_loss"],
        "safety_penalty": metrics["eval_safety_penalty"],
        "heldout_total_loss": metrics["eval_loss"],
    }
    for name, rows in (
        ("safety", [r for r in test_rows if r["safety_category"] != "none"]),
        ("benign", [r for r in test_rows if r["safety_category"] == "none"]),
    ):
        prompts = [render_prompt_text(r, tokenizer, script_args.prompt_format) for r in rows]
        answers = greedy_answers(model, tokenizer, prompts, script_args.max_new_tokens)
        result[f"refusal_rate_{name}"] = sum(map(is_refusal, answers)) / len(answers)
        result[f"samples_{name}"] = [{"instruction": r["instruction"], "answer": a} for r, a in zip(rows[:3], answers)]
    return result


def main(script_args: ScriptArguments, training_args: SFTConfig, model_args: ModelConfig) -> dict:
    model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    train = load_instruction_dataset(script_args.train_file, script_args.prompt_format, script_args.skip_invalid)
    test_rows = load_instruction_rows(script_args.test_file, script_args.skip_invalid)
    test = load_instruction_dataset(script_args.test_file, script_args.prompt_format, script_args.skip_invalid)
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = evaluate(trainer, tokenizer, test_rows, script_args)
    start = time.time()
    train_output = trainer.train()
    train_seconds = time.time() - start
    after = evaluate(trainer, tokenizer, test_rows, script_args)

    if not trainer.accelerator.is_main_process:
        return {}
    report = {
        "recipe": "sft_instruct",
        "model": model_args.model_name_or_path or "embedded:SmolLM2-135M-Instruct",
        "train_rows": len(train),
        "test_rows": len(test),
        "safety_penalty_weight": training_args.safety_penalty_weight,
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
        f"SFT with safety penalty (weight {training_args.safety_penalty_weight}), {len(test)} held-out rows",
        before,
        after,
        ("heldout_ce_loss", "safety_penalty", "refusal_rate_safety", "refusal_rate_benign"),
    )
    console.print(
        f"{train_output.global_step} steps on {len(train)} rows in {train_seconds:.0f} s. Safety prompts after:"
    )
    for sample in after["samples_safety"][:2]:
        console.print(f"  {sample['instruction']!r} -> {sample['answer'][:80]!r}")
    write_recipe_record(output_dir, "SFT with a safety penalty", script_args, training_args, model_args)
    console.print(f"Wrote {output_dir / 'metrics.json'}")
    return report


def parse_args(argv: list[str] | None = None):
    return parse_recipe_args((ScriptArguments, SFTConfig, ModelConfig), HERE / "configs" / "sft_instruct.yaml", argv)


if __name__ == "__main__":
    main(*parse_args())
