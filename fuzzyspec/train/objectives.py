"""What a drafter learns: one objective per drafter kind, and the distillation losses they share.

Every objective runs the frozen target on a batch (no gradients) and trains the
drafter toward the target's next-token distributions p at the positions a
batch's ``loss_from`` marks (the response, for prompt + response data).

Distillation losses between p and the draft's q (``LOSSES``): SD accepts a draft
with probability 1 - TV(p, q) in expectation, and FSD where D(p, q) <= T, so the
loss can be the judge itself (DistillSpec, Zhou et al. 2024):

- ``ce``: cross-entropy -sum p log q, i.e. KL(p || q) up to p's entropy;
- ``tv``: total variation 0.5 sum |p - q|;
- ``js``: Jensen-Shannon, FSD's default divergence.

With a reduced draft vocabulary q is zero outside its N tokens; p's mass there
is pooled into one bin, which gives TV and JS exactly (their terms for q = 0
are linear in p) and adds only a constant to CE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from ..core.vocab import DraftVocab
from ..drafters.draftlm import make_draft_lm, own_weights, save_draft_lm
from ..drafters.eagle3 import make_eagle3
from ..drafters.eagle_head import EagleHead
from .config import LOSSES



def distill_loss(name: str, p: Tensor, log_q: Tensor) -> Tensor:
    """Per-position loss between the target's mass ``p`` on the draft's tokens ([..., N], summing to at most
    1) and the draft's log-distribution ``log_q`` ([..., N]); see the module docstring."""
    if name == "ce":
        return -(p * log_q).sum(-1)
    q = log_q.exp()
    outside = (1 - p.sum(-1)).clamp_min(0)  # the target's mass on tokens the draft cannot propose
    if name == "tv":
        return 0.5 * ((p - q).abs().sum(-1) + outside)
    if name == "js":
        log_m = (0.5 * (p + q)).clamp_min(1e-30).log()
        return 0.5 * (torch.xlogy(p, p) - p * log_m).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1) \
            + 0.5 * math.log(2) * outside
    raise ValueError(f"unknown distillation loss {name!r}; valid: {', '.join(LOSSES)}")


def loss_mask(lengths: Tensor, loss_from: Tensor, width: int, offset: int) -> Tensor:
    """[B, width] mask of the entries t whose target distribution sits at position r = t + offset:
    r must lie inside the sequence and predict a token at or past ``loss_from``."""
    r = torch.arange(width, device=lengths.device)[None] + offset
    return (r < lengths[:, None]) & (r + 1 >= loss_from[:, None])


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1)


@dataclass
class StepEval:
    """Held-out, teacher-forced measures of one draft step at the positions evaluated: whether the draft's top
    token is the target's, and TV and JS between p and q (1 - TV is SD's acceptance probability there;
    FSD with JS accepts where JS <= T)."""

    same: Tensor  # [n] bool
    tv: Tensor  # [n]
    js: Tensor  # [n]

    @staticmethod
    def of(log_q: Tensor, p: Tensor, draft_top: Tensor, target_top: Tensor, mask: Tensor) -> "StepEval":
        return StepEval((draft_top == target_top)[mask].cpu(), distill_loss("tv", p, log_q)[mask].float().cpu(),
                        distill_loss("js", p, log_q)[mask].float().cpu())


def _target_probs(logits: Tensor, vocab: DraftVocab | None) -> Tensor:
    """The target's softmax, on the draft vocabulary's columns when it has one (float32)."""
    probs = logits.float().softmax(-1)
    return vocab.restrict(probs) if vocab is not None else probs


