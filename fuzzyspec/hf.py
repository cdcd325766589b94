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
        fsd_stats=stats,                    # receives a fuzzyspec.core.stats.Stats
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
``model.generate`` receives the prompt but is never handed to the callable (pass it
as ``fsd_streamer`` instead), and ``tokenizer`` is dropped too, so ``stop_strings``
cannot be used.
"""
from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .api import eos_token_ids
from .core.config import DecodeConfig
from .core.engine import decode
from .core.sampling import Sampling
from .core.stats import Stats
from .options import OPTIONS, OptionError

if TYPE_CHECKING:  # (transformers' model classes take seconds to import: see core.llama)
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerateDecoderOnlyOutput

# Logits processors that Sampling reproduces (the others are ignored with a warning).
SAMPLING_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
# Model inputs that HF prepares for its own loop and that decoding from input_ids alone may drop.
# "cache" is transformers 5.24's name for past_key_values (the empty cache generate prepares)
IGNORABLE_INPUTS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "cache",
                              "use_cache", "cache_position", "output_attentions", "output_hidden_states"})
DEFAULT_MAX_NEW_TOKENS = 20  # HF's model-agnostic default


HOOK_OPTIONS = [option for option in OPTIONS if option.hook]  # what the hook takes as fsd_<name>
HOOK_NAMES = {f"fsd_{option.name}" for option in HOOK_OPTIONS}


def generate(model: PreTrainedModel, input_ids: Tensor, logits_processor: LogitsProcessorList | None = None,
             stopping_criteria: StoppingCriteriaList | None = None, generation_config: GenerationConfig | None = None,
             draft_model: PreTrainedModel | None = None, fsd_draft: str | None = None,
             fsd_stats: list[Stats] | None = None, fsd_streamer: Any = None,
             **kwargs: Any) -> Tensor | GenerateDecoderOnlyOutput:
    """Generate with AR, SD, FSD or FSD-hybrid; returns prompt + new tokens ([1, L + n]) like HF ``generate``.

    Meant to be passed as ``custom_generate=fuzzyspec.hf.generate`` to ``model.generate``
    (see the module docstring for an example); called directly without a
    ``generation_config`` it goes through ``model.generate`` itself, so
    ``generate(target, ids, draft_model=draft, max_new_tokens=32)`` works too.

    draft_model: a draft model sharing the target's vocabulary; or fsd_draft: a drafter by name
        (``registry``: "eagle:DIR", "lookup", "self:N", a model id...). Neither is needed for "ar".
    fsd_<option>: every decoding option of ``options.OPTIONS`` but sampling and length (those come
        from the generation config): fsd_method, fsd_threshold, fsd_divergence, fsd_gamma, fsd_tree, ...
    fsd_seed: seeds the sampling; when None a seed is drawn from torch's global
        generator, so ``torch.manual_seed`` makes runs reproducible as with HF, where the draft sizes do not
        follow timings: with ``fsd_gamma_schedule="constant"`` (under the cost schedule they follow what each
        step was measured to cost, so a sampled run can differ from an earlier one).
    fsd_stats: a list that receives the run's ``Stats``.
    fsd_streamer: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``) that receives the
        prompt, then the tokens as they are accepted, then ``end()``. transformers does not hand its own
        ``streamer=`` argument to custom_generate callables, so give it here (calling this function
        directly, ``streamer=`` works too).

    Only one unpadded sequence is decoded per call. ``return_dict_in_generate=True`` gives a
    ``GenerateDecoderOnlyOutput`` with ``sequences`` only (no scores, logits or cache).
    """
    fsd = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("fsd_")}
    unknown = sorted(set(fsd) - {f"fsd_{o.name}" for o in HOOK_OPTIONS})
    if unknown:
        raise TypeError(f"unknown fuzzyspec option(s): {', '.join(unknown)}; valid: "
                        f"{', '.join(f'fsd_{o.name}' for o in HOOK_OPTIONS)}, fsd_draft, fsd_stats, fsd_streamer")
    if generation_config is None:
        # Called directly: let HF prepare the config, processors and criteria, then come back here.
        streamer = kwargs.pop("streamer", None)
        return model.generate(input_ids, custom_generate=generate, logits_processor=logits_processor,
                              stopping_criteria=stopping_criteria, draft_model=draft_model, fsd_draft=fsd_draft,
                              fsd_stats=fsd_stats, fsd_streamer=fsd_streamer or streamer, **fsd, **kwargs)
    model_kwargs = kwargs
    _check_inputs(model, input_ids, generation_config, model_kwargs)
    _warn_ignored_processors(logits_processor)
    input_ids = input_ids.to(model.get_input_embeddings().weight.device)
    prompt_len = input_ids.shape[1]
    max_new_tokens = _max_new_tokens(generation_config, prompt_len)
    config, drafter, vocab_size = _decoding(model, fsd, generation_config, max(max_new_tokens, 1), draft_model,
                                            fsd_draft)
    if fsd_streamer is not None:
        fsd_streamer.put(input_ids.cpu())
    if max_new_tokens < 1:
        if fsd_streamer is not None:
            fsd_streamer.end()
        return _output(input_ids, generation_config)

    # HF criteria look at the end of the sequence, but a step may add several tokens:
    # check each new prefix, and cut after the first one that stops.
    sequence = input_ids
    stop_at: list[int] = []

    def on_tokens(new: Tensor) -> bool:
        nonlocal sequence
        start = sequence.shape[1]
        sequence = torch.cat([sequence, new.to(sequence.device)], 1)  # (the engine hands its tokens over on the host)
        stopped = False
        if stopping_criteria:
            for end in range(start + 1, sequence.shape[1] + 1):
                if bool(stopping_criteria(sequence[:, :end], None)[0]):
                    stop_at.append(end)
                    stopped = True
                    break
        if fsd_streamer is not None:
            fsd_streamer.put(sequence[0, start: stop_at[0] if stopped else None].cpu())
        return stopped

    try:
        new_tokens, stats = decode(model, drafter, input_ids, config, vocab_size, on_tokens)
    finally:
        if fsd_streamer is not None:
            fsd_streamer.end()  # also on an error: an iterator streamer must not wait forever
    output = torch.cat([input_ids, new_tokens], 1)
    if stop_at:
        output = output[:, : stop_at[0]]
        stats.new_tokens = output.shape[1] - prompt_len
    if fsd_stats is not None:
        fsd_stats.append(stats)
    return _output(output, generation_config)


# transformers passes a custom_generate callable the keyword arguments its signature names: name every option.
generate.__signature__ = inspect.signature(generate).replace(parameters=[
    *[p for p in inspect.signature(generate).parameters.values() if p.kind != p.VAR_KEYWORD],
    *[inspect.Parameter(f"fsd_{o.name}", inspect.Parameter.KEYWORD_ONLY, default=None) for o in HOOK_OPTIONS],
    inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def _decoding(model: PreTrainedModel, fsd: dict[str, Any], generation_config: GenerationConfig, max_new_tokens: int,
              draft_model: PreTrainedModel | None, fsd_draft: str | None) -> tuple[DecodeConfig, Any, int]:
    """The request's config (decided as every interface decides it), its drafter and the shared vocabulary."""
    from .drafters.model import ModelDrafter
    from .drafters.registry import DrafterSpec, describe, load_drafter
    from .loading import logit_width, shared_vocab_size

    options = {name.removeprefix("fsd_"): value for name, value in fsd.items()}
    sampling = sampling_from(generation_config)
    if options.get("seed") is None:  # greedy decoding draws nothing: leave the global generator alone
        options["seed"] = 0 if sampling.greedy else int(torch.randint(2**62, (1,)).item())
    options |= {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "max_new_tokens": max_new_tokens}
    info = DrafterSpec("draft_model", False) if draft_model is not None else \
        describe(fsd_draft) if fsd_draft is not None else None
    try:
        config = DecodeConfig.from_options(options, drafter=info, eos_token_ids=eos_token_ids(generation_config))
    except OptionError as error:
        hint = "; pass draft_model=... or fsd_draft=NAME" if error.option == "method" and info is None else ""
        raise ValueError(error.spelled(f"fsd_{error.option}" if f"fsd_{error.option}" in HOOK_NAMES
                                       else error.option) + hint) from None
    if config.method == "ar":
        return config, None, shared_vocab_size(model)
    if draft_model is not None:
        vocab_size = shared_vocab_size(model, logit_width(draft_model))
        return config, ModelDrafter(draft_model, vocab_size), vocab_size
    source = load_drafter(fsd_draft, model, None)
    vocab_size = shared_vocab_size(model, source.width)
    return config, source.new(vocab_size), vocab_size


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
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
