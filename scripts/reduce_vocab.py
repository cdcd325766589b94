"""Give an existing drafter a reduced draft vocabulary, with no training: the reduced-vocabulary lever alone.

    python scripts/reduce_vocab.py SOURCE OUT --vocab-from DIR     # N tokens: those of DIR's draft vocabulary
    python scripts/reduce_vocab.py SOURCE OUT --data ANSWERS --size 16384   # the N most frequent in ANSWERS

SOURCE is an EAGLE-1/2 head or a draft LM folder over the full vocabulary (``shipped:eagle``,
``shipped:draft`` for the ones in the package). Its weights are copied unchanged into OUT with the
``d2t``/``t2d`` maps beside them, so the drafter's output layer becomes the target's LM-head rows of
those N tokens: a draft step reads N/V of the head's bytes, and q is zero outside the N tokens (every
rule stays exact). ``--vocab-from`` takes the maps of a drafter trained with a reduced vocabulary
(for example an EAGLE-3 head from `fuzzyspec train eagle3`, whose vocabulary was counted on the
target's own answers); ``--data`` counts them on a folder of `fuzzyspec train data` answers.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fuzzyspec.core.vocab import DraftVocab
from fuzzyspec.loading import shipped


def folder(name: str) -> Path:
    return shipped(name.split(":", 1)[1]) if name.startswith("shipped:") else Path(name)


def vocab_of(path: Path) -> DraftVocab:
    with safe_open(str(path / "model.safetensors"), "pt") as stored:
        if "d2t" not in stored.keys():
            raise SystemExit(f"{path} has no reduced draft vocabulary (no d2t)")
        t2d = stored.get_tensor("t2d") if "t2d" in stored.keys() else None
        return DraftVocab.from_maps(stored.get_tensor("d2t"), t2d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--vocab-from", default=None, help="a drafter folder whose d2t/t2d maps to use")
    parser.add_argument("--data", default=None, help="a folder of `fuzzyspec train data` answers to count")
    parser.add_argument("--size", type=int, default=16384, help="N, with --data (default: 16384)")
    args = parser.parse_args()
    source, out = folder(args.source), Path(args.out)
    weights = load_file(str(source / "model.safetensors"))
    if "d2t" in weights:
        raise SystemExit(f"{source} already has a reduced draft vocabulary")
    if args.vocab_from:
        vocab = vocab_of(folder(args.vocab_from))
    elif args.data:
        from fuzzyspec.train.selfdistill import load_answers
        from fuzzyspec.train.loop import build_vocab

        vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]  # the target's
        vocab = build_vocab(load_answers(args.data), args.size, vocab_size)
    else:
        raise SystemExit("give --vocab-from DIR or --data ANSWERS")
    out.mkdir(parents=True, exist_ok=True)
    save_file({**weights, **vocab.maps()}, str(out / "model.safetensors"))
    shutil.copy(source / "config.json", out / "config.json")
    metrics = json.loads((source / "metrics.json").read_text()) if (source / "metrics.json").is_file() else {}
    metrics["draft_vocab"] = {"size": len(vocab), "from": args.vocab_from or args.data,
                              "weights_from": str(args.source), "retrained": False}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"{out}: {args.source} with a draft vocabulary of {len(vocab)} tokens")


if __name__ == "__main__":
    main()
