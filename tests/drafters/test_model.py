import dataclasses

import torch

from conftest import tiny_llama
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.drafters.model import ModelDrafter

V = 32


def test_past_its_window_the_draft_reads_the_texts_end_as_a_text_of_its_own():
    """Past ``window`` positions (what it trained on) a draft LM reads the text's last ones alone: its first draft at
    every step is what it computes over the text from its offset on, as if the text began there, and greedy
    decoding is still the target's."""
    target, draft = tiny_llama(vocab_size=V, seed=0), tiny_llama(vocab_size=V, layers=1, seed=7)
    drafter = ModelDrafter(draft, V, window=12)
    original, offsets = drafter.propose, []

    def checking(sequence, budget, sampling, generator):
        proposed = original(sequence, dataclasses.replace(budget, distributions=True), sampling, generator)
        with torch.no_grad():
            expected = draft(sequence[:, drafter.offset:]).logits[0, -1]
        assert torch.allclose(proposed.logits[0], expected, atol=1e-4)
        offsets.append(drafter.offset)
        return proposed

    drafter.propose = checking
    prompt = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(4))
    tokens, _ = decode(target, drafter, prompt, DecodeConfig(method="sd", gamma=3, max_new_tokens=30), V)
    assert offsets[0] == 20 - 1 - 6 and len(set(offsets)) > 2  # the prompt's end, then later ends
    assert tokens[0].tolist() == target.generate(prompt, max_new_tokens=30, do_sample=False)[0, 20:].tolist()
