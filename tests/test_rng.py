"""No library call of trl_ext changes or consumes a random generator the user owns (issue 37, pytorch/pytorch#96309).

The user's generators: torch's default CPU generator, every device generator (CUDA, MPS, XPU), Python's ``random``
and NumPy's global RNG. ``sampling.probe()`` used to call ``torch.manual_seed(0/1/2)`` and put back only the CPU
state, leaving every GPU at seed 2. Without a GPU, the device side is checked as a fake device sees it: CUDA made to
look available with two devices, and every seeding or state-setting function of ``torch.cuda``, ``torch.mps`` and
``torch.xpu`` replaced by a recorder; nothing may be recorded. The host side is checked by the states themselves,
before and after. Generation's own sampling legitimately draws from the default generator (the user's draw, as
``torch.multinomial``'s): there the state after a trl_ext rollout must equal the state after upstream TRL's rollout.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import trl
from architectures import tiny_config, tiny_model
from conftest import length_mod5_reward
from datasets import Dataset
from transformers import AutoModelForCausalLM

import trl_ext
from trl_ext import models
from trl_ext.eval import generate_completions
from trl_ext.measurement.roofline import measure_peaks
from trl_ext.speed import packed_linear, sampling, shared_prompts
from trl_ext.speed.packed_linear import PackedLinearWeights
from trl_ext.speed.rng import model_devices, preserved_rng, unpreservable
from trl_ext.speed.sampling import same_draws_multinomial

SEEDING = {
    "cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
    "mps": ("manual_seed", "seed", "set_rng_state"),
    "xpu": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
}


def fake_devices(monkeypatch) -> list[str]:
    """CUDA looks available with two devices; every seeding/state-setting function of torch.cuda, torch.mps and
    torch.xpu records its call instead of running. Returns the record."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for kind, names in SEEDING.items():
        module = getattr(torch, kind)
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, _name=f"torch.{kind}.{name}", **k: calls.append(_name))
    return calls


def user_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_same_states(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0]), "torch's default CPU generator changed"
    assert before[1] == after[1], "Python's random changed"
    assert before[2][0] == after[2][0] and np.array_equal(before[2][1], after[2][1]), "NumPy's RNG changed"
    assert before[2][2:] == after[2][2:], "NumPy's RNG changed"


def set_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def draws_everywhere(*args) -> None:
    """A forward hook standing for a model that draws from every host generator (layerdrop, jitter, ...)."""
    torch.rand(1)
    random.random()
    np.random.rand()


@pytest.fixture
def fresh_probes(monkeypatch):
    """The once-per-process probes run again in the test."""
    monkeypatch.setattr(sampling, "_probe_result", False)
    monkeypatch.setattr(packed_linear, "_probe_results", {})


def test_the_fake_device_records_what_the_old_probe_did(monkeypatch):
    # the recorder sees torch.manual_seed's device side, as issue 37's probe called it
    calls = fake_devices(monkeypatch)
    state = torch.get_rng_state()
    torch.manual_seed(2)
    torch.set_rng_state(state)
    assert "torch.cuda.manual_seed_all" in calls and "torch.mps.manual_seed" in calls


def test_preserved_rng_puts_back_every_generator_it_is_given(monkeypatch):
    calls = fake_devices(monkeypatch)
    device_states = {"cuda:1": torch.tensor([1, 2, 3], dtype=torch.uint8), "mps": torch.tensor([4], dtype=torch.uint8)}
    put_back = []

    def get_state(module):
        return lambda device: device_states[str(device)].clone()

    def set_state(new_state, device):
        put_back.append((str(device), new_state.tolist()))

    for kind in ("cuda", "mps"):
        monkeypatch.setattr(getattr(torch, kind), "get_rng_state", get_state(kind))
        monkeypatch.setattr(getattr(torch, kind), "set_rng_state", set_state)
    before = user_states()
    with preserved_rng([torch.device("cuda", 1), "mps", "cpu", torch.device("cuda", 1)]):
        draws_everywhere()
    assert_same_states(before, user_states())
    assert sorted(put_back) == [("cuda:1", [1, 2, 3]), ("mps", [4])]  # each named device once, its own state
    assert calls == []  # no seeding call; set_rng_state was replaced by the fake above, not the recorder
    assert unpreservable(["cpu", "cuda:1", "meta"]) is None and unpreservable(["cpu", "xla:0"]) == torch.device("xla:0")
    with pytest.raises(RuntimeError, match="no generator module for device xla:0"), preserved_rng(["xla:0"]):
        pass


def test_model_devices_lists_parameters_buffers_and_offload_execution_devices(tokenizer):
    model = tiny_model("gpt2", len(tokenizer))
    assert model_devices(model) == [torch.device("cpu")]
    assert model_devices(object()) == []

    class OffloadHook:  # accelerate's AlignDevicesHook: weights on meta, moved to the execution device per forward
        execution_device = "cuda:1"

    model.lm_head._hf_hook = OffloadHook()
    model.transformer.h[0]._hf_hook = OffloadHook()
    with torch.device("meta"):
        model.transformer.wpe = torch.nn.Embedding(4, 4)
    assert model_devices(model) == [torch.device("cpu"), torch.device("meta"), torch.device("cuda", 1)]


