"""``python -m fuzzyspec``: the command line."""
from .cli import run

run()
