"""Completions end where the prompt's format ends (issue 40, item 1), and a response the length limit cut earns no
credit where the answer is read from its end (item 9): trl_ext.stop_strings, evaluation's greedy generation and
trl_ext.GRPOTrainer's rollouts (transformers and vLLM), on a tiny model whose tokens a scripted logits processor
forces, so every stop string lands at a known token.

The right values come from the tokenizer alone: the tokens a completion keeps are the tokenization of its text up to
the stop string, and a right answer is judged by the course's rule (``drgrpo_grader.r1_zero_reward_fn``: the text
after the last ``<answer>`` with ``</answer>`` deleted must be the answer, so any text after the tag makes it wrong),
written out here.
"""

import copy
import logging

import pytest
import torch
from datasets import Dataset
from tiny import CPU_QUIET, tiny_grpo_trainer
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

import trl_ext
from trl_ext.eval import generate_responses
from trl_ext.rewards import gsm8k_reward_fn
from trl_ext.stop_strings import StopAtStrings, StopCut, check_stop_strings, cut_at_stop, ends_truncated, find_stop
from trl_ext.tasks import Task

STOP = ("</answer>",)


def course_r1_zero_right(response: str, answer: str) -> bool:
    """The course grader's rule for a right answer (CS336 A5 ``r1_zero_reward_fn``, its strict format check and its
    answer reading; the answer compared as a string here)."""
    if "</think> <answer>" not in response or "</answer>" not in response:
        return False
    return response.split("<answer>")[-1].replace("</answer>", "").strip() == answer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def overshooting(tokenizer, text: str) -> list[int]:
    """``text`` + ``">."`` where the last token, ``">."``, completes ``</answer>`` and runs past it (text ends with
    ``"</answer"``)."""
    return ids(tokenizer, text) + [tokenizer.convert_tokens_to_ids(">.")]


# ------------------------------------------------------------------------------------------------ the rules
def test_course_rule_scores_a_right_answer_followed_by_text_zero():
    assert course_r1_zero_right(" 2+2 </think> <answer>4</answer>", "4")
    assert not course_r1_zero_right(" 2+2 </think> <answer>4</answer>\nUser: next", "4")  # why generation must stop


def test_find_stop_is_the_earliest_end_after_the_held_back_text():
    text = "a </answer> b </answer>"
    assert find_stop(text, STOP) == len("a </answer>")
    assert find_stop(text, STOP, after=len("a </answer>")) == len(text)  # the first ends inside the held-back text
    assert find_stop(text, STOP, after=len("a </answer>") - 1) == len("a </answer>")  # ends after it: counts
    assert find_stop("xy", ("y", "xy")) == 2 and find_stop("xyz", ("z", "xy")) == 2  # earliest end wins
    assert find_stop("no stop here", STOP) is None


def test_check_stop_strings():
    assert check_stop_strings(None) == () and check_stop_strings(["a", "b", "a"]) == ("a", "b")
    with pytest.raises(ValueError, match=r"expected a list of strings, e.g. \['</answer>'\]"):
        check_stop_strings("</answer>")
    with pytest.raises(ValueError, match="every entry must be a non-empty string"):
        check_stop_strings(["</answer>", ""])


def test_cut_at_stop_keeps_the_tokens_through_the_stop_and_the_text_up_to_it(tokenizer):
    head = " 2+2 </think> <answer>4</answer>"
    row = ids(tokenizer, head) + ids(tokenizer, "\nUser: more") + [tokenizer.pad_token_id] * 3
    assert cut_at_stop(row, tokenizer, STOP) == StopCut(len(ids(tokenizer, head)), head)
    # a last token that runs past the stop string (">." completes "</answer>"): the token stays, the text stops
    over = overshooting(tokenizer, " 2+2 </think> <answer>4</answer")
    assert tokenizer.decode(over).endswith("</answer>.")
    assert cut_at_stop(over + ids(tokenizer, " x"), tokenizer, STOP) == StopCut(len(over), head)
    # min_new_tokens 4: a stop string completed by the 3rd token is held back; the next one counts
    early = " </answer>"
    assert len(ids(tokenizer, early)) == 3
    both = early + " so </think> <answer>5</answer>"
    assert cut_at_stop(ids(tokenizer, both), tokenizer, STOP) == StopCut(3, early)
    assert cut_at_stop(ids(tokenizer, both), tokenizer, STOP, min_new_tokens=4) == StopCut(
        len(ids(tokenizer, both)), both
    )
    assert cut_at_stop(ids(tokenizer, " no tag"), tokenizer, STOP) is None
    assert ends_truncated([5, 6], end_ids=[2], stopped=False) and not ends_truncated([5, 2], [2], stopped=False)
    assert not ends_truncated([5, 6], end_ids=[2], stopped=True) and ends_truncated([], [2], stopped=False)


