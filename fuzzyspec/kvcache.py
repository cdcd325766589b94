"""KV cache helpers shared by the target loop and the drafters."""
from __future__ import annotations

from transformers import DynamicCache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache``: a slice of each layer's
    tensors, so it costs nothing in proportion to the prefix."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5 takes the number of positions to drop, negated
