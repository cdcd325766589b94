"""fuzzyspec: fuzzy speculative decoding (FSD), speculative decoding (SD) and AR for Hugging Face causal LMs."""
