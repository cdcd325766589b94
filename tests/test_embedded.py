"""A few checks on the real embedded target, SmolLM2-135M-Instruct (dequantized from its GGUF)."""
import json

import pytest

from fuzzyspec.api import ModelPair
from fuzzyspec.cli import main

pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def pair32():
    return ModelPair.load(draft="self:8", dtype="float32")


def test_embedded_target_is_smollm2(pair32):
    config = pair32.target.config
    assert (config.num_hidden_layers, config.hidden_size, pair32.vocab_size) == (30, 576, 49152)


def test_greedy_sd_equals_hf_generate(pair32):
    ids = pair32.encode("Name three colours.")
    expected = pair32.target.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    result = pair32.generate(ids, method="sd", max_new_tokens=24)
    assert result.tokens == expected
    assert result.text.strip()


def test_cli_default_models(capsys):
    assert main(["generate", "What is the capital of France?", "--json", "--max-new-tokens", "12"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "fsd" and result["stats"]["new_tokens"] >= 1
    assert "Paris" in result["text"]