# ------------------------------------------------------------------------------------- scripted generation
class Scripted(LogitsProcessor):
    """Forces row r to write ``scripts[r % len(scripts)]``, then ``filler`` for ever."""

    def __init__(self, scripts, prompt_length, filler):
        self.scripts, self.prompt_length, self.filler = scripts, prompt_length, filler

    def __call__(self, input_ids, scores):
        step = input_ids.size(1) - self.prompt_length
        forced = torch.full_like(scores, -float("inf"))
        for row in range(scores.size(0)):
            script = self.scripts[row % len(self.scripts)]
            forced[row, script[step] if step < len(script) else self.filler] = 0.0
        return forced


def script_generation(model, scripts, filler):
    """Make ``model.generate`` write the scripts (an instance attribute, beneath any wrapper set later)."""
    plain = model.generate

    def generate(*args, **kwargs):
        prompt_length = kwargs["input_ids"].size(1)
        processors = LogitsProcessorList([Scripted(scripts, prompt_length, filler)])
        return plain(*args, logits_processor=processors, **kwargs)

    model.generate = generate


def test_min_new_tokens_holds_back_stop_strings_as_vllms_min_tokens_does(tiny_model, tokenizer):
    """vLLM 0.30 (``BaseIncrementalDetokenizer.update``) checks stop strings only once a completion has *more than*
    ``min_tokens`` tokens, and only in the text after the first ``min_tokens`` tokens' text: a stop string that the
    ``min_tokens``-th token completes does not stop (issue 45). Worked out from the tokenization alone: the stop
    string of ``early`` is completed by its 3rd token; its first 2 tokens hold only part of it."""
    tok = copy.deepcopy(tokenizer)
    early = " </answer>"
    assert len(ids(tok, early)) == 3 and "</answer>" not in tok.decode(ids(tok, early)[:2])
    both = early + " so </think> <answer>5</answer>"
    row = ids(tok, both)
    later = StopCut(len(row), both)
    # cut_at_stop: min 0, 1, 2 -> the early stop (completed by token 3 > min, ending after the held-back text)
    for minimum in (0, 1, 2):
        assert cut_at_stop(row, tok, STOP, min_new_tokens=minimum) == StopCut(3, early), minimum
    # min 3 and 4: token 3 is within the first min tokens, so the early stop is held back; the later one counts
    for minimum in (3, 4):
        assert cut_at_stop(row, tok, STOP, min_new_tokens=minimum) == later, minimum
        assert cut_at_stop(row[:3], tok, STOP, min_new_tokens=minimum) is None, minimum
    assert cut_at_stop(row, tok, STOP, min_new_tokens=len(row)) is None  # no token past the minimum

    # StopAtStrings in transformers' generate, with min_new_tokens as the trainer sets it: same rows
    filler = ids(tok, " the")[0]
    script_generation(tiny_model, [row], filler=filler)
    prompt = torch.tensor([ids(tok, "Solve:")])
    try:
        for minimum, expected in ((2, 3), (3, len(row))):
            criteria = StoppingCriteriaList([StopAtStrings(tok, STOP, prompt.size(1), minimum)])
            out = tiny_model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=len(row) + 3,
                min_new_tokens=minimum,
                do_sample=False,
                stopping_criteria=criteria,
                pad_token_id=tok.pad_token_id,
            )
            assert out[0, prompt.size(1) :].tolist() == row[:expected], minimum
    finally:
        del tiny_model.generate


