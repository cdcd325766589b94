"""EAGLE draft heads (Li et al. 2024): the model, its checkpoints, and a chain drafter.

The head predicts the target's next feature (its last hidden state, after the
final norm) from the current feature and the next token:

    f_hat[j+1] = layer( fc([embed(s[j+1]) ; f[j]]) )        logits = lm_head(f_hat[j+1])

``fc`` is Linear(2H -> H); ``layer`` is one decoder layer of the target's family
whose input norm is dropped (the input is already a sum of normed features),
as in the EAGLE-1/2 releases. The embedding and LM head are the target's own,
frozen and not stored. Like the releases, no final norm is applied before the
LM head: the head regresses features that the target has already normed.

Checkpoints use the layout of the official releases (yuhuili/EAGLE-*): a folder
with ``config.json`` (the target family's config with one layer, plus ``bias``
for ``fc``) and weights ``fc.*`` and ``layers.0.*`` in ``model.safetensors``
(``pytorch_model.bin`` is read too; an ``embed_tokens.weight`` is ignored).
A reduced draft vocabulary (``d2t``/``t2d`` beside the weights, as EAGLE-3 stores
them) makes the drafter read only those rows of the target's LM head.
"""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from .draftlm import cut_layers
from .drafters import BaseDrafter, Budget, Draft, common_prefix, draft_chain
from .eagle3 import Eagle3Head, is_eagle3, load_eagle3
from .core.kvcache import crop_to, model_mask
from .core.sampling import Sampling
from .core.vocab import DraftVocab, reduced_lm_head

_MASK_TAKES_CACHE_POSITION = "cache_position" in inspect.signature(create_causal_mask).parameters


def head_config(target_config: PretrainedConfig, bias: bool = True) -> PretrainedConfig:
    """The target's config cut to one layer: the config a head for that target is saved with."""
    config = cut_layers(target_config, [0])
    config.bias = bias
    config.architectures = ["LlamaForCausalLM"] if config.model_type == "llama" else config.architectures
    return config


