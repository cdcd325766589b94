"""fuzzyspec: fuzzy speculative decoding (FSD), speculative decoding (SD) and AR for Hugging Face causal LMs."""
from .api import ModelPair, Result, make_config
from .decoding import DecodeConfig, Engine, decode
from .divergences import divergence
from .drafters import Budget, Draft, Drafter, ModelDrafter
from .rules import RULES
from .sampling import Sampling
from .stats import Stats

__all__ = ["ModelPair", "Result", "make_config", "DecodeConfig", "Engine", "decode", "divergence", "Budget",
           "Draft", "Drafter", "ModelDrafter", "RULES", "Sampling", "Stats"]
__version__ = "0.1.0"
