"""DecodeConfig.from_options: the one place a request's options become its decoding."""
import math

import pytest

from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.sampling import Sampling
from fuzzyspec.drafters.registry import DrafterSpec
from fuzzyspec.options import BY_NAME, DEFAULT_DRAFT, OptionError

DEFAULT = DrafterSpec(DEFAULT_DRAFT, True)
EAGLE = DrafterSpec("eagle", True)
CHAINS = DrafterSpec("lookup", False)


def test_the_default_job_is_lossless_trees_with_the_default_drafter():
    config = DecodeConfig.from_options({}, drafter=DEFAULT)
    assert (config.method, config.tree, config.fuzzy) == ("sd", True, False)
    assert config.describe()["threshold"] is None and config.describe()["divergence"] is None


def test_other_drafters_draft_chains_and_no_drafter_means_ar():
    assert DecodeConfig.from_options({}, drafter=EAGLE).tree is False  # trees only when asked, or by the job
    assert DecodeConfig.from_options({"tree": True}, drafter=EAGLE).tree is True
    assert DecodeConfig.from_options({}, drafter=CHAINS).method == "sd"
    assert DecodeConfig.from_options({}, drafter=None).method == "ar"


def test_given_options_win_and_none_means_unset():
    config = DecodeConfig.from_options({"method": "fsd", "threshold": 0.5, "tree": False, "gamma": None,
                                        "temperature": 0.7, "top_k": 5}, drafter=DEFAULT)
    assert (config.method, config.threshold, config.tree) == ("fsd", 0.5, False)
    assert config.gamma == BY_NAME["gamma"].default
    assert (config.sampling.temperature, config.sampling.top_k) == (0.7, 5)
    assert config.describe() == {"method": "fsd", "divergence": "js", "threshold": 0.5, "gamma": 5, "tree": False}
    assert DecodeConfig.from_options({"method": "fsd", "threshold": math.inf}, drafter=CHAINS).describe()[
        "threshold"] == "inf"


def test_a_calibrated_threshold_implies_a_fuzzy_rule():
    assert DecodeConfig.from_options({}, drafter=DEFAULT, target_acceptance=0.6).method == "fsd"
    with pytest.raises(OptionError, match="needs a fuzzy method") as error:
        DecodeConfig.from_options({"method": "sd"}, drafter=DEFAULT, target_acceptance=0.6)
    assert error.value.option == "target_acceptance"
    with pytest.raises(OptionError, match="excludes a threshold"):
        DecodeConfig.from_options({"threshold": 0.2}, drafter=DEFAULT, target_acceptance=0.6)
    with pytest.raises(OptionError, match=r"must be in \(0, 1\)"):
        DecodeConfig.from_options({}, drafter=DEFAULT, target_acceptance=1.0)


@pytest.mark.parametrize("options, drafter, option", [
    ({"gamma": 0}, DEFAULT, "gamma"), ({"max_new_tokens": 0}, DEFAULT, "max_new_tokens"),
    ({"seed": -1}, DEFAULT, "seed"), ({"seed": 2**63}, DEFAULT, "seed"), ({"temperature": -1.0}, DEFAULT, "temperature"),
    ({"top_p": 0.0}, DEFAULT, "top_p"), ({"divergence": "cosine"}, DEFAULT, "divergence"),
    ({"threshold": -0.1}, DEFAULT, "threshold"), ({"method": "beam"}, DEFAULT, "method"),
    ({"tree_depth": 0}, DEFAULT, "tree_depth"), ({"method": "sd"}, None, "method"), ({"tree": True}, CHAINS, "tree"),
    ({"gamma_schedule": "fast"}, DEFAULT, "gamma_schedule"), ({"colour": "red"}, DEFAULT, "colour"),
])
def test_every_error_names_its_option(options, drafter, option):
    with pytest.raises(OptionError) as error:
        DecodeConfig.from_options(options, drafter=drafter)
    assert error.value.option == option
    assert error.value.spelled("--x").startswith("--x ") and str(error.value).startswith(option)


def test_direct_construction_checks_too():
    with pytest.raises(OptionError, match="gamma must be >= 1"):
        DecodeConfig(gamma=0)
    assert DecodeConfig().method == BY_NAME["method"].default == "sd"


def test_a_budget_asks_for_the_drafts_distributions_only_where_the_rule_reads_them():
    """Fuzzy rules read a draft's distributions, and SD reads a chain's where it was drawn from them; a greedy
    chain, a chain of likeliest tokens, an SD tree and a draft nothing judges need none."""
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=0.8)

    def reads(size=3, breadth=None, **options) -> bool:
        return DecodeConfig(**options).budget(size, 50, breadth).distributions

    assert not reads(method="sd", sampling=greedy)
    assert reads(method="sd", sampling=sampled)
    assert not reads(method="sd", sampling=sampled, greedy_drafts=True)
    assert reads(method="fsd", threshold=0.3, sampling=greedy)
    assert reads(method="fsd-hybrid", threshold=0.3, sampling=sampled, greedy_drafts=True)
    assert not reads(method="sd", tree=True, sampling=sampled)
    assert not reads(method="sd", tree=True, sampling=sampled, breadth=1)  # a one-wide tree: likeliest tokens
    assert reads(method="fsd", threshold=0.3, tree=True, sampling=greedy)
    assert not reads(method="fsd", threshold=math.inf, sampling=sampled)  # the draft decodes alone