@pytest.mark.parametrize("share", [True, False])
def test_evaluation_stops_each_row_at_its_own_step(tiny_model, tokenizer, monkeypatch, share):
    tok = copy.deepcopy(tokenizer)
    eos = tok.eos_token_id
    texts = [
        " 1 </think> <answer>4</answer>",  # stops at step 9
        " 2+2, so </think> <answer>4</answer",  # + ">.": stops later, on ">." (the text ends at the tag)
        " 4",  # then EOS: ended, not cut
        " 4 4",  # then filler: cut by the length limit
    ]
    scripts = [ids(tok, texts[0]) + ids(tok, "\nUser: more"), overshooting(tok, texts[1]) + ids(tok, " x")]
    scripts += [ids(tok, texts[2]) + [eos], ids(tok, texts[3])]
    script_generation(tiny_model, scripts, filler=ids(tok, " the")[0])
    if not share:  # prompt sharing off: the plain generate
        monkeypatch.setattr("trl_ext.eval.generate_with_shared_prompts", lambda generate, *a, **k: generate)
    prompts = ["Solve 2 + 2. Think, then answer."] * 4
    responses, cut = generate_responses(tiny_model, tok, prompts, 16, batch_size=4, stop_strings=STOP)
    assert responses == [texts[0], texts[1] + ">", texts[2], texts[3] + " the" * (16 - len(scripts[3]))]
    assert cut == [False, False, False, True]
    assert [course_r1_zero_right(r, "4") for r in responses] == [True, True, False, False]
    plain, plain_cut = generate_responses(tiny_model, tok, prompts, 16, batch_size=4)  # no stop string: runs on
    assert plain[0] == texts[0] + "\nUser: more" + " the" * (16 - len(scripts[0]))
    assert plain_cut == [True, True, False, True]


def test_task_evaluation_gives_no_credit_to_a_cut_response(tiny_model, tokenizer):
    tok = copy.deepcopy(tokenizer)
    # the last number of each response is the answer 4; the second is cut by the 6-token limit
    scripts = [ids(tok, " so 4") + [tok.eos_token_id], ids(tok, " 4 4 4 4")]  # 8 tokens: cut at 6, " 4 4 4"
    assert len(scripts[1]) > 6
    script_generation(tiny_model, scripts, filler=ids(tok, " the")[0])
    test = Dataset.from_dict({"prompt": ["What is 2 + 2?", "What is 2 + 2?", "What is 3 + 1?"], "answer": ["4"] * 3})

    def task(credit):
        return Task(
            name="gsm8k",
            train=None,
            test=test,
            scorer=lambda response, row: gsm8k_reward_fn(response, row["answer"]),
            max_new_tokens=6,
            credit_truncated=credit,
        )

    credited = task(True).evaluate(tiny_model, tok, progress=False)
    strict = task(False).evaluate(tiny_model, tok, progress=False)
    assert [r["truncated"] for r in strict["records"]] == [False, True, False]
    assert credited["accuracy"] == 1.0 and strict["accuracy"] == pytest.approx(2 / 3)
    assert strict["num_truncated"] == 1 and strict["distinct_prompts"] == 2 and strict["n"] == 3
    assert strict["records"][1]["format_reward"] == 1.0  # a number was found; it earns nothing


# ------------------------------------------------------------------------------------------------ training
GENERATION = dict(CPU_QUIET, per_device_train_batch_size=8, num_generations=4, max_completion_length=16, max_steps=1)
GENERATION.update(learning_rate=1e-3, temperature=1.0, beta=0.0)


def rollout_scripts(tok):
    """Eight scripted rollouts and what each must become: (tokens written, completion text, tokens kept, cut)."""
    stop = " so </think> <answer>4</answer>"
    over = overshooting(tok, " so </think> <answer>4</answer")
    late = " </answer> I mean </think> <answer>5</answer>"  # its first tag is held back (3 tokens < 4)
    eos = " the answer is 4"
    cut = " the answer is 4, 4, 4, 4, 4, 4, 4, 4"  # last number 4, never ends: 16 tokens, cut
    at_limit = " 1 1 1 </think> <answer>4</answer>"  # the stop completes on the 16th token
    more = ids(tok, "\nUser: next question")
    rows = [
        (ids(tok, stop) + more, stop, len(ids(tok, stop)), False),
        (over + more, stop, len(over), False),
        (ids(tok, late) + more, late, len(ids(tok, late)), False),
        (ids(tok, cut), None, 16, True),
        (ids(tok, eos) + [tok.eos_token_id], eos, len(ids(tok, eos)) + 1, False),  # TRL keeps the EOS token
        (ids(tok, at_limit) + more, at_limit, 16, False),
        (ids(tok, stop) + more, stop, len(ids(tok, stop)), False),
        (ids(tok, cut), None, 16, True),
    ]
    assert len(ids(tok, at_limit)) == 16 and len(ids(tok, cut)) > 16 and len(ids(tok, " </answer>")) == 3
    return rows


def make_trainer(model, tokenizer, tmp_path, task, **overrides):
    settings = {**GENERATION, **overrides}
    return tiny_grpo_trainer(model, tokenizer, tmp_path / "out", task.train, task.reward_funcs, **settings)


