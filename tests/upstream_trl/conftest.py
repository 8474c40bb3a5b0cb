"""Run TRL 1.16's own ``tests/test_grpo_trainer.py`` offline, as upstream or with trl_ext swapped in (issue 39).

``scripts/upstream_grpo_tests.py`` copies TRL's ``tests/test_grpo_trainer.py`` and ``tests/testing_utils.py`` (Apache
2.0, unmodified) into this directory (git-ignored: they are TRL's files, fetched, not committed) and runs them twice.
This conftest changes nothing in them; it only makes their Hub names resolve on a machine without the Hub:

* **models**: each ``trl-internal-testing/tiny-<Arch>For<Head>...`` id the file loads as a text model is built once
  (cached under ``$TRL_EXT_CACHE``/``~/.cache/trl_ext``) as a local directory of that very path, relative to a stand-in
  root that every test runs in (``monkeypatch.chdir``): transformers and datasets treat an existing local directory
  as the repository itself, so ``from_pretrained``/``load_dataset`` resolve the id with their own rule and no
  loading function is patched. Each stand-in is a random 2-layer model of the named architecture
  (``SIZES``: width 16) with a byte-level BPE tokenizer laid out like Qwen2.5's: vocabulary
  151,665, ``<|endoftext|>`` = 151643 (pad), ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645 (EOS), the ids the
  upstream file hard-codes (its ``test_training_with_mask_truncated_completions`` fakes ``generate`` with them), and
  TRL's own chat template of the family (``trl/chat_templates``). Ids not built (vision models, remote code,
  ``Qwen/Qwen2.5-0.5B-Instruct`` of the skipped vLLM tests) fail to load offline in both runs alike.
* **datasets**: ``trl-internal-testing/zen`` is a local dataset repository of the same layout (README ``configs``,
  parquet per split) with the ``standard_prompt_only`` and ``conversational_prompt_only`` configs: the 19 Zen of
  Python prompts of TRL's ``scripts/generate_zen_dataset.py``, split 17 train / 2 test unshuffled as there. The
  image datasets are not built.
* **helpers**: the ``is_*_available`` checks the file's ``testing_utils.py`` imports from ``trl.import_utils`` but TRL
  1.16 does not have (``IMPORT_SHIMS``: the copy run here is from a TRL checkout whose helpers differ) are added to
  ``trl.import_utils`` with TRL's meaning (the package can be imported), before the file is imported.
* **CPU**: where no CUDA device is visible, every ``TrainingArguments`` gets ``use_cpu=True, bf16=False`` (set
  before transformers' own checks): TRL's configs default to ``bf16=True``, which transformers refuses on a CPU
  without ``use_cpu``, and CPU bf16 autocast is many times slower; the file is written for TRL's GPU CI.
* **swap**: with ``TRL_EXT_UPSTREAM_SWAP=1`` every test module's ``GRPOTrainer`` and ``GRPOConfig`` (bound by its
  ``from trl import GRPOConfig, GRPOTrainer``) are ``trl_ext``'s, for the duration of each test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SWAP_ENV = "TRL_EXT_UPSTREAM_SWAP"
ORG = "trl-internal-testing"
VOCAB_SIZE = 151665  # Qwen2.5's (tiny-Qwen2ForCausalLM-2.5's) vocabulary size
SPECIAL = {  # Qwen2.5's ids; the rest of Qwen2.5's added tokens up to VOCAB_SIZE, then Llama 3's pad token
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
}
EXTRA_SPECIAL = ("<|finetune_right_pad_id|>", "<think>", "</think>")  # ids VOCAB_SIZE, VOCAB_SIZE + 1, ...
# hub id (after ORG/) -> (model_type, head, TRL chat template of the family)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen2_5"),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "classification", "qwen2_5"),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal", "qwen3"),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "classification", "qwen3"),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", "qwen3"),
    "tiny-LlamaForCausalLM-3.2": ("llama", "causal", "llama3_2"),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "classification", "llama3_2"),
    "tiny-MistralForCausalLM-0.2": ("mistral", "causal", "qwen2_5"),
    "tiny-Gemma2ForCausalLM": ("gemma2", "causal", "gemma"),
    "tiny-GptOssForCausalLM": ("gpt_oss", "causal", "gptoss"),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal", "glm4moe"),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal", "cohere2"),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal", "nemotron_3_nano"),
}
ZEN_PROMPTS = (  # TRL's scripts/generate_zen_dataset.py, standard_prompt_only (PEP 20's lines, cut)
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one-- and preferably",
    "Although that way may not be obvious at first unless you're",
    "Now is",
    "Although never is often",
    "If the implementation is hard to explain,",
    "If the implementation is easy",
    "Namespaces are one honking great",
)
ZEN_TEST_ROWS = 2  # train_test_split(test_size=0.1, shuffle=False) of 19 rows
SIZES = dict(  # 2 layers of width 16; the MoE fields of the MoE stand-ins (unknown fields are ignored)
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=512,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
)
STAND_IN_VERSION = "1"
IMPORT_SHIMS = {  # trl.import_utils helper -> the package it checks for
    "is_fastapi_available": "fastapi",
    "is_joblib_available": "joblib",
    "is_pydantic_available": "pydantic",
    "is_uvicorn_available": "uvicorn",
    "is_vllm_ascend_available": "vllm_ascend",
}


def _add_import_shims() -> None:
    import importlib.util

    from trl import import_utils

    for name, package in IMPORT_SHIMS.items():
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda package=package: importlib.util.find_spec(package) is not None)


_add_import_shims()  # bump when what is built changes: the cache is keyed by it


def _tokenizer(template: str):
    """A Qwen2Tokenizer (byte-level BPE, Qwen's pre-tokenizer) trained on the Zen prompts, laid out like Qwen2.5's
    vocabulary (``SPECIAL`` at Qwen2.5's ids, unreachable filler entries below them) plus ``EXTRA_SPECIAL``;
    EOS ``<|im_end|>``, pad ``<|endoftext|>``, no BOS, TRL's ``template`` chat template."""
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    probe = Qwen2Tokenizer()
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = probe._tokenizer.normalizer
    bpe.pre_tokenizer = probe._tokenizer.pre_tokenizer
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(list(ZEN_PROMPTS) * 4, bpe_trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab = dict(state["vocab"])
    first_special = min(SPECIAL.values())
    vocab.update({f"\u0100\u0100filler{i}": i for i in range(len(vocab), first_special)})
    vocab.update(SPECIAL)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL if t not in ("<|endoftext|>", "<|im_end|>")],
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(EXTRA_SPECIAL)}, replace_extra_special_tokens=False)
    path = Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja"
    tokenizer.chat_template = path.read_text()
    return tokenizer


