import json

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from fuzzyspec.data import TokenDataset
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.drafters.draftlm import load_draft_lm
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.eagle import EagleDrafter
from fuzzyspec.drafters.eagle_head import load_head
from fuzzyspec.drafters.eagle3 import load_eagle3
from fuzzyspec.train.config import TrainConfig
from fuzzyspec.train.loop import train

V = 32


@pytest.fixture(scope="module")
def corpus():
    """Sequences from a simple repeating grammar, so a small drafter can learn the target's habits."""
    g = np.random.default_rng(0)
    sequences = []
    for _ in range(96):
        start = g.integers(0, V)
        sequences.append([(start + 3 * i + (i % 4 == 0)) % V for i in range(g.integers(20, 40))])
    return TokenDataset.from_sequences(sequences[:80]), TokenDataset.from_sequences(sequences[80:])


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(vocab_size=V, layers=3, seed=5)


OBJECTIVES = {"eagle": "EagleObjective", "eagle3": "Eagle3Objective", "draft": "DraftObjective"}


@pytest.mark.parametrize("kind, extra", [("eagle", {}), ("eagle3", {"draft_vocab": 24, "ttt_steps": 3}),
                                         ("draft", {}), ("draft", {"draft_vocab": 24, "loss": "tv"}),
                                         ("draft", {"loss": "js"})])
def test_training_lowers_the_loss_and_reloads(tmp_path, corpus, target_model, kind, extra):
    train_data, eval_data = corpus
    losses = []
    import fuzzyspec.objectives as module
    cls = getattr(module, OBJECTIVES[kind])
    original = cls.loss

    def recording(self, tokens, lengths, loss_from):
        loss, agreement = original(self, tokens, lengths, loss_from)
        losses.append(loss.item())
        return loss, agreement

    cls.loss = recording
    try:
        config = TrainConfig(kind=kind, out=str(tmp_path / kind), epochs=6, batch_size=8, lr=3e-3, warmup_steps=5,
                             layers=1, eval_sequences=16, **extra)
        metrics = train(config, train_data, eval_data, target=target_model, progress=False)
    finally:
        cls.loss = original
    assert metrics["finished"] and metrics["steps"] == 60
    if kind != "eagle" and extra.get("loss", "ce") == "ce":  # cross-entropy bottoms out at the target's entropy
        assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05
    else:
        assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    assert json.loads((tmp_path / kind / "metrics.json").read_text())["steps"] == 60
    assert metrics["held_out_top1_agreement"] > 0.2  # chance is 1/32
    assert metrics["draft_vocab"] == extra.get("draft_vocab", None if kind != "eagle3" else V)
    assert len(metrics["held_out_by_step"]) == extra.get("ttt_steps", 1)

    # The saved drafter reloads and gives the same logits as the trained one (stored in bfloat16).
    prompt = torch.tensor([[1, 4, 7, 10, 14, 17]])
    with torch.no_grad():
        if kind == "eagle":
            features = target_model(prompt, output_hidden_states=True).hidden_states[-1]
            head = load_head(tmp_path / kind, target_model)
            again = load_head(tmp_path / kind, target_model)
            embeds = target_model.get_input_embeddings()(prompt[:, 1:])
            assert torch.equal(head(embeds, features[:, :-1]), again(embeds, features[:, :-1]))
            drafter = EagleDrafter(head, target_model, V)
        elif kind == "eagle3":
            head = load_eagle3(tmp_path / kind, target_model)
            assert len(head.vocab) == extra["draft_vocab"]
            drafter = EagleDrafter(head, target_model, V)
        else:
            draft = load_draft_lm(tmp_path / kind, target_model)
            again = load_draft_lm(tmp_path / kind, target_model)
            assert torch.equal(draft.model(prompt).logits, again.model(prompt).logits)
            assert draft.window == metrics["config"]["max_tokens"]  # (what its drafter reads at most)
            if "draft_vocab" in extra:
                assert draft.model(prompt).logits.shape[-1] == extra["draft_vocab"] == len(draft.vocab)
            drafter = ModelDrafter(draft.model, V, draft.vocab)
    # And it drafts inside the loop, losslessly under greedy SD.
    tokens, stats = decode(target_model, drafter, prompt, DecodeConfig(method="sd", max_new_tokens=24), V)
    expected = target_model.generate(prompt, max_new_tokens=24, do_sample=False)[0, 6:]
    assert tokens[0].tolist() == expected.tolist()
    assert stats.proposed > 0


def test_resume_and_budget(tmp_path, corpus, target_model):
    train_data, eval_data = corpus
    config = TrainConfig(kind="eagle", out=str(tmp_path / "run"), epochs=2, batch_size=8, eval_sequences=8)
    first = train(TrainConfig(**{**config.__dict__, "epochs": 1}), train_data, eval_data, target=target_model,
                  progress=False)
    assert first["steps"] == 10
    second = train(config, train_data, eval_data, target=target_model, progress=False)
    assert second["steps"] == 20 and second["trained_tokens"] > first["trained_tokens"]
    stopped = train(TrainConfig(**{**config.__dict__, "out": str(tmp_path / "b"), "budget_minutes": 1e-9}),
                    train_data, eval_data, target=target_model, progress=False)
    assert stopped["steps"] == 0 and not stopped["finished"]
    # Starting from a saved drafter: with a vanishing learning rate, it scores as the saved one did.
    again = train(TrainConfig(**{**config.__dict__, "out": str(tmp_path / "c"), "epochs": 0.1, "lr": 1e-12,
                                 "init": str(tmp_path / "run")}), train_data, eval_data, target=target_model,
                  progress=False)
    assert again["held_out_top1_agreement"] == pytest.approx(second["held_out_top1_agreement"], abs=0.02)


def test_bad_config():
    with pytest.raises(ValueError):
        TrainConfig(kind="medusa", out="x")
    with pytest.raises(ValueError):
        TrainConfig(kind="eagle", out="x", batch_size=0)
    with pytest.raises(ValueError, match="loss"):
        TrainConfig(kind="draft", out="x", loss="kl")
    with pytest.raises(ValueError, match="eagle3"):
        TrainConfig(kind="eagle", out="x", draft_vocab=100)


def test_interrupt_keeps_a_resumable_checkpoint(tmp_path, corpus, target_model, monkeypatch):
    import fuzzyspec.objectives as module
    train_data, eval_data = corpus
    original, calls = module.EagleObjective.loss, []

    def interrupted(self, tokens, lengths, loss_from):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self, tokens, lengths, loss_from)

    monkeypatch.setattr(module.EagleObjective, "loss", interrupted)
    config = TrainConfig(kind="eagle", out=str(tmp_path / "run"), epochs=1, batch_size=8, eval_sequences=8)
    with pytest.raises(KeyboardInterrupt):
        train(config, train_data, eval_data, target=target_model, progress=False)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(module.EagleObjective, "loss", original)
    assert train(config, train_data, eval_data, target=target_model, progress=False)["steps"] == 10
