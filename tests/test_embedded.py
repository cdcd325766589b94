"""A few checks on the real embedded target, SmolLM2-135M-Instruct (dequantized from its GGUF)."""
import json
import subprocess
import sys

import pytest
import torch

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


def parts_only_at_a_near_tie(pair, ids, tokens, others, margin=0.5):
    """True when two greedy answers are equal, or part where the target's two best next tokens (scored in one
    pass over the shared prefix) are theirs, within ``margin`` in logit: a near-tie that the rounding of a
    multi-token pass can settle either way. (The int4 target rounds each token's activations to 8 bits, which
    turns float reassociation into whole quanta: on this prompt one position's two best logits were 0.33 apart
    decoding step by step and 0.02 the other way in one pass over the whole prefix.)"""
    common = next((i for i, (a, b) in enumerate(zip(tokens, others)) if a != b), None)
    if common is None:
        return True
    prefix = torch.cat([ids, torch.tensor([tokens[:common]], dtype=ids.dtype)], 1)
    with torch.no_grad():
        logits = pair.target(prefix).logits[0, -1, : pair.vocab_size].float()
    top = logits.topk(2)
    return {tokens[common], others[common]} == set(top.indices.tolist()) and float(top.values[0] - top.values[1]) < margin


def test_cli_default_models(capsys):
    assert main(["generate", "What is the capital of France?", "--json", "--max-new-tokens", "12"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "sd" and result["draft"] == "default" and result["tree"]  # the default job
    assert result["stats"]["new_tokens"] >= 1 and result["text"] != ""
    assert main(["generate", "What is the capital of France?", "--json", "--max-new-tokens", "12", "--method", "ar"]) == 0
    ar_text = json.loads(capsys.readouterr().out)["text"]
    # The Python API with no options runs the very same job.
    api = ModelPair.load()
    assert api.config().describe() == {key: result[key] for key in ("method", "divergence", "threshold", "gamma", "tree")}
    assert api.config().gamma_schedule == "cost"
    ids = api.encode("What is the capital of France?")
    ar = api.generate(ids, method="ar", max_new_tokens=12)
    assert ar.text == ar_text
    # Lossless: the int4 target's own greedy answer ("L'Étoile, ..." here, as llama.cpp's, whose logits favour it
    # over "The capital of France is Paris." by 0.35, ours by 0.15; float32's by 0.09 the other way), token for
    # token: its products (the int4 kernel) and attention (``core.attention``) give a token verified in a pass of
    # drafts the numbers of a one-token step. Floats (where the kernels cannot run) verify through PyTorch's
    # attention, which rounds a multi-token pass differently: their answers may part at a near-tie.
    default = api.generate(ids, max_new_tokens=12)
    if api.step.forward.heads.invariant:
        assert default.tokens == ar.tokens
    else:
        assert parts_only_at_a_near_tie(api, ids, default.tokens, ar.tokens)


def test_the_default_job_writes_the_int4_targets_own_greedy_text():
    """What a user of the README's command gets: the default job (EAGLE-2 trees, sd, timed draft sizes) writes,
    token for token, the text AR writes with the same int4 target, on prompts no drafter saw (everyday set) and
    the README's own. With PyTorch's attention in the verification, 11 of 13 such answers parted from AR's."""
    from pathlib import Path

    api = ModelPair.load()
    if not api.step.forward.heads.invariant:
        pytest.skip("the CPU kernels do not run here: floats verify through PyTorch's attention")
    everyday = Path(__file__).parents[1] / "fuzzyspec" / "prompts" / "everyday.jsonl"
    prompts = [json.loads(line)["prompt"] for line in everyday.read_text().splitlines()[::16]]
    for prompt in ["Give me three tips for writing clear emails.", *prompts]:
        ar = api.generate(prompt, method="ar", max_new_tokens=48)
        default = api.generate(prompt, max_new_tokens=48)
        trees = api.generate(prompt, max_new_tokens=48, gamma_schedule="constant")  # full trees at every step
        assert default.tokens == ar.tokens == trees.tokens, prompt
        assert trees.stats.target_forwards < len(trees.tokens)  # drafts were verified, and kept


SHIPPED_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples?",
    "Give me three tips for sleeping better.",
    "Explain how a bicycle stays upright.",
]
# Measured on these prompts (greedy, 64 new tokens, gamma 5) in float32, which rounds alike on every CPU class;
# in bfloat16 the target writes other text (1.88 and 1.98 were measured there), so the dtype is fixed. The test
# allows about 15% less.
DOCUMENTED_MEAN_ACCEPTED = {"draft": 1.42, "eagle": 1.70}


@pytest.mark.parametrize("draft", ["draft", "eagle"])
def test_shipped_drafters_reach_their_documented_acceptance(draft):
    pair = ModelPair.load(draft=draft, dtype="float32")
    new_tokens = forwards = 0
    for prompt in SHIPPED_PROMPTS:
        result = pair.generate(prompt, method="sd", gamma=5, gamma_schedule="constant", max_new_tokens=64,
                               eos_token_ids=())
        new_tokens += result.stats.new_tokens
        forwards += result.stats.target_forwards
    mean_accepted = new_tokens / forwards
    print(f"{draft}: {mean_accepted:.3f} tokens per target pass")
    assert mean_accepted >= 0.85 * DOCUMENTED_MEAN_ACCEPTED[draft]


@pytest.mark.parametrize("tree", [[], ["--tree"]])
def test_cli_with_the_shipped_eagle_head(capsys, tree):
    argv = ["generate", "Name a primary colour.", "--draft", "eagle", "--method", "fsd", "--json",
            "--max-new-tokens", "16", "--gamma-schedule", "constant", *tree]
    assert main(argv) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["new_tokens"] >= 1 and stats["draft_forwards"] >= 1


def test_greedy_eagle2_trees_equal_hf_generate(pair32):
    pair = pair32.with_drafter("eagle")
    ids = pair.encode("Name three colours.")
    expected = pair.target.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    result = pair.generate(ids, method="sd", tree=True, gamma_schedule="constant", max_new_tokens=24)
    assert result.tokens == expected
    assert result.stats.mean_accepted > 1.5


def test_the_main_command_loads_none_of_transformers_model_code():
    """The README's main command (the 4-bit target, the shipped EAGLE head, eager) imports none of transformers'
    model classes nor what they pull in: 3.4 s of a 7.5 s answer on a 2-core CPU (``core.llama``)."""
    heavy = ["transformers.modeling_utils", "transformers.models.llama.modeling_llama",
             "transformers.models.llama.configuration_llama", "torch._dynamo", "torch.distributed.tensor"]
    script = ("import sys; from fuzzyspec.cli import main; code = main(['generate', 'Name a sea.', '--max-new-tokens', "
              f"'4', '--json']); print([m for m in {heavy!r} if m in sys.modules]); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answer, loaded = done.stdout.strip().splitlines()
    assert json.loads(answer)["draft"] == "default" and loaded == "[]"
