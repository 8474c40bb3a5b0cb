"""Tiny local stand-ins for the models and datasets the bundled configs name, built without the Hugging Face Hub.

The GPU configs name Qwen/Qwen2.5-Math-1.5B and hub datasets (openai/gsm8k, DigitalLearningGmbH/MATH-lighteval,
HuggingFaceH4/MATH-500). tests/test_config_rehearsal.py runs every config on CPU with:

* :func:`qwen2_stand_in`: a Qwen2-architecture model (grouped-query attention, tied embeddings, no BOS token, EOS =
  pad = ``<|endoftext|>``, like Qwen2.5-Math) of width 64 with a byte-level BPE tokenizer of the same class
  (``Qwen2Tokenizer``: Qwen's pre-tokenizer regex, ``<|im_start|>``/``<|im_end|>`` chat tokens, a Qwen-style chat
  template) trained here on the R1-Zero prompt and the stand-in data. The model is taught for a few seconds
  (:func:`teach`) to answer every R1-Zero prompt with ``" ... </think> <answer> 4 </answer>"`` or ``... 5 ...``
  (half each) and then stop, so that with the configs' own generation budgets (1024 tokens) a completion still
  ends after ~15 tokens, the configs' own reward grades half the samples right (GRPO groups get nonzero
  advantages; expert iteration keeps samples and runs its SFT step), and nothing of the configs' sizes has to be
  lowered to finish in seconds.
* :func:`gsm8k_rows`, :func:`math_lighteval_rows`, :func:`math500_rows`: rows with the columns of those hub
  datasets, ground truths 4 or 5.
* :func:`allowed_overrides`: the only flags a rehearsal may add to a config.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

HUB_DATASETS = {}  # hub id -> rows with its columns; filled below
QWEN_MODELS = ("Qwen/Qwen2.5-Math-1.5B",)
"""Hub models the Qwen2 stand-in replaces (the embedded SmolLM2 is replaced by a tiny random Llama)."""
EVAL_ROWS = 4
"""Held-out problems of a rehearsal (--num_eval): evaluation runs the same code on 4 problems as on 1319."""
EOS = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = (  # Qwen2.5's template without tool calls
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nPlease reason step by step, and put your final answer within "
    "\\\\boxed{}.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ANSWERS = ("4", "5")
"""The stand-in answers one of these (half each); the stand-in data's ground truths are these too."""


def response(answer: str) -> str:
    """What the taught stand-in writes after the R1-Zero prompt's ``<think>``."""
    return f" I add the numbers. </think> <answer> {answer} </answer>"