class EagleHead(nn.Module):
    """fc over [token embedding ; feature], then one decoder layer; returns predicted features."""

    def __init__(self, config: PretrainedConfig, layer_class: type[nn.Module], rotary_class: type[nn.Module]) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=getattr(config, "bias", True))
        self.layers = nn.ModuleList([layer_class(config, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config=config)
        self.vocab: DraftVocab | None = None  # a reduced draft vocabulary: the target's LM head rows it reads

    @classmethod
    def for_target(cls, target: PreTrainedModel, config: PretrainedConfig | None = None) -> "EagleHead":
        """A head whose decoder layer is of the target's own family (Llama, Qwen2, Mistral, ...)."""
        decoder = target.get_decoder()
        head = cls(config or head_config(target.config), type(decoder.layers[0]), type(decoder.rotary_emb))
        return head.to(target.device)

    def forward(self, embeds: Tensor, features: Tensor, cache: DynamicCache | None = None,
                mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """embeds, features: [B, T, H] -> predicted features [B, T, H]. By default the T inputs
        sit at positions past .. past + T - 1 after the cache, causally; a draft tree passes its own
        4D ``mask`` (True: may attend) and ``positions`` ([B, T])."""
        hidden = self.fc(torch.cat([embeds, features], -1))
        past = cache.get_seq_length() if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
        extra = {"cache_position": torch.arange(past, past + hidden.shape[1], device=hidden.device)} \
            if _MASK_TAKES_CACHE_POSITION else {}
        if mask is None:
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                      past_key_values=cache, position_ids=positions, **extra)
        else:
            mask = model_mask(self, mask)
        return self.layers[0](hidden, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=cache is not None, position_embeddings=self.rotary_emb(hidden, positions),
                              **extra)

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the EAGLE release layout."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.to_json_file(folder / "config.json")
        weights = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb")}
        if self.vocab is not None:
            weights.update(self.vocab.maps())
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def load_head(folder: str | Path, target: PreTrainedModel) -> EagleHead:
    """Load a head saved by ``EagleHead.save`` or an official EAGLE-1/2 release, for ``target``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no EAGLE head at {folder}: config.json is missing")
    raw = json.loads((folder / "config.json").read_text())
    config = AutoConfig.for_model(**raw) if "model_type" in raw else head_config(target.config)
    config.bias = raw.get("bias", True)
    config._attn_implementation = target.config._attn_implementation  # else the mask is built for no kernel
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the EAGLE head at {folder} has hidden size {config.hidden_size}, "
                         f"the target {target.config.hidden_size}: it was trained for another target")
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        weights = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"no EAGLE head weights in {folder} (model.safetensors or pytorch_model.bin)")
    weights.pop("embed_tokens.weight", None)  # some releases store the target's embedding: ours is used
    vocab = DraftVocab.from_maps(weights.pop("d2t"), weights.pop("t2d", None)) if "d2t" in weights else None
    head = EagleHead.for_target(target, config)
    head.vocab = vocab
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise ValueError(f"EAGLE head at {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return head.to(dtype=target.dtype).eval()


HEADS = (EagleHead, Eagle3Head)  # the head kinds an EagleDrafter drives


def load_any_head(folder: str | Path, target: PreTrainedModel) -> EagleHead | Eagle3Head:
    """An EAGLE-3 head or an EAGLE-1/2 head, whichever layout ``folder`` holds."""
    return load_eagle3(folder, target) if is_eagle3(folder) else load_head(folder, target)


class EagleDrafter(BaseDrafter):
    """Drafts chains, or EAGLE-2 trees, with an EAGLE head (EAGLE-1/2 or EAGLE-3), fed the target's features.

    The engine hands it the target's hidden states at ``feature_layers`` (indices into the
    target's ``hidden_states``, concatenated; ``observe``) after each verification. Head
    positions computed from true features stay in its KV cache; those computed from its
    own predictions are recomputed next time.

    Trees (a budget with a tree shape: total nodes, depth, top_k) follow EAGLE-2's
    context-aware dynamic tree (Li et al. 2024): from the root, the ``top_k`` most likely
    tokens under the head become children; then for ``depth - 1`` more levels the ``top_k``
    frontier nodes of highest confidence (the product of draft probabilities along the path)
    are expanded, each into its own ``top_k`` children, in one head pass per level with tree
    attention. Finally all drafted nodes are reranked by confidence and the best ``total``
    kept (a child is never more confident than its parent, so the kept set holds its
    ancestors). EAGLE-2's published setting is total 60, depth 6, top_k 10.
    """

    wants_target_features = True
    drafts_trees = True

    def __init__(self, head: EagleHead | Eagle3Head, target: PreTrainedModel, vocab_size: int) -> None:
        super().__init__()
        self.head = head
        self.embed = target.get_input_embeddings()
        self.vocab_size = vocab_size
        if isinstance(head, Eagle3Head):
            self.vocab: DraftVocab | None = head.vocab
            self.feature_layers = head.feature_layers
            self._head_logits = head.logits
        else:  # EAGLE-1/2: the head predicts the target's last (normed) features; the target's LM head reads them
            self.vocab, self.feature_layers = head.vocab, [-1]
            if head.vocab is None:
                lm_head = target.get_output_embeddings()
                self._head_logits = lambda out: lm_head(out).float()[..., :vocab_size]
            else:  # only the rows of the draft vocabulary: a draft step reads N rows, not V
                if getattr(head, "reduced_lm_head", None) is None:  # made once per head, not per call
                    head.reduced_lm_head = reduced_lm_head(target.get_output_embeddings(), head.vocab)
                reduced = head.reduced_lm_head
                self._head_logits = lambda out: reduced(out).float()
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.features: Tensor | None = None  # true target features of positions 0 .. F - 1
        self.tokens: Tensor | None = None  # the sequence those features belong to
        self.true_positions = 0  # head cache positions computed from true features and tokens

    def observe(self, start: int, features: Tensor) -> None:
        """True target features ([1, n, F]) of positions start .. start + n - 1."""
        known = self.features[:, :start] if self.features is not None else features[:, :0]
        self.features = torch.cat([known, features], 1)
        self.true_positions = min(self.true_positions, start)

    @torch.inference_mode()
    def propose(self, sequence: Tensor, budget: Budget, sampling: Sampling,
                generator: torch.Generator | None) -> Draft | None:
        if self.features is None:  # nothing to draft from before the target's first pass
            return None
        hidden = self._root(sequence)
        if budget.tree is not None:
            return self._tree(sequence, hidden, budget.tree, sampling)

        def advance(token: Tensor) -> Tensor:
            nonlocal hidden
            hidden = self.head(self.embed(token), hidden, self.cache)
            self.forwards += 1
            return self._logits(hidden)

        return draft_chain(self._logits(hidden), advance, budget, sampling, generator, self.vocab)

    def _root(self, sequence: Tensor) -> Tensor:
        """Bring the head's cache up to date with the true features; return the predicted feature
        ([1, 1, H]) of the newest token, whose logits give the first draft."""
        # Head position j reads token j + 1 and feature j: positions 0 .. F - 1, with F <= len - 1.
        count = min(self.features.shape[1], sequence.shape[1] - 1)
        if self.tokens is not None:
            self.true_positions = min(self.true_positions, common_prefix(self.tokens, sequence) - 1)
        kept = max(0, min(self.true_positions, count - 1))  # always feed at least one position
        crop_to(self.cache, kept)
        embeds = self.embed(sequence[:, kept + 1: count + 1])
        hidden = self.head(embeds, self.features[:, kept:count].to(embeds.dtype), self.cache)[:, -1:]
        self.forwards += 1
        self.true_positions, self.tokens = count, sequence
        return hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        return self._head_logits(hidden[:, -1])

    def _tree(self, sequence: Tensor, root_hidden: Tensor, shape: tuple[int, int, int], sampling: Sampling) -> Draft:
        """An EAGLE-2 dynamic tree below the newest token (see the class docstring)."""
        total, max_depth, top_k = shape
        base = self.cache.get_seq_length()  # head positions from true features; tree nodes go after them
        root_logits = self._logits(root_hidden)[0]
        root_q = sampling.probs(root_logits)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # log confidence of each node
        depths: list[int] = []
        node_q: dict[int, tuple[Tensor, Tensor]] = {}  # expanded node -> (its logits, its q)

        def add_children(parent: int, probs: Tensor, depth: int) -> list[int]:
            values, ids = probs.topk(min(top_k, probs.shape[-1]))
            if self.vocab is not None:
                ids = self.vocab.to_target(ids)
            added = []
            for value, token in zip(values.tolist(), ids.tolist()):
                if value <= 0:
                    break
                added.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                scores.append((scores[parent] if parent >= 0 else 0.0) + math.log(value))
                depths.append(depth)
            return added

        frontier = add_children(-1, root_q, 1)
        hidden_of = {-1: root_hidden[0, -1]}
        in_cache: list[int] = []  # expanded nodes, in head cache order after ``base``
        for level in range(2, max_depth + 1):
            expand = sorted(frontier, key=lambda node: -scores[node])[:top_k]
            if not expand:
                break
            mask = torch.zeros(len(expand), base + len(in_cache) + len(expand), dtype=torch.bool,
                               device=sequence.device)
            mask[:, :base] = True
            slot = {node: base + i for i, node in enumerate(in_cache)}
            for row, node in enumerate(expand):
                ancestor = parents[node]
                while ancestor >= 0:
                    mask[row, slot[ancestor]] = True
                    ancestor = parents[ancestor]
                mask[row, base + len(in_cache) + row] = True
            positions = torch.tensor([[base - 1 + depths[node] for node in expand]], device=sequence.device)
            embeds = self.embed(torch.tensor([[tokens[node] for node in expand]], device=sequence.device))
            features = torch.stack([hidden_of[parents[node]] for node in expand])[None]
            hidden = self.head(embeds, features, self.cache, mask=mask[None, None], positions=positions)
            self.forwards += 1
            in_cache += expand
            logits = self._head_logits(hidden[0])
            probs = sampling.probs(logits)
            frontier = []
            for row, node in enumerate(expand):
                hidden_of[node] = hidden[0, row]
                node_q[node] = (logits[row], probs[row])
                frontier += add_children(node, probs[row], level)
        crop_to(self.cache, base)  # tree positions were computed from predictions: drop them

        kept = sorted(range(len(tokens)), key=lambda node: -scores[node])[:total]
        kept_set = set(kept)
        for node in list(kept):  # ties aside a child never outranks its parent; make sure anyway
            while parents[node] >= 0 and parents[node] not in kept_set:
                node = parents[node]
                kept_set.add(node)
        order = sorted(kept_set, key=lambda node: (depths[node], -scores[node]))
        new_index = {node: i for i, node in enumerate(order)}
        device = sequence.device
        q = torch.zeros(len(order) + 1, root_q.shape[-1], device=root_q.device)
        logits = torch.zeros_like(q)
        q[0], logits[0] = root_q, root_logits
        for node in order:
            if node in node_q:
                logits[new_index[node] + 1], q[new_index[node] + 1] = node_q[node]
        return Draft(torch.tensor([tokens[node] for node in order], device=device),
                     torch.tensor([new_index.get(parents[node], -1) for node in order], device=device),
                     q, logits, self.vocab, sampled=False)