def last_number_task(stop=STOP, credit_truncated=False):
    rows = Dataset.from_dict({"prompt": ["Q: 2 + 2?"] * 8, "answer": ["4"] * 8})
    return Task(
        name="toy",
        train=rows,
        test=rows,
        scorer=lambda response, row: gsm8k_reward_fn(response, row["answer"]),
        stop=stop,
        credit_truncated=credit_truncated,
    )


@pytest.mark.parametrize("share_prompt_cache", [True, False])
def test_rollouts_end_at_the_stop_string_and_nothing_after_it_is_trained(
    tiny_model, tokenizer, tmp_path, share_prompt_cache
):
    trainer = make_trainer(tiny_model, tokenizer, tmp_path, last_number_task(), share_prompt_cache=share_prompt_cache)
    tok = trainer.processing_class
    assert trainer._stop_strings == STOP and trainer._min_completion_length == 4  # the task's, the handout's minimum
    assert trainer.generation_config.min_new_tokens == 4
    rows = rollout_scripts(tok)
    script_generation(tiny_model, [r[0] for r in rows], filler=ids(tok, " the")[0])
    seen = []
    scorer = trainer.reward_funcs[0]

    def spy(*args, **kwargs):
        seen.append((list(kwargs["completions"]), list(kwargs["completion_truncated"])))
        return scorer(*args, **kwargs)

    spy.__name__ = scorer.__name__
    trainer.reward_funcs = [spy]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = [{"prompt": "Q: 2 + 2?", "answer": "4"}] * 8
    out = trainer._generate_and_score_completions(inputs)
    kept = [r[2] for r in rows]
    assert out["completion_mask"].sum(dim=1).tolist() == kept  # nothing after the stop is in the loss mask
    for i, (written, _, n, _) in enumerate(rows):
        assert out["completion_ids"][i, :n].tolist() == written[:n]
    completions, cut = seen[0]
    texts = [r[1] for r in rows]
    assert [c for c, t in zip(completions, texts) if t is not None] == [t for t in texts if t is not None]
    assert cut == [r[3] for r in rows]
    # the course's rule: the stopped right answers are right; the cut ones earn no reward, though their last number is 4
    assert [course_r1_zero_right(c, "4") for c in completions] == [True, True, False, False, False, True, True, False]
    assert trainer._gathered_rewards[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert trainer._metrics["train"]["completions/clipped_ratio"][-1] == 2 / 8  # upstream's rule would say 7/8
    # mask_truncated_completions masks the two cut rows only (upstream's rule would mask every stopped row too)
    trainer.mask_truncated_completions = True
    out = trainer._generate_and_score_completions(inputs)
    assert out["completion_mask"].sum(dim=1).tolist() == [0 if r[3] else r[2] for r in rows]
    assert out["num_items_in_batch"].item() == sum(0 if r[3] else r[2] for r in rows)


def test_without_stop_strings_rollouts_run_on_and_a_cut_completion_is_credited(tiny_model, tokenizer, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, tmp_path, last_number_task(stop=(), credit_truncated=True))
    tok = trainer.processing_class
    assert trainer._stop_strings == () and trainer._min_completion_length == 0
    assert getattr(trainer.generation_config, "min_new_tokens", None) in (None, 0)
    rows = rollout_scripts(tok)
    script_generation(tiny_model, [r[0] for r in rows], filler=ids(tok, " the")[0])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions([{"prompt": "Q: 2 + 2?", "answer": "4"}] * 8)
    # only the EOS row ends early; every other runs to 16 tokens, whose text's last number is read
    eos_row = len(ids(tok, " the answer is 4")) + 1
    assert out["completion_mask"].sum(dim=1).tolist() == [16, 16, 16, 16, eos_row, 16, 16, 16]
    filler = ids(tok, " the")
    written = [(r[0] + filler * 16)[: eos_row if i == 4 else 16] for i, r in enumerate(rows)]
    expected = [gsm8k_reward_fn(tok.decode(w, skip_special_tokens=True), "4")["reward"] for w in written]
    assert trainer._gathered_rewards[:, 0].tolist() == expected
    assert expected[3] == expected[7] == 1.0  # the cut rows' last number is the answer: credited here


class FakeVLLM:
    """vLLM's generation as TRL 1.16 calls it: token ids up to the token that completed the stop string."""

    def __init__(self, completions, generation_kwargs=None):
        self.completions, self.generation_kwargs, self.synced = completions, dict(generation_kwargs or {}), 0

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler):
        rows = [self.completions[i % len(self.completions)] for i in range(len(prompts))]
        logprobs = [[[-0.1 * (j + 1)] for j in range(len(r))] for r in rows]
        return None, rows, logprobs, None