# ------------------------------------------------------------------------------------------------------ data
def _questions(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = ANSWERS[i % 2]
        a = rng.randint(0, int(answer))
        out.append(
            (f"Tom has {a} marbles and finds {int(answer) - a} more. How many marbles does Tom have now?", answer)
        )
    return out


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows with openai/gsm8k's columns: ``question``, ``answer`` (a worked solution ending in ``#### N``)."""
    return [{"question": q, "answer": f"Tom adds them up.\n#### {a}"} for q, a in _questions(n, seed)]


def math_lighteval_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows with DigitalLearningGmbH/MATH-lighteval's columns: ``problem``, ``level``, ``type``, ``solution``
    (ending in ``\\boxed{N}``)."""
    return [
        {"problem": q, "level": "Level 1", "type": "Prealgebra", "solution": f"Adding gives $\\boxed{{{a}}}$."}
        for q, a in _questions(n, seed)
    ]


def math500_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows with HuggingFaceH4/MATH-500's columns: ``problem``, ``solution``, ``answer``, ``subject``, ``level``,
    ``unique_id``."""
    return [
        {
            "problem": q,
            "solution": f"Adding gives $\\boxed{{{a}}}$.",
            "answer": a,
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": f"test/prealgebra/{i}.json",
        }
        for i, (q, a) in enumerate(_questions(n, seed))
    ]


HUB_DATASETS.update(
    {
        "openai/gsm8k": gsm8k_rows,
        "DigitalLearningGmbH/MATH-lighteval": math_lighteval_rows,
        "HuggingFaceH4/MATH-500": math500_rows,
    }
)


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------------ model
def qwen2_tokenizer(corpus: Sequence[str], vocab_size: int = 800):
    """A ``Qwen2Tokenizer`` (byte-level BPE with Qwen's pre-tokenizer) trained on ``corpus``; no BOS, EOS = pad =
    ``<|endoftext|>``, with Qwen's chat tokens and a Qwen-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    probe = Qwen2Tokenizer()  # Qwen's normalizer and pre-tokenizer, to train with the very same splitting
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = probe._tokenizer.normalizer
    bpe.pre_tokenizer = probe._tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=state["vocab"], merges=merges, additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:])
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen2_model(tokenizer, seed: int = 0):
    """A random 2-layer ``Qwen2ForCausalLM`` of width 64 shaped like Qwen2.5-Math (grouped-query attention with 2
    key/value heads, tied embeddings, rope theta 10000, 4096 positions) on ``tokenizer``'s vocabulary."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return model


def teach(
    model, tokenizer, prompts: Sequence[str], steps: int = 60, lr: float = 1e-2, seed: int = 0, sharpen: float = 4.0
) -> list[float]:
    """Train ``model`` to continue each prompt with :func:`response` of one of :data:`ANSWERS` (drawn at random per
    example, so both are equally likely) followed by EOS; loss on the response tokens only. Then scale the final
    norm by ``sharpen`` (logits x ``sharpen``): every token but the answer becomes near-certain, the answer stays
    50/50. Returns the loss per step."""
    rng = random.Random(seed)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response_ids = {a: tokenizer(response(a), add_special_tokens=False)["input_ids"] + [eos] for a in ANSWERS}
    # one padded width for every batch: a new shape per step costs more than the step (CPU kernels are built per shape)
    width = max(map(len, prompt_ids)) + max(map(len, response_ids.values()))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        seqs, masks = [], []
        for i in rng.sample(range(len(prompts)), min(8, len(prompts))):
            r = response_ids[rng.choice(ANSWERS)]
            seqs.append(prompt_ids[i] + r)
            masks.append([0] * len(prompt_ids[i]) + [1] * len(r))
        ids = torch.tensor([s + [eos] * (width - len(s)) for s in seqs])
        attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        labels = torch.tensor(
            [[t if m else -100 for t, m in zip(s, mk)] + [-100] * (width - len(s)) for s, mk in zip(seqs, masks)]
        )
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    return losses


# ------------------------------------------------------------------------------------------------------ rules
def allowed_overrides(
    config: dict, recipe: str, model_dir: str, data_file: str | None, out: Path, reward_model_dir: str | None = None
) -> list[str]:
    """The flags a CPU rehearsal of ``config`` (the YAML as a dict) of ``recipe`` may add, and only these (the
    reasons: tests/test_config_rehearsal.py's docstring and docs/scaling.md): what a CPU forces, the stand-ins'
    paths, tiny counts, and the smallest CPU-affordable step."""
    flags = ["--output_dir", str(out), "--model_name_or_path", model_dir]
    if config.get("use_vllm"):
        flags += ["--use_vllm", "false"]
    if config.get("backend") == "vllm":
        flags += ["--backend", "hf"]
    if config.get("bf16"):
        flags += ["--use_cpu", "true"]
    if config.get("dataset_name") is not None:
        flags += ["--dataset_name", data_file]
    if recipe == "rlhf":
        flags += ["--reward_model_path", reward_model_dir]
    if recipe == "expert_iteration":
        flags += ["--n_ei_steps", "1"]
        # questions whose samples fill one SFT optimizer step when all are kept
        one_step = config.get("per_device_train_batch_size", 8) * config.get("gradient_accumulation_steps", 1)
        questions = max(1, one_step // config.get("num_generations", 8))
        if config.get("ei_batch_size", 16) > questions:
            flags += ["--ei_batch_size", str(questions)]
    elif recipe != "eval_math":
        flags += ["--max_steps", "1"]
    if recipe != "eval_math" and config.get("num_eval", 0) > EVAL_ROWS:
        flags += ["--num_eval", str(EVAL_ROWS)]
    accumulation = config.get("gradient_accumulation_steps", 1)
    if config.get("num_generations") and recipe != "expert_iteration" and accumulation > 1:
        # the fewest micro-batches per optimizer step that keep a generation batch whole groups
        per_device, group = config["per_device_train_batch_size"], config["num_generations"]
        fewest = next(k for k in range(1, accumulation + 1) if per_device * k % group == 0)
        if fewest < accumulation:
            flags += ["--gradient_accumulation_steps", str(fewest)]
    return flags
