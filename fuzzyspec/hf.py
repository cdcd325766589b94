"""Fuzzy speculative decoding as a Hugging Face ``custom_generate`` hook.

transformers 5 lets ``model.generate`` hand its prepared inputs to any callable
passed as ``custom_generate``; the callable's own keyword arguments (here
``draft_model`` and the ``fsd_*`` options) are passed through. So a target
model decodes with FSD through its usual ``generate`` call::

    import fuzzyspec.hf

    stats = []
    out = target.generate(
        input_ids,                          # [1, L]: one sequence, no padding
        custom_generate=fuzzyspec.hf.generate,
        draft_model=draft,                  # shares the target's vocabulary
        fsd_method="fsd",                   # "ar", "sd", "fsd" or "fsd-hybrid"
        fsd_threshold=0.4,
        fsd_divergence="js",
        fsd_stats=stats,                    # receives a fuzzyspec.stats.Stats
        max_new_tokens=64, do_sample=True, temperature=0.6, top_p=0.9,
    )
    text = tokenizer.decode(out[0, input_ids.shape[1]:])
    print(stats[0].mean_accepted)

What is honoured from the generation config: ``do_sample`` (False is greedy),
``temperature``, ``top_k``, ``top_p`` (HF fills in its defaults, e.g. top_k 50
when sampling, and those are what is used), ``max_new_tokens``/``max_length``,
the EOS ids, and every stopping criterion HF prepared (max time, custom
``stopping_criteria``). Other logits processors (repetition penalty, min_p,
...) cannot be applied by the speculative loop: they are ignored with a warning.

Limits of transformers' hook, not of this module: a ``streamer`` passed to
``generate`` receives the prompt but is never handed to the callable, and
``tokenizer`` is dropped too, so ``stop_strings`` cannot be used.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .decoding import METHODS, DecodeConfig, decode
from .drafters import ModelDrafter
from .loading import logit_width
from .sampling import Sampling
from .stats import Stats

# Logits processors that Sampling reproduces (the others are ignored with a warning).
SAMPLING_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
# Model inputs that HF prepares for its own loop and that decoding from input_ids alone may drop.
IGNORABLE_INPUTS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "past_key_values",
                              "use_cache", "cache_position", "output_attentions", "output_hidden_states"})
DEFAULT_MAX_NEW_TOKENS = 20  # HF's model-agnostic default


def generate(
    model: PreTrainedModel,
    input_ids: Tensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    draft_model: PreTrainedModel | None = None,
    fsd_method: str = "fsd",
    fsd_threshold: float = 0.3,
    fsd_divergence: str = "js",
    fsd_gamma: int = 5,
    fsd_raw_divergence: bool = False,
    fsd_seed: int | None = None,
    fsd_stats: list[Stats] | None = None,
    **model_kwargs: Any,
) -> Tensor | GenerateDecoderOnlyOutput:
    """Generate with AR, SD, FSD or FSD-hybrid; returns prompt + new tokens ([1, L + n]) like HF ``generate``.

    Meant to be passed as ``custom_generate=fuzzyspec.hf.generate`` to ``model.generate``
    (see the module docstring for an example); called directly without a
    ``generation_config`` it goes through ``model.generate`` itself, so
    ``generate(target, ids, draft_model=draft, max_new_tokens=32)`` works too.

    draft_model: the draft (not needed for ``fsd_method="ar"``); logits past the
        narrower of the two output embeddings are dropped.
    fsd_method, fsd_threshold, fsd_divergence, fsd_gamma, fsd_raw_divergence:
        ``DecodeConfig``'s method, threshold, divergence, gamma, raw_divergence.
    fsd_seed: seeds the sampling; when None a seed is drawn from torch's global
        generator, so ``torch.manual_seed`` makes runs reproducible as with HF.
    fsd_stats: a list that receives the run's ``Stats``.

    Only one unpadded sequence is decoded per call (batching comes later).
    ``return_dict_in_generate=True`` gives a ``GenerateDecoderOnlyOutput`` with
    ``sequences`` only (no scores, logits or cache).
    """
    if generation_config is None:
        # Called directly: let HF prepare the config, processors and criteria, then come back here.
        return model.generate(
            input_ids, custom_generate=generate, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, draft_model=draft_model, fsd_method=fsd_method,
            fsd_threshold=fsd_threshold, fsd_divergence=fsd_divergence, fsd_gamma=fsd_gamma,
            fsd_raw_divergence=fsd_raw_divergence, fsd_seed=fsd_seed, fsd_stats=fsd_stats, **model_kwargs)

    _check_inputs(model, input_ids, generation_config, model_kwargs)
    if fsd_method not in METHODS:
        raise ValueError(f"unknown fsd_method {fsd_method!r}; valid: {', '.join(METHODS)}")
    if fsd_method != "ar" and draft_model is None:
        raise ValueError(f"fsd_method={fsd_method!r} needs a draft model: pass draft_model=... to generate "
                         "(or use fsd_method='ar' to decode with the target alone)")
    _warn_ignored_processors(logits_processor)

    input_ids = input_ids.to(model.get_input_embeddings().weight.device)
    prompt_len = input_ids.shape[1]
    max_new_tokens = _max_new_tokens(generation_config, prompt_len)
    if max_new_tokens < 1:
        return _output(input_ids, generation_config)
    sampling = sampling_from(generation_config)
    seed = fsd_seed
    if seed is None:  # greedy decoding draws nothing: leave the global generator alone
        seed = 0 if sampling.greedy else int(torch.randint(2**62, (1,)).item())
    config = DecodeConfig(
        method=fsd_method, gamma=fsd_gamma, divergence=fsd_divergence, threshold=fsd_threshold,
        raw_divergence=fsd_raw_divergence, sampling=sampling,
        max_new_tokens=max_new_tokens, seed=seed, eos_token_ids=eos_token_ids(generation_config))
    use_draft = fsd_method != "ar"
    vocab_size = min(logit_width(model), logit_width(draft_model)) if use_draft else logit_width(model)
    drafter = ModelDrafter(draft_model, vocab_size) if use_draft else None

    # HF criteria look at the end of the sequence, but a step may add several tokens:
    # check each new prefix, and cut after the first one that stops.
    sequence = input_ids
    stop_at: list[int] = []

    def on_tokens(new: Tensor) -> bool:
        nonlocal sequence
        start = sequence.shape[1]
        sequence = torch.cat([sequence, new], 1)
        if not stopping_criteria:
            return False
        for end in range(start + 1, sequence.shape[1] + 1):
            if bool(stopping_criteria(sequence[:, :end], None)[0]):
                stop_at.append(end)
                return True
        return False

    new_tokens, stats = decode(model, drafter, input_ids, config, vocab_size, on_tokens)
    output = torch.cat([input_ids, new_tokens], 1)
    if stop_at:
        output = output[:, : stop_at[0]]
        stats.new_tokens = output.shape[1] - prompt_len
    if fsd_stats is not None:
        fsd_stats.append(stats)
    return _output(output, generation_config)


def sampling_from(generation_config: GenerationConfig) -> Sampling:
    """The Sampling that ``generation_config`` asks for: greedy unless ``do_sample``; top-k and
    top-p as it holds them (HF's defaults included), unset meaning off."""
    if not generation_config.do_sample:
        return Sampling()
    temperature = generation_config.temperature
    top_p = generation_config.top_p
    return Sampling(temperature=1.0 if temperature is None else float(temperature),
                    top_k=int(generation_config.top_k or 0),
                    top_p=1.0 if top_p is None else float(top_p))


def eos_token_ids(generation_config: GenerationConfig) -> tuple[int, ...]:
    """EOS ids from the prepared ``_eos_token_tensor``, else ``eos_token_id`` (an int or a list)."""
    tensor = getattr(generation_config, "_eos_token_tensor", None)
    if tensor is not None:
        ids = tensor.reshape(-1).tolist()
    else:
        eos = generation_config.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(sorted({int(i) for i in ids}))


def _max_new_tokens(generation_config: GenerationConfig, prompt_len: int) -> int:
    # Inside HF generate, max_length = max_new_tokens + prompt length already.
    if generation_config.max_length is not None:
        return generation_config.max_length - prompt_len
    if generation_config.max_new_tokens is not None:
        return generation_config.max_new_tokens
    return DEFAULT_MAX_NEW_TOKENS


def _check_inputs(model: PreTrainedModel, input_ids: Tensor, generation_config: GenerationConfig,
                  model_kwargs: dict[str, Any]) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("fuzzyspec.hf.generate supports decoder-only models only")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("fuzzyspec.hf.generate does not do beam search (num_beams must be 1)")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("fuzzyspec.hf.generate returns one sequence (num_return_sequences must be 1)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"fuzzyspec.hf.generate decodes one sequence at a time (batch size 1), got input_ids of "
                         f"shape {tuple(input_ids.shape)}; batching comes later")
    if input_ids.shape[1] < 1:
        raise ValueError("fuzzyspec.hf.generate needs a prompt of at least one token in input_ids "
                         "(inputs_embeds is not supported)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool((mask == 0).any()):
        raise ValueError("the attention_mask has zeros: fuzzyspec.hf.generate does not support padded inputs")
    unsupported = sorted(k for k, v in model_kwargs.items() if v is not None and k not in IGNORABLE_INPUTS)
    if unsupported:
        raise ValueError(f"fuzzyspec.hf.generate decodes from input_ids alone and would ignore: "
                         f"{', '.join(unsupported)}")


def _warn_ignored_processors(logits_processor: LogitsProcessorList | None) -> None:
    ignored = [type(p).__name__ for p in logits_processor or () if not isinstance(p, SAMPLING_PROCESSORS)]
    if ignored:
        warnings.warn(f"fuzzyspec.hf.generate applies temperature, top_k and top_p only; ignoring logits "
                      f"processors: {', '.join(ignored)}", UserWarning, stacklevel=3)


def _output(sequences: Tensor, generation_config: GenerationConfig) -> Tensor | GenerateDecoderOnlyOutput:
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