def test_the_sampler_probe_and_block_touch_no_user_generator(monkeypatch, fresh_probes):
    calls = fake_devices(monkeypatch)
    torch.manual_seed(123)  # the user's seed (recorded: the user's own call)
    calls.clear()
    before = user_states()
    assert sampling.probe() is None
    with same_draws_multinomial():
        pass
    assert calls == []
    assert_same_states(before, user_states())
    assert torch.initial_seed() == 123


def test_the_savings_probe_and_training_noise_put_back_what_the_model_draws(tokenizer, monkeypatch, fresh_probes):
    config = tiny_config("llama", len(tokenizer))
    config.attention_dropout = 0.1  # a random training forward: training_noise's two forwards draw
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().train()
    model.register_forward_hook(draws_everywhere)
    calls = fake_devices(monkeypatch)
    before = user_states()
    decision = shared_prompts.savings_decision(model)
    noise = shared_prompts.training_noise(model)
    assert decision.share_prompts is None  # the probe ran its forwards and greedy generation
    assert noise is not None and "attention_dropout=0.1" in noise  # the forwards drew dropout masks
    assert calls == []
    assert_same_states(before, user_states())


def test_packed_linear_setup_probe_and_forwards_touch_no_user_generator(tokenizer, monkeypatch, fresh_probes):
    model = tiny_model("llama", len(tokenizer)).eval()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    calls = fake_devices(monkeypatch)
    before = user_states()
    for backend in ["onednn"] + (["mkl"] if packed_linear._mkl_ops_available() else []):
        assert packed_linear.probe_backend(backend, 2) is None
        packed = PackedLinearWeights(backend=backend)
        with torch.no_grad(), packed.fixed_weights(), packed.applied(model, rows=2):
            model(input_ids=ids)
            model(input_ids=ids[:, :1])
            assert len(packed) > 0
    assert calls == []
    assert_same_states(before, user_states())


def test_greedy_evaluation_touches_no_user_generator(tokenizer, monkeypatch, fresh_probes):
    model = tiny_model("llama", len(tokenizer))
    tok = copy.deepcopy(tokenizer)
    calls = fake_devices(monkeypatch)
    before = user_states()
    answers = generate_completions(model, tok, ["1 + 1 =", "2 + 2 =", "3 + 3 ="], 4, batch_size=2)
    assert len(answers) == 3
    assert calls == []
    assert_same_states(before, user_states())


def test_measuring_the_machine_peaks_touches_no_user_generator(monkeypatch):
    calls = fake_devices(monkeypatch)
    before = user_states()
    peaks = measure_peaks("cpu", budget_s=0.01, matmul_size=64, copy_bytes=2**16)
    assert peaks.matmul_flops_per_s > 0
    assert calls == []
    assert_same_states(before, user_states())


def test_converting_the_embedded_checkpoint_touches_no_user_generator(tokenizer, monkeypatch, tmp_path):
    # the conversion builds a fresh model from the GGUF's config (random initialisation) before loading the weights
    quantized = tiny_model("llama", len(tokenizer))

    class Loader:
        from_pretrained = staticmethod(lambda *a, **k: quantized)
        from_config = staticmethod(AutoModelForCausalLM.from_config)

    class TokenizerLoader:
        from_pretrained = staticmethod(lambda *a, **k: copy.deepcopy(tokenizer))

    monkeypatch.setattr(models, "AutoModelForCausalLM", Loader)
    monkeypatch.setattr(models, "AutoTokenizer", TokenizerLoader)
    calls = fake_devices(monkeypatch)
    before = user_states()
    models._convert_gguf(Path(tmp_path / "model.gguf"), tmp_path / "out")
    assert calls == []
    assert_same_states(before, user_states())
    assert (tmp_path / "out" / "config.json").exists()


def test_a_grpo_rollout_draws_what_upstreams_rollout_draws_and_seeds_nothing(
    tokenizer, tmp_path, monkeypatch, fresh_probes
):
    """One transformers rollout of trl_ext.GRPOTrainer, its library-side probes included (the sampler's, the savings
    probe and training noise, the packing probe), leaves every host generator where upstream TRL's own rollout of the
    same prompts leaves it, and calls no device seeding function."""
    length = 4
    args = trl_ext.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=length,
        generation_kwargs={"min_new_tokens": length},  # every row decodes `length` tokens: draws fixed in number
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        temperature=1.0,
    )
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    trainer = trl_ext.GRPOTrainer(
        model=tiny_model("llama", len(tokenizer)),
        reward_funcs=length_mod5_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["Count to 3:", "Say hi:"]}),
        processing_class=tok,
    )
    base = trainer.model
    base.__dict__.pop("_trl_ext_savings", None)  # the rollout probes the model again
    base.__dict__.pop("_trl_ext_noise", None)
    base.train()
    prompt_ids = [ids for text in ["Count to 3:", "Say hi:"] for ids in [tok(text)["input_ids"]] * 2]
    calls = fake_devices(monkeypatch)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    calls.clear()
    start = user_states()
    ours, _ = trainer._generate_single_turn(prompt_ids, None, {}, 2)
    assert calls == []
    assert "_trl_ext_savings" in base.__dict__ and sampling._probe_result is None  # the probes ran in the rollout
    after_ours = user_states()
    set_states(start)
    theirs, _ = trl.GRPOTrainer._generate_single_turn(trainer, prompt_ids, None, {}, 2)
    assert_same_states(user_states(), after_ours)
    assert all(len(c) == length for c in ours + theirs)
    assert torch.get_rng_state().ne(start[0]).any()  # sampling drew from the user's generator: the user's draw
