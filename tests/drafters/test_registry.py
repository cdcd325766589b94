import pytest
import torch

from fuzzyspec.api import ModelPair
from fuzzyspec.core.draft import Drafter
from fuzzyspec.drafters.model import ModelDrafter
from fuzzyspec.drafters.eagle import EagleDrafter
from fuzzyspec.drafters.eagle3 import make_eagle3
from fuzzyspec.loading import LoadError
from fuzzyspec.drafters.lookup import LookupDrafter
from fuzzyspec.drafters.registry import load_drafter
from fuzzyspec.core.vocab import DraftVocab


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return ModelPair.load(tiny_dirs["target"], None, "float32")


def test_names_give_fresh_drafters_of_every_kind(pair, tiny_dirs, tmp_path):
    make_eagle3(pair.target, DraftVocab(torch.arange(0, pair.vocab_size, 3), pair.vocab_size)).save(tmp_path)
    for name, kind in [(tiny_dirs["draft"], ModelDrafter), ("self:1", ModelDrafter), ("lookup", LookupDrafter),
                       ("lookup:5", LookupDrafter), (f"eagle:{tmp_path}", EagleDrafter)]:
        source = load_drafter(name, pair.target, pair.tokenizer)
        first, second = source.new(pair.vocab_size), source.new(pair.vocab_size)
        assert isinstance(first, kind) and isinstance(first, Drafter) and first is not second
        assert source.drafts_trees == (kind is EagleDrafter)
    assert load_drafter("lookup:5", pair.target, pair.tokenizer).new(pair.vocab_size).max_ngram == 5


@pytest.mark.parametrize("name, fragment", [("lookup:0", "lookup:N"), ("lookup:x", "lookup:N"),
                                            ("self:x", "self:N"), ("eagle:/no/such/dir", "not found"),
                                            ("/no/such/model", "not found")])
def test_bad_names(pair, name, fragment):
    with pytest.raises(LoadError, match=fragment):
        load_drafter(name, pair.target, pair.tokenizer)


def test_shipped_drafters_are_for_the_embedded_target_only(pair, tiny_dirs):
    with pytest.raises(LoadError, match="embedded target only"):
        load_drafter("eagle", pair.target, pair.tokenizer, target_name=tiny_dirs["target"])


def test_a_pair_generates_with_any_drafter_by_name(pair):
    for name in ("lookup", "self:1"):
        result = pair.with_drafter(name).generate("w1 w2 w1 w2 w1", chat=False, method="sd", max_new_tokens=8)
        expected = pair.generate("w1 w2 w1 w2 w1", chat=False, method="ar", max_new_tokens=8)
        assert result.tokens == expected.tokens
