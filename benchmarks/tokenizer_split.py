"""The embedded target's tokenizer as fuzzyspec converts it (digits isolated, as llama.cpp's ``smollm`` split does)
against transformers' conversion of the same GGUF (GPT-2's split alone), on ShareGPT messages.

Prints how many messages the two tokenize differently; on those, the target's loss a character with each (the
split the model was trained with should cost it less); and, where llama-cpp-python is installed, how often each
gives the ids llama.cpp's own tokenizer gives for the same file.

Usage: python benchmarks/tokenizer_split.py [--messages 4000] [--scored 80]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fuzzyspec import gguf_tokenizer
from fuzzyspec.data import read_sharegpt
from fuzzyspec.loading import embedded_gguf, load_model
from fuzzyspec.tuning import machine


def loss(model, ids: list[int], first: int) -> float:
    """The target's summed negative log-likelihood (nats) of ``ids`` after ``first`` (the text's start)."""
    tokens = torch.tensor([[first, *ids[:511]]])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, :-1].float()
    return -torch.log_softmax(logits, -1).gather(1, tokens[0, 1:, None]).sum().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=4000, help="ShareGPT messages compared")
    parser.add_argument("--scored", type=int, default=80, help="of those tokenized differently, how many scored")
    args = parser.parse_args()
    from transformers import TokenizersBackend

    path = embedded_gguf()
    with tempfile.TemporaryDirectory() as folder:
        gguf_tokenizer.write(gguf_tokenizer.read(path), Path(folder))
        ours = TokenizersBackend.from_pretrained(folder)
    theirs = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    messages = []
    for conversation in read_sharegpt():
        messages += [message["content"] for message in conversation.messages[:2]]
        if len(messages) >= args.messages:
            break
    messages = messages[: args.messages]
    encode = {"fuzzyspec's": lambda text: ours.encode(text, add_special_tokens=False),
              "transformers'": lambda text: theirs.encode(text, add_special_tokens=False)}
    differ = [text for text in messages if encode["fuzzyspec's"](text) != encode["transformers'"](text)]
    print(f"fuzzyspec tokenizer_split: {machine()}; the embedded GGUF's tokenizer, {len(messages)} ShareGPT messages "
          f"(each conversation's first two)")
    print(f"  tokenized differently: {len(differ)} ({len(differ) / len(messages):.1%})")
    try:
        from llama_cpp import Llama
    except ImportError:
        print("  (llama-cpp-python is not installed: no comparison with llama.cpp's tokenizer)")
    else:
        llama = Llama(str(path), vocab_only=True, verbose=False)
        for name, function in encode.items():
            same = sum(function(text) == llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
                       for text in messages)
            print(f"  {name:14s} conversion gives llama.cpp's ids on {same} of {len(messages)} messages")
    scored = [text for text in differ if 200 < len(text) < 1500][: args.scored]
    if not scored:
        return
    model, _ = load_model(None)
    first = ours.convert_tokens_to_ids("<|endoftext|>")
    totals = {name: [loss(model, function(text), first) for text in scored] for name, function in encode.items()}
    characters = sum(len(text) for text in scored)
    for name, losses in totals.items():
        print(f"  {name:14s} conversion: the target's loss {sum(losses) / characters:.4f} nats a character "
              f"({len(scored)} messages tokenized differently, 200-1,500 characters)")
    lower = sum(a < b for a, b in zip(totals["fuzzyspec's"], totals["transformers'"]))
    print(f"  lower with fuzzyspec's conversion on {lower} of {len(scored)}")


if __name__ == "__main__":
    main()
