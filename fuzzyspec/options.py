"""Decoding options: declared once, here, with their defaults and help; the CLI, bench, the server and the
transformers hook take them from this table."""
from __future__ import annotations

# What `fuzzyspec generate PROMPT` runs when no option says otherwise (the README says why).
DEFAULT_JOB = {"draft": "draft", "method": "fsd", "divergence": "js", "threshold": 0.3}