def _model(model_type: str, head: str, tokenizer):
    """A random fp32 2-layer model of ``model_type`` (``head`` 'causal' or 'classification', 1 label) of width 16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **SIZES, **ids)
    text = config.get_text_config()
    for target in {id(config): config, id(text): text}.values():
        if isinstance(getattr(target, "layer_types", None), list):
            target.layer_types = target.layer_types[: target.num_hidden_layers]
        if getattr(target, "sliding_window", None) is not None:
            target.sliding_window = 8
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if head == "causal":
            model = AutoModelForCausalLM.from_config(config)
            model.generation_config = GenerationConfig(**special)
        else:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
    return model.float()


def _zen(root: Path) -> None:
    """``root/trl-internal-testing/zen``: a local dataset repository with the two prompt-only configs."""
    from datasets import Dataset

    repo = root / ORG / "zen"
    split_at = len(ZEN_PROMPTS) - ZEN_TEST_ROWS
    rows = {
        "standard_prompt_only": [{"prompt": p} for p in ZEN_PROMPTS],
        "conversational_prompt_only": [{"prompt": [{"role": "user", "content": p}]} for p in ZEN_PROMPTS],
    }
    card = ["---", "configs:"]
    for name, config_rows in rows.items():
        card += [f"- config_name: {name}", "  data_files:"]
        for split, part in (("train", config_rows[:split_at]), ("test", config_rows[split_at:])):
            Dataset.from_list(part).to_parquet(str(repo / name / f"{split}-00000-of-00001.parquet"))
            card += [f"  - split: {split}", f"    path: {name}/{split}-*.parquet"]
    card += ["---", ""]
    (repo / "README.md").write_text("\n".join(card))


def build_stand_ins(root: Path) -> Path:
    """Build every stand-in under ``root`` (models and the zen dataset); return ``root``. Idempotent (a marker)."""
    marker = root / "complete"
    if marker.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    tokenizers = {}
    for name, (model_type, head, template) in MODELS.items():
        if template not in tokenizers:
            tokenizers[template] = _tokenizer(template)
        path = root / ORG / name
        _model(model_type, head, tokenizers[template]).save_pretrained(path)
        tokenizers[template].save_pretrained(path)
    _zen(root)
    marker.write_text(STAND_IN_VERSION)
    return root


def stand_in_root() -> Path:
    cache = Path(os.environ.get("TRL_EXT_CACHE") or Path.home() / ".cache" / "trl_ext")
    return cache / f"upstream_trl_stand_ins_v{STAND_IN_VERSION}"


@pytest.fixture(scope="session")
def _stand_ins() -> Path:
    return build_stand_ins(stand_in_root())


@pytest.fixture(autouse=True)
def _offline_hub_and_swap(request, monkeypatch, _stand_ins):
    """Run in the stand-in root (Hub ids resolve to its directories); swap in trl_ext's classes when asked."""
    monkeypatch.chdir(_stand_ins)
    import torch
    import transformers

    if not torch.cuda.is_available():
        post_init = transformers.TrainingArguments.__post_init__

        def cpu_post_init(self, *args, **kwargs):
            self.use_cpu = True
            self.bf16 = False  # TRL's GPU default; CPU bf16 autocast is many times slower here
            post_init(self, *args, **kwargs)

        monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", cpu_post_init)
    if os.environ.get(SWAP_ENV) == "1":
        import trl_ext

        for name in ("GRPOTrainer", "GRPOConfig"):
            if hasattr(request.module, name):
                monkeypatch.setattr(request.module, name, getattr(trl_ext, name))
