"""One rank of a 2-process tensor-parallel run (launched by test_parallel.py through torchrun): decodes a
mixed batch with the sharded target and with an unsharded copy in the same process, and writes both."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import noisy_copy  # noqa: E402
from fuzzyspec.core import parallel  # noqa: E402
from fuzzyspec.core.config import DecodeConfig  # noqa: E402
from fuzzyspec.core.engine import decode_batch  # noqa: E402
from fuzzyspec.core.sampling import Sampling  # noqa: E402
from fuzzyspec.core.vocab import DraftVocab  # noqa: E402
from fuzzyspec.drafters.eagle import EagleDrafter  # noqa: E402
from fuzzyspec.drafters.eagle3 import make_eagle3  # noqa: E402
from fuzzyspec.drafters.lookup import LookupDrafter  # noqa: E402
from fuzzyspec.drafters.model import ModelDrafter  # noqa: E402
from fuzzyspec.loading import load_model  # noqa: E402

folder, out = sys.argv[1], Path(sys.argv[2])
sharded, _ = load_model(folder, "float32", "cpu", weights=None, tp=True)
alone, _ = load_model(folder, "float32", "cpu", weights=None)
V = alone.config.vocab_size
draft = noisy_copy(alone, 0.3, seed=1)
torch.manual_seed(0)
head = make_eagle3(alone, DraftVocab(torch.arange(0, V, 2), V)).eval()
sampled = Sampling(temperature=0.9, top_k=20)
ROWS = [("ar", DecodeConfig(method="ar", max_new_tokens=16)),
        ("draft", DecodeConfig(method="sd", gamma=3, max_new_tokens=16)),
        ("draft", DecodeConfig(method="fsd", threshold=0.3, gamma=3, max_new_tokens=16, sampling=sampled, seed=3)),
        ("draft", DecodeConfig(method="fsd-hybrid", threshold=0.2, gamma=4, max_new_tokens=16, sampling=sampled,
                               seed=4)),
        ("eagle", DecodeConfig(method="sd", max_new_tokens=16, tree=True, tree_total_tokens=8, tree_depth=3)),
        ("eagle", DecodeConfig(method="fsd-hybrid", threshold=0.2, max_new_tokens=16, tree=True, sampling=sampled,
                               seed=5)),
        ("lookup", DecodeConfig(method="fsd", threshold=0.3, max_new_tokens=16)),
        ("draft", DecodeConfig(method="sd", gamma=3, max_new_tokens=16, sampling=sampled))]  # seed left to chance
PROMPTS = [[1, 5, 9, 3, 7], [4], [8, 8, 1, 0], [3, 3, 2], [12, 20, 7, 7, 1], [2, 9], [5, 6, 5, 6, 5], [7, 1]]


def run(target):
    drafters = {"ar": lambda: None, "draft": lambda: ModelDrafter(draft, V),
                "eagle": lambda: EagleDrafter(head, target, V), "lookup": lambda: LookupDrafter(3)}
    results = decode_batch(target, [torch.tensor([p]) for p in PROMPTS], [config for _, config in ROWS],
                           [drafters[kind]() for kind, _ in ROWS], V)
    return [tokens for tokens, _ in results]


result = {"shards": parallel.shards(sharded), "sharded": run(sharded), "alone": run(alone)}
(out / f"rank{parallel.rank()}.json").write_text(json.dumps(result))
