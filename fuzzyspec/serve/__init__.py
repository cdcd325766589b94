"""Serving: ``scheduler`` (requests batched onto one engine), ``schema`` (OpenAI request bodies and their
mapping to decoding), ``replies`` (OpenAI response bodies), ``metrics`` (Prometheus) and ``app`` (the
routes)."""