class EagleObjective:
    """EAGLE-1/2: regress the target's next (normed, last-layer) feature, plus cross-entropy through its LM head.

    loss = regression_weight * SmoothL1(f_hat, f) + ce_weight * CE(p, lm_head(f_hat)), with uniform
    noise of +-``noise`` on the input features (EAGLE's recipe: weights 1.0 and 0.1).
    """

    def __init__(self, target: PreTrainedModel, config) -> None:
        self.target, self.config = target, config
        self.model = EagleHead.for_target(target).float()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def _features(self, tokens: Tensor) -> Tensor:
        with torch.no_grad():
            out = self.target(input_ids=tokens, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1].float()

    def _predict(self, tokens: Tensor, features: Tensor, noise: float) -> Tensor:
        inputs = features[:, :-1]
        if noise:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        return self.model(self.embed(tokens[:, 1:]).float(), inputs)

    def loss(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> tuple[Tensor, float]:
        features = self._features(tokens)
        predicted = self._predict(tokens, features, self.config.noise)
        valid = loss_mask(lengths, loss_from, tokens.shape[1] - 1, 1)
        regression = masked_mean(F.smooth_l1_loss(predicted, features[:, 1:], reduction="none").mean(-1), valid)
        with torch.no_grad():
            target_logits = self.lm_head(features[:, 1:].to(self.lm_head.weight.dtype)).float()
        logits = self.lm_head(predicted.to(self.lm_head.weight.dtype)).float()
        cross_entropy = masked_mean(-(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1), valid)
        agreement = masked_mean((logits.argmax(-1) == target_logits.argmax(-1)).float(), valid)
        loss = self.config.regression_weight * regression + self.config.ce_weight * cross_entropy
        return loss, float(agreement)

    @torch.no_grad()
    def evaluate(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> list[StepEval]:
        features = self._features(tokens)
        predicted = self._predict(tokens, features, 0.0)
        dtype = self.lm_head.weight.dtype
        target_logits = self.lm_head(features[:, 1:].to(dtype)).float()
        log_q = self.lm_head(predicted.to(dtype)).float().log_softmax(-1)
        valid = loss_mask(lengths, loss_from, tokens.shape[1] - 1, 1)
        return [StepEval.of(log_q, target_logits.softmax(-1), log_q.argmax(-1), target_logits.argmax(-1), valid)]

    def trainable(self) -> dict[str, Tensor]:
        return self.model.state_dict()

    def load(self, weights: dict[str, Tensor]) -> None:
        self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)

    def save(self, folder) -> None:
        head = EagleHead.for_target(self.target, self.model.config)
        head.load_state_dict(self.model.state_dict())
        head.to(torch.bfloat16).save(folder)


class Eagle3Objective:
    """EAGLE-3: predict tokens (the target's distribution, by ``loss``) from fused features, unrolled.

    The head runs ``ttt_steps`` times over each sequence, each time on its own previous outputs
    ("training-time test", ``Eagle3Head.unroll``), so it learns to draft k tokens ahead from what
    drafting will really feed it. Step s weighs ``ttt_decay ** s``.
    """

    def __init__(self, target: PreTrainedModel, config, vocab: DraftVocab) -> None:
        self.target, self.config, self.vocab = target, config, vocab
        self.model = make_eagle3(target, vocab, config.feature_layers, config.train_lm_head).float()
        self.embed = target.get_input_embeddings()

    def _target(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(fused features [B, T, 3H], p on the draft vocabulary [B, T, N], the target's argmax [B, T])."""
        with torch.no_grad():
            out = self.target(input_ids=tokens, output_hidden_states=True)
            features = torch.cat([out.hidden_states[i] for i in self.model.feature_layers], -1)
            return features.float(), _target_probs(out.logits, self.vocab), out.logits.argmax(-1)

    def _steps(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor, steps: int
               ) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Per unrolled step: (draft log-probs [B, w, N], target p [B, w, N], target argmax [B, w], mask [B, w])."""
        features, p, top = self._target(tokens)
        outputs = self.model.unroll(self.embed(tokens[:, 1:]).float(), features[:, :-1], steps)
        width = tokens.shape[1] - 1
        result = []
        for step, out in enumerate(outputs):
            w = width - step  # index j reads token j + step + 1, which must exist
            if w <= 0:
                break
            r = step + 1  # index j predicts the distribution at position j + r
            log_q = self.model.logits(out[:, :w]).log_softmax(-1)
            result.append((log_q, p[:, r: r + w], top[:, r: r + w], loss_mask(lengths, loss_from, w, r)))
        return result

    def loss(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> tuple[Tensor, float]:
        total = weights = 0.0
        agreement = 0.0
        for step, (log_q, p, top, mask) in enumerate(self._steps(tokens, lengths, loss_from, self.config.ttt_steps)):
            weight = self.config.ttt_decay ** step
            total = total + weight * masked_mean(distill_loss(self.config.loss, p, log_q), mask)
            weights += weight
            if step == 0:
                agreement = float(masked_mean((self.vocab.to_target(log_q.argmax(-1)) == top).float(), mask))
        return total / weights, agreement

    @torch.no_grad()
    def evaluate(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> list[StepEval]:
        return [StepEval.of(log_q, p, self.vocab.to_target(log_q.argmax(-1)), top, mask)
                for log_q, p, top, mask in self._steps(tokens, lengths, loss_from, self.config.ttt_steps)]

    def trainable(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.model.state_dict().items()
                if self.model.stores_lm_head or not k.startswith("lm_head")}

    def load(self, weights: dict[str, Tensor]) -> None:
        self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)

    def save(self, folder) -> None:
        self.model.save(folder)


class DraftObjective:
    """A small draft LM (shared embedding; the target's LM head, cut to ``vocab``) distilled by ``loss``."""

    def __init__(self, target: PreTrainedModel, config, vocab: DraftVocab | None) -> None:
        self.target, self.config, self.vocab = target, config, vocab
        self.draft = make_draft_lm(target, config.layers, vocab=vocab)
        self.model = self.draft.model
        shared = {id(target.get_input_embeddings().weight), id(target.get_output_embeddings().weight)}
        for weight in self.model.parameters():
            if id(weight) not in shared:  # trained weights in float32; the shared ones stay frozen as they are
                weight.data = weight.data.float()

    def _outputs(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(draft log-probs [B, T, N], target p [B, T, N], target argmax [B, T])."""
        with torch.no_grad():
            target_logits = self.target(input_ids=tokens).logits
            p, top = _target_probs(target_logits, self.vocab), target_logits.argmax(-1)
        logits = self.model(input_ids=tokens).logits.float()
        if self.vocab is None:
            logits = logits[..., : p.shape[-1]]
        return logits.log_softmax(-1), p, top

    def _draft_top(self, log_q: Tensor) -> Tensor:
        top = log_q.argmax(-1)
        return self.vocab.to_target(top) if self.vocab is not None else top

    def loss(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> tuple[Tensor, float]:
        log_q, p, top = self._outputs(tokens)
        mask = loss_mask(lengths, loss_from, tokens.shape[1], 0)
        agreement = masked_mean((self._draft_top(log_q) == top).float(), mask)
        return masked_mean(distill_loss(self.config.loss, p, log_q), mask), float(agreement)

    @torch.no_grad()
    def evaluate(self, tokens: Tensor, lengths: Tensor, loss_from: Tensor) -> list[StepEval]:
        log_q, p, top = self._outputs(tokens)
        mask = loss_mask(lengths, loss_from, tokens.shape[1], 0)
        return [StepEval.of(log_q, p, self._draft_top(log_q), top, mask)]

    def trainable(self) -> dict[str, Tensor]:
        return own_weights(self.model)

    def load(self, weights: dict[str, Tensor]) -> None:
        self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)

    def save(self, folder) -> None:
        save_draft_lm(self.draft, folder)

