"""Greedy accuracy of any model on GSM8K, MATH or generated arithmetic, with format/answer breakdown and every response.

    uv run python recipes/eval_math.py                                            # embedded model, 200 additions
    uv run python recipes/eval_math.py --num_eval 20                              # the same, 20 problems (~20 s)
    uv run python recipes/eval_math.py --dataset_name data/gsm8k_test.jsonl --model_name_or_path outputs/grpo_math
    uv run python recipes/eval_math.py --config recipes/configs/eval_math_gsm8k.yaml  # GPU: Qwen2.5-Math, vLLM

Generation: vLLM when it is installed and a GPU is present (``--backend auto``, the default), else Hugging Face
generate; ``--backend hf`` or ``vllm`` forces one. Writes metrics.json and responses.jsonl (every prompt, response,
answer, extracted answer and score) into --output_dir and prints a summary with examples of responses that failed to
parse. Options, data, the model path and --output_dir (writable; no finished evaluation there unless
--overwrite_output_dir) are checked before the model is loaded. metrics.json also records the command, the resolved
options, library versions and phase times.
"""

from dataclasses import dataclass, field, replace

import trl

import trl_ext
from trl_ext import cli, report, tasks


@dataclass
class EvalArguments(tasks.TaskArguments):
    """What to evaluate on (the task's options: --task, --task_config, data, template, grader) and how."""

    dataset_split: str = field(default="test", metadata={"help": "Hub split (a local file is read whole)."})
    max_new_tokens: int = field(default=24, metadata={"help": "Generation budget per response."})
    batch_size: int = field(default=50, metadata={"help": "Prompts per HF generate call (vLLM takes all at once)."})
    backend: str = field(default="auto", metadata={"help": f"One of {trl_ext.eval.BACKENDS}."})
    num_examples: int = field(default=5, metadata={"help": "Examples (and unparsed examples) kept in metrics.json."})
    output_dir: str = field(
        default="outputs/eval_math", metadata={"help": "Where metrics.json and responses.jsonl go."}
    )


@cli.recipe("eval_math", (EvalArguments, trl.ModelConfig))
def main(run, eval_args: EvalArguments, model_args: trl.ModelConfig) -> dict:
    args = eval_args  # the decorator records it under this parameter's name
    if args.backend not in trl_ext.eval.BACKENDS:
        raise cli.RecipeError(f"--backend {args.backend!r}: expected one of {trl_ext.eval.BACKENDS}")
    with run.phase("load_data"):  # the held-out rows only
        held_out = replace(args, dataset_test_split=args.dataset_split, eval_batch_size=args.batch_size)
        task = tasks.load_task(held_out, args.max_new_tokens, train=False)
    with run.phase("load_model"):
        model, tokenizer, backend = trl_ext.eval.load_eval_model(model_args, args.backend)
    with run.phase("generate_and_grade"):
        result = task.evaluate(
            model, tokenizer, num_examples=args.num_examples, jsonl_path=run.output_dir / "responses.jsonl"
        )

    metrics = {k: v for k, v in result.items() if k != "records"}
    metrics.update(
        model=model_args.model_name_or_path or trl_ext.models.DEFAULT_MODEL,
        dataset=task.dataset,
        reward=task.name,
        max_new_tokens=args.max_new_tokens,
    )
    b = result["breakdown"]
    row = (
        f"{result['accuracy']:.1%}",
        f"{result['exact_accuracy']:.1%}",
        f"{result['format_rate']:.1%}",
        b["format1_answer1"],
        b["format1_answer0"],
        result["num_unparsed"],
        result["num_truncated"],
        f"{result['examples_per_second']:.2f}",
        f"{result['tokens_per_second']:.1f}",
    )
    columns = ("accuracy", "exact", "format rate", "format+answer ok", "format ok, wrong", "unparsed", "cut")
    notes = [result["held_out_note"]] if result["held_out_note"] else []
    if result["partial_credit_rows"]:
        notes.append(
            f"accuracy is the mean score: {result['partial_credit_rows']} answers earned partial credit; "
            f"{result['exact_accuracy']:.1%} were exact"
        )
    report.finish(
        run,
        metrics,
        [  # no experiment.md: an evaluation has no training to record
            report.ConsoleTable(
                f"{metrics['model']} on {task.dataset} ({report.held_out_caption(result)}, greedy, {backend})",
                (*columns, "ex/s", "tok/s"),
                [row],
            ),
            report.ConsoleLines(
                *notes, *(f"unparsed: {r['response']!r} (answer {r['answer']})" for r in result["unparsed_examples"])
            ),
            report.Written("responses.jsonl"),
        ],
    )
    return metrics


if __name__ == "__main__":
    cli.main(main)