def test_vllm_rollouts_get_the_stop_and_are_cut_the_same_way(tiny_model, tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model, tokenizer, tmp_path, last_number_task())
    tok = trainer.processing_class
    over = overshooting(tok, " so </think> <answer>4</answer")
    fake = FakeVLLM([over, ids(tok, " 4 4")], generation_kwargs={"repetition_penalty": 1.0})
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_generation", fake, raising=False)
    trainer._set_up_stop_strings()  # as at construction with use_vllm: the stop reaches SamplingParams
    assert fake.generation_kwargs == {
        "repetition_penalty": 1.0,
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "min_tokens": 4,
    }
    trainer.model.train()
    _, completion_ids, completions = trainer.sample(["Q: 2 + 2?"] * 4)
    assert completions[0] == " so </think> <answer>4</answer>" and completion_ids[0] == over
    assert completions[1] == " 4 4" and trainer._completion_truncated == [False, True, False, True]
    logprobs = trainer._generate_single_turn([[1, 2]] * 2, None, {}, 2)[1]
    assert [len(lp) for lp in logprobs] == [len(over), len(ids(tok, " 4 4"))]


def test_stop_strings_config(tiny_model, tokenizer, tmp_path):
    assert trl_ext.GRPOConfig(output_dir=str(tmp_path), stop_strings=["a", "a"], use_cpu=True).stop_strings == ["a"]
    with pytest.raises(ValueError, match="min_completion_length=-1"):
        trl_ext.GRPOConfig(output_dir=str(tmp_path), min_completion_length=-1, use_cpu=True)
    # explicit [] turns the task's stop off; an explicit list replaces it; a minimum without stop strings applies
    off = make_trainer(tiny_model, tokenizer, tmp_path, last_number_task(), stop_strings=[])
    assert off._stop_strings == () and off._min_completion_length == 0
    other = make_trainer(
        tiny_model, tokenizer, tmp_path, last_number_task(), stop_strings=["\n\n"], min_completion_length=2
    )
    assert other._stop_strings == ("\n\n",) and other.generation_config.min_new_tokens == 2
    with pytest.raises(ValueError, match=r"generation_kwargs sets \['stop_strings'\] beside stop_strings"):
        make_trainer(tiny_model, tokenizer, tmp_path, last_number_task(), generation_kwargs={"stop_strings": ["x"]})


def test_training_warns_once_when_most_completions_are_cut(tiny_model, tokenizer, tmp_path, caplog):
    trainer = make_trainer(tiny_model, tokenizer, tmp_path, last_number_task())
    trainer.model.train()
    with caplog.at_level(logging.WARNING, logger="trl_ext"):
        trainer._metrics["train"]["completions/clipped_ratio"] += [0.5]  # half: not most
        trainer.log({})
        for _ in range(3):
            trainer._metrics["train"]["completions/clipped_ratio"] += [0.75, 1.0]
            trainer.log({})
    warned = [r.getMessage() for r in caplog.records if "max_completion_length" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].startswith("88% of the completions generated up to step 0 hit max_completion_length=16")
    assert "toy_reward gives them no reward" in warned[0]


def test_upstream_trainer_cut_completions_earn_nothing_by_upstreams_own_rule(tiny_model, tokenizer, tmp_path):
    """trl.GRPOTrainer does not pass completion_truncated: the task's reward reads TRL's own rule (the last token is
    neither EOS nor pad) from the trainer that calls it, so both trainers judge the same completions the same way."""
    import trl

    task = last_number_task(stop=(), credit_truncated=False)
    upstream = dict(trainer_cls=trl.GRPOTrainer, config_cls=trl.GRPOConfig, **GENERATION)
    trainer = tiny_grpo_trainer(tiny_model, tokenizer, tmp_path / "up", task.train, task.reward_funcs, **upstream)
    tok = trainer.processing_class
    rows = rollout_scripts(tok)
    script_generation(tiny_model, [r[0] for r in rows], filler=ids(tok, " the")[0])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    seen = []
    scorer = trainer.reward_funcs[0]

    def spy(*args, **kwargs):
        out = scorer(*args, **kwargs)
        seen.append(out)
        return out

    trainer.reward_funcs = [spy]
    trainer._generate_and_score_completions([{"prompt": "Q: 2 + 2?", "answer": "4"}] * 8)
    # every row but the EOS row runs to 16 tokens without EOS: cut, so nothing; the EOS row's " ... is 4" earns 1
    assert seen[0] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
