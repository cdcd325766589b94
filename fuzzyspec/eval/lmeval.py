"""An lm-evaluation-harness model, ``fuzzyspec``: generation through FSD, log-likelihoods from the target.

    fuzzyspec lm-eval run --model fuzzyspec --model_args draft=eagle,method=sd,tree=true --tasks TASK
    fuzzyspec lm-eval run --model fuzzyspec --model_args method=fsd,threshold=0.3 --tasks TASK --include_path DIR

``generate_until`` requests run through the decoding engine with any decoding option of
``options.OPTIONS`` given as a model argument (``method``, ``threshold``, ``divergence``, ``gamma``,
``tree``, ...) beside ``target``, ``draft``, ``dtype`` and ``device``; the request's own ``until``,
``max_gen_toks``, ``do_sample``, ``temperature``, ``top_p`` and ``top_k`` apply per request. So a
task's score under FSD can be set beside its score under SD or AR with nothing else changed.
``loglikelihood`` and ``loglikelihood_rolling`` score with the target alone (one teacher-forced
forward; a drafter has no say in a likelihood).

lm-eval 0.4 finds models only in its own registry (it reads no entry points), so importing this
module registers the name; ``fuzzyspec lm-eval ARGS`` does that and then runs lm-eval's command line
with ARGS. From Python: ``import fuzzyspec.eval.lmeval`` and then ``lm_eval.simple_evaluate(model="fuzzyspec", ...)``.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..api import ModelPair, input_device
from ..core.config import DecodeConfig
from ..core.scoring import log_probs, target_logits
from ..drafters.registry import describe
from ..options import BY_NAME, DEFAULT_DRAFT, OptionError, value_parser

log = logging.getLogger(__name__)

# Set per request by lm-eval's generation arguments, not by model arguments.
PER_REQUEST = ("temperature", "top_k", "top_p", "max_new_tokens")


def _option_value(name: str, value: Any) -> Any:
    """A model argument as the type of its option (lm-eval passes numbers, booleans or strings)."""
    if isinstance(value, bool) and isinstance(BY_NAME[name].default, bool):
        return value
    try:
        return value_parser(BY_NAME[name])(str(value))
    except OptionError as error:
        raise ValueError(f"fuzzyspec: model argument {error.spelled(name)}") from None


@register_model("fuzzyspec")
class FuzzySpecLM(TemplateLM):
    """The target and drafter of a ``ModelPair`` behind lm-eval's model interface."""

    def __init__(self, target: str | None = None, draft: str | None = None, dtype: str = "auto",
                 device: str | None = None, max_length: int | None = None, batch_size: int | str = 1,
                 weights: str = "auto", **options: Any) -> None:
        super().__init__()
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            if device is not None:  # lm-eval's own --device defaults to cuda
                log.warning("fuzzyspec: --device %s, but torch sees no CUDA GPU: running on the cpu", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        unknown = sorted(set(options) - set(BY_NAME) - {"device_map"})
        if unknown or set(options) & set(PER_REQUEST):
            bad = unknown or sorted(set(options) & set(PER_REQUEST))
            raise ValueError(f"fuzzyspec: unknown model argument {bad[0]!r} (decoding options: "
                             f"{', '.join(n for n in BY_NAME if n not in PER_REQUEST)}; sampling and lengths "
                             "come from the task's generation arguments)")
        options.pop("device_map", None)
        self.options = {name: _option_value(name, value) for name, value in options.items()}
        # The same request as on the command line: the default job's drafter unless AR is asked for.
        draft = None if self.options.get("method") == "ar" else draft or DEFAULT_DRAFT
        try:  # every check, before any model loads
            DecodeConfig.from_options(self.options, drafter=describe(draft) if draft is not None else None)
        except OptionError as error:
            raise ValueError(f"fuzzyspec: model argument {error}") from None
        self.pair = ModelPair.load(target, draft, dtype, device, weights)
        self.pair.target.eval()
        self.tokenizer = self.pair.tokenizer
        self._max_length = max_length or getattr(self.pair.target.config, "max_position_embeddings", 2048)
        self.new_tokens = self.target_forwards = 0  # over every generate_until call, for the log

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of ``continuation`` after ``context`` under the target, and whether it is
        the target's greedy continuation."""
        ids = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([ids], device=input_device(self.pair.target))
        log_p = log_probs(target_logits(self.pair.target, inputs, len(ids) - len(continuation), self.pair.vocab_size))
        wanted = torch.tensor(continuation, device=log_p.device)
        picked = log_p.gather(-1, wanted[:, None]).squeeze(-1)
        return float(picked.sum()), bool((log_p.argmax(-1) == wanted).all())

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        results = []
        for _, context, continuation in tqdm(requests, desc="fuzzyspec loglikelihood", disable=disable_tqdm):
            results.append(self._score(context, continuation) if continuation else (0.0, True))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in tqdm(requests, desc="fuzzyspec loglikelihood_rolling", disable=disable_tqdm):
            windows = get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                                                context_len=1)
            totals.append(sum(self._score(*make_disjoint_window(window))[0] for window in windows))
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in tqdm(requests, desc="fuzzyspec generate", disable=disable_tqdm):
            context, arguments = request.args
            arguments = dict(arguments or {})
            until = arguments.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            sampled = bool(arguments.pop("do_sample", False)) or float(arguments.get("temperature") or 0) > 0
            temperature = float(arguments.pop("temperature", 1.0) or 0) if sampled else 0.0
            options = dict(self.options, temperature=temperature,
                           top_p=float(arguments.pop("top_p", 1.0) or 1.0) if sampled else 1.0,
                           top_k=int(arguments.pop("top_k", 0) or 0) if sampled else 0,
                           max_new_tokens=int(arguments.pop("max_gen_toks", 256)))
            ids = self.tok_encode(context)[-(self.max_length - options["max_new_tokens"]):]
            config = self.pair.config(**options)
            result = self.pair.generate(torch.tensor([ids], device=input_device(self.pair.target)), stop=until,
                                        config=config)
            self.new_tokens += result.stats.new_tokens
            self.target_forwards += result.stats.target_forwards
            answers.append(result.text)
        if requests:
            log.info("fuzzyspec: %d generations, %.2f tokens per target pass", len(requests),
                     self.new_tokens / self.target_forwards if self.target_forwards else math.nan)
        return answers


def run_cli(argv: list[str]) -> None:
    """lm-eval's command line with the ``fuzzyspec`` model registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
