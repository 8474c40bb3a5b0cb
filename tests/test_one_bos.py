"""One BOS token, and the same prompt tokens in training and evaluation (issue 10 item 4).

The embedded tokenizer adds no BOS, so these tests build tokenizers that do:
* "dedicated": BOS is <|endoftext|> (id 0), added by the tokenizer AND written by the chat template ({{ bos_token }}
  first), as in Llama 3 / Gemma / Mistral;
* "im_start": the embedded tokenizer with add_bos_token=True; its BOS <|im_start|> also opens every chat turn, so a
  rendered chat prompt starts with the BOS text.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CPU_TEST_ARGS
from datasets import Dataset
from tiny import tiny_grpo_trainer, tiny_model_for_tests

from trl_ext.data import adds_bos_token, format_prompt, prompt_token_ids, render_chat_prompt, strip_leading_bos
from trl_ext.eval import generate_completions
from trl_ext.trainers.dpo import DPOConfig, DPOTrainer
from trl_ext.trainers.sft import SFTConfig, SFTTrainer

QUESTION = "What is 2 + 3?"


@pytest.fixture(params=["dedicated", "im_start"])
def bos_tokenizer(request, tokenizer):
    tok = copy.deepcopy(tokenizer)
    if request.param == "dedicated":
        tok.bos_token = "<|endoftext|>"
        tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.add_bos_token = True
    assert adds_bos_token(tok) and not adds_bos_token(tokenizer)
    return tok


def leading_bos(ids, tok) -> int:
    n = 0
    while n < len(ids) and ids[n] == tok.bos_token_id:
        n += 1
    return n


def prompts_of_every_kind(tok):
    """The same question as r1_zero text, question_only text, a rendered chat string and a conversation."""
    return [
        format_prompt(QUESTION, "r1_zero"),
        format_prompt(QUESTION, "question_only"),
        format_prompt(QUESTION, "chat", tok),  # a string that starts with the BOS text
        render_chat_prompt(tok, QUESTION),
        format_prompt(QUESTION, "chat"),  # the conversation, rendered by the tokenizer
    ]


def test_prompt_token_ids_have_exactly_one_bos(bos_tokenizer):
    tok = bos_tokenizer
    ids = [prompt_token_ids(tok, p) for p in prompts_of_every_kind(tok)]
    assert [leading_bos(x, tok) for x in ids] == [1] * 5
    if tok.bos_token == "<|endoftext|>":
        assert [x.count(tok.bos_token_id) for x in ids] == [1] * 5
    assert ids[2] == ids[3] == ids[4]  # a rendered chat string reads exactly like its conversation
    # the plain-text prompt is the tokenizer's own encoding with BOS: nothing else changes
    assert ids[0] == [tok.bos_token_id] + tok(format_prompt(QUESTION, "r1_zero"), add_special_tokens=False)["input_ids"]
    # without BOS in the tokenizer nothing is stripped or added
    assert strip_leading_bos("<|im_start|>user", copy.deepcopy(tok), adds_bos=False) == "<|im_start|>user"
    assert strip_leading_bos(tok.bos_token * 2 + "x", tok) == "x"


def grpo_trainer(tok, model, tmp_path):
    settings = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=3)
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    return tiny_grpo_trainer(model, tok, tmp_path / "grpo", ["a", "b"], reward, **settings)


def test_grpo_training_and_eval_generation_see_the_same_ids(bos_tokenizer, tmp_path):
    tok = bos_tokenizer
    model = tiny_model_for_tests(tok)
    trainer = grpo_trainer(tok, model, tmp_path)
    seen = []
    original_generate = model.generate

    def recording_generate(*args, **kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        seen.extend(row[m.bool()].tolist() for row, m in zip(ids, mask))
        return original_generate(*args, **kwargs)

    model.generate = recording_generate
    for prompt in prompts_of_every_kind(tok):
        trainer.model.train()
        batch = trainer._generate_and_score_completions([{"prompt": prompt}] * 2)
        trained = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
        seen.clear()
        generate_completions(model, tok, [prompt], max_new_tokens=2, disable_progress=True)
        assert seen == [trained], f"evaluation and training tokenize {prompt!r} differently"
        assert trained == prompt_token_ids(tok, prompt)
        assert leading_bos(trained, tok) == 1


def test_sft_training_inputs_have_one_bos(bos_tokenizer, tmp_path):
    tok = bos_tokenizer
    prompts = prompts_of_every_kind(tok)[:4]  # plain strings: prompt-completion text rows
    dataset = Dataset.from_dict({"prompt": prompts, "completion": [" 5"] * 4})
    args = SFTConfig(output_dir=str(tmp_path / "sft"), **CPU_TEST_ARGS, per_device_train_batch_size=4)
    trainer = SFTTrainer(
        model=tiny_model_for_tests(tok), args=args, train_dataset=dataset, processing_class=copy.deepcopy(tok)
    )
    for prompt, row in zip(prompts, trainer.train_dataset):
        assert leading_bos(row["input_ids"], tok) == 1
        n = len(prompt_token_ids(tok, prompt))
        assert row["input_ids"][:n] == prompt_token_ids(tok, prompt)  # the prompt as GRPO and eval see it
        assert row["labels"][:n] == [-100] * n and row["labels"][n:] == row["input_ids"][n:]  # completion-only loss
    # language modeling on rendered text: one BOS too
    docs = Dataset.from_dict({"text": [render_chat_prompt(tok, QUESTION) + "5<|im_end|>"]})
    lm = SFTTrainer(model=tiny_model_for_tests(tok), args=args, train_dataset=docs, processing_class=copy.deepcopy(tok))
    assert leading_bos(lm.train_dataset[0]["input_ids"], tok) == 1


def test_dpo_training_inputs_have_one_bos(bos_tokenizer, tmp_path):
    tok = bos_tokenizer
    prompts = prompts_of_every_kind(tok)[:4]
    dataset = Dataset.from_dict({"prompt": prompts, "chosen": [" 5"] * 4, "rejected": [" 6"] * 4})
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), **CPU_TEST_ARGS, per_device_train_batch_size=4)
    trainer = DPOTrainer(
        model=tiny_model_for_tests(tok, seed=1),
        ref_model=tiny_model_for_tests(tok, seed=2),
        args=args,
        train_dataset=dataset,
        processing_class=copy.deepcopy(tok),
    )
    for prompt, row in zip(prompts, trainer.train_dataset):
        assert row["prompt_ids"] == prompt_token_ids(tok, prompt)
        assert leading_bos(row["prompt_ids"], tok) == 1
    batch = next(iter(trainer.get_train_dataloader()))
    first_real = batch["attention_mask"].argmax(dim=1)  # prompts are left-padded in the batch
    firsts = batch["input_ids"][torch.arange(len(first_real)), first_real]
    assert torch.all(firsts == tok.bos_token_id)
    seconds = batch["input_ids"][torch.arange(len(first_real)), first_real + 1]
    assert not torch.any(seconds == tok.bos_token_id)
