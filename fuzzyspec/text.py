"""From tokens to text as they are accepted: incremental detokenization and stop strings."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_prompt(prompt: str) -> None:
    """A text prompt must hold something, and be text: a lone surrogate (from bytes that are not UTF-8 in a
    command line, or an escaped half of a pair in JSON) cannot be encoded, so say so in one line rather than
    fail inside a tokenizer."""
    check_text(prompt, "the prompt")
    if not prompt.strip():
        raise ValueError("the prompt is empty")


def check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid UTF-8 text (at character {error.start}: "
                         f"{text[error.start]!r})") from None


class TextStream:
    """Feed token ids as they are accepted; get back the text that is safe to show.

    Text is held back while it ends in an incomplete UTF-8 sequence or in the
    beginning of a stop string. Once a stop string appears, the text ends just
    before it and ``stopped`` turns True.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # what has been handed out so far
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the newly shown text."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._advance(full[:cut])
        return self._advance(full[: len(full) - self._held_back(full)])

    def finish(self) -> str:
        """Return whatever was held back, once no more tokens will come."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _held_back(self, full: str) -> int:
        hold = 1 if full.endswith("\ufffd") else 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _advance(self, shown: str) -> str:
        if len(shown) <= len(self.text):
            return ""
        delta = shown[len(self.text):]
        self.text = shown
        return delta
