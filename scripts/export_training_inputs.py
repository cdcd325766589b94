"""Write the inputs of scripts/train_drafters.sh that need the ShareGPT package, for a machine without it.

    python scripts/export_training_inputs.py OUT_DIR

prompts-train.jsonl / prompts-held_out.jsonl: the first user message of every ShareGPT training
conversation, and of 400 held-out ones; sharegpt-train-512.npz / sharegpt-held_out-512.npz: the training
and held-out conversations rendered with the target's chat template (the EAGLE head's data, and the
ablation run that trains on ShareGPT's own answers; `fuzzyspec train --data/--eval-data` read them).
"""
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from fuzzyspec.loading import gguf_tokenizer_folder
from fuzzyspec.train.selfdistill import training_prompts
from fuzzyspec.train.loop import load_data

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for split, limit in (("train", None), ("held_out", 400)):
    with open(out / f"prompts-{split}.jsonl", "w") as file:
        for prompt in training_prompts("sharegpt", limit, split):
            file.write(json.dumps({"prompt": prompt}) + "\n")
tokenizer = AutoTokenizer.from_pretrained(gguf_tokenizer_folder())
for split in ("train", "held_out"):
    load_data("sharegpt", tokenizer, split, 512).save(out / f"sharegpt-{split}-512.npz")

