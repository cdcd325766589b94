"""Write the inputs of scripts/train_drafters.sh that need the ShareGPT package, for a machine without it.

    python scripts/export_training_inputs.py OUT_DIR

prompts-train.jsonl / prompts-held_out.jsonl: the first user message of every ShareGPT training
conversation, and of 400 held-out ones; sharegpt-train-512.npz: the training conversations rendered
with the target's chat template (for the ablation run that trains on ShareGPT's own answers).
"""
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from fuzzyspec.loading import embedded_folder
from fuzzyspec.train.selfdistill import training_prompts
from fuzzyspec.train.loop import load_data

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for split, limit in (("train", None), ("held_out", 400)):
    with open(out / f"prompts-{split}.jsonl", "w") as file:
        for prompt in training_prompts("sharegpt", limit, split):
            file.write(json.dumps({"prompt": prompt}) + "\n")
tokenizer = AutoTokenizer.from_pretrained(embedded_folder())
load_data("sharegpt", tokenizer, "train", 512).save(out / "sharegpt-train-512.npz")
