"""Shared fixtures: tiny randomly initialised Llama models built from configs."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tiny models gain nothing from threads, and a busy 2-core machine makes threads wait on each other.
torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Decoding files what its steps cost in ``profiles.json``; the tests' tiny models (each in a new pytest folder,
    so each a new key) would pile up in the user's own. Processes the tests start (the CLI, torchrun's ranks) file
    theirs in this session's file of their own (``$FUZZYSPEC_PROFILES``, read by processes started from here on:
    set before any test module builds the environment it hands them)."""
    if "FUZZYSPEC_PROFILES" not in os.environ:
        config._profiles_folder = tempfile.mkdtemp(prefix="fuzzyspec-test-profiles-")
        os.environ["FUZZYSPEC_PROFILES"] = str(Path(config._profiles_folder) / "profiles.json")


def pytest_unconfigure(config) -> None:
    folder = getattr(config, "_profiles_folder", None)
    if folder is not None:
        os.environ.pop("FUZZYSPEC_PROFILES", None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _profiles_kept_apart(monkeypatch, tmp_path_factory):
    """In the tests' own process: a test that names a cache keeps its profiles there (what it notes is read back
    from there, and no other test meets it); the others share one file of this test session's."""
    from fuzzyspec import files, tuning

    session = tmp_path_factory.getbasetemp() / "profiles.json"
    monkeypatch.setattr(tuning, "profile_path", lambda: files.cache_dir() / "profiles.json"
                        if "FUZZYSPEC_CACHE" in os.environ else session)


@pytest.fixture(autouse=True)
def _compiled_steps_kept_for_the_session(monkeypatch, tmp_path_factory):
    """The compiled steps the tests make are kept in a folder of this test session's (``core.kept``): shared by
    its tests (tiny models of one structure compile once), never met by another session's."""
    from fuzzyspec.core import kept

    folder = tmp_path_factory.getbasetemp() / "kept-steps"
    monkeypatch.setattr(kept, "folder", lambda: folder)


@pytest.fixture(autouse=True)
def _compiled_code_kept_in_one_place(monkeypatch):
    """A command run in the tests' process with --compile points inductor's cache into the fuzzyspec cache; the
    tests after it keep compiling where the session started, so graphs the tests share compile once."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])


def tiny_llama(vocab_size: int = 32, layers: int = 2, seed: int = 0, hidden: int = 32) -> LlamaForCausalLM:
    """A tiny random Llama in float32; its logits are scaled up so distributions are peaked like a real LM's."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return tiny_llama(seed=0)


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """The same architecture and weights plus Gaussian noise: a draft that agrees with ``model`` partly."""
    copy = tiny_llama(vocab_size=model.config.vocab_size, layers=model.config.num_hidden_layers,
                      hidden=model.config.hidden_size, seed=0)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in copy.parameters():
            if weight.numel() > 1:
                weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    return copy


@pytest.fixture(scope="session")
def draft(target) -> LlamaForCausalLM:
    """Agrees with the target's greedy token about half of the time."""
    return noisy_copy(target, 0.3, seed=1)


def save_tiny(folder: Path, tokenizer, layers: int = 1, seed: int = 0, vocab_size: int | None = None) -> str:
    """A tiny random Llama with ``tokenizer``'s vocabulary (or ``vocab_size`` logits), saved as an HF folder."""
    model = tiny_llama(vocab_size=vocab_size or len(tokenizer), layers=layers, seed=seed, hidden=16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from fuzzyspec.loading import gguf_tokenizer_folder
    return AutoTokenizer.from_pretrained(gguf_tokenizer_folder())


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, embedded_tokenizer) -> dict[str, str]:
    """Folders of tiny models: a target and a draft sharing the embedded tokenizer, one with a
    different tokenizer, and one whose logits are too few for its tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("models")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)} | {"<unk>": 40}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="w0")
    return {
        "target": save_tiny(root / "target", embedded_tokenizer, layers=2, seed=0),
        "draft": save_tiny(root / "draft", embedded_tokenizer, layers=1, seed=1),
        "other_vocab": save_tiny(root / "other", other, seed=2),
        "short_logits": save_tiny(root / "short", embedded_tokenizer, seed=3, vocab_size=1000),
    }


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.tensor([[1, 5, 9, 3, 7, 2]])


def run_step(step, cache, rows_tokens, tree=None, depths=None, keep=0, features=(), compiled=False):
    """Feed each row its tokens at its own length (a chain unless ``tree`` [B, k, k] and ``depths`` [B, k] say
    otherwise); returns what the forward returns."""
    from fuzzyspec.core.kvcache import attention_mask, chain_tree, write_positions

    tokens = torch.tensor(rows_tokens)
    rows, width = tokens.shape
    starts = torch.tensor(cache.lengths[:rows])
    tree = chain_tree(rows, width, "cpu") if tree is None else tree
    depths = torch.arange(width).expand(rows, width) if depths is None else depths
    mask = attention_mask(starts, tree, cache.capacity)
    return step(cache, tokens, starts[:, None] + depths, write_positions(starts, width), mask, None, keep, features,
                compiled=compiled)
