"""The profiles kept in the cache (``tuning``): what survives a save."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fuzzyspec import tuning
from fuzzyspec.core.cost import OUTSIDE, TARGET, Acceptance, Option, Profile, population_key
from fuzzyspec.files import cache_dir


def test_a_save_drops_the_profiles_of_other_code_once_stale():
    """Every answer's save reads and writes ``profiles.json`` whole; profiles measured by older code (another step
    digest in the key) are never read again, so they go once stale, while another version's recent ones stay."""
    key = tuning.profile_key(None, "fp32", "auto", "cpu", False)
    assert f"step={tuning._step_code()}" in key.split("|")
    old = key.replace(f"step={tuning._step_code()}", "step=00000000")
    recent = key.replace(f"step={tuning._step_code()}", "step=11111111")
    tuning._write({old: {"target": {"1": 9.0}}, recent: {"target": {"1": 8.0}, "written": time.time() - 60}})
    assert set(tuning._saved()) == {recent}  # (the old one: no date, so written before dates were kept)
    tuning._write({old: {"target": {"1": 9.0}, "written": time.time() - tuning.STALE_S - 60}} | tuning._saved())
    assert set(tuning._saved()) == {recent}

    tuning.save(key, Profile(target={1: 7.0}))
    tuning.note(key, compile_pays=True)
    saved = json.loads(tuning.profile_path().read_text())
    assert set(saved) == {recent, key}
    assert tuning.load(key).target == {1: 7.0} and tuning.facts(key)["compile_pays"] is True


def test_profiles_go_where_fuzzyspec_profiles_says_and_the_tests_processes_keep_out_of_the_users_cache(tmp_path):
    """``$FUZZYSPEC_PROFILES`` names the file; a process the tests start inherits this session's, so a tiny model's
    costs never reach the user's own ``profiles.json`` (198 of one developer's 221 profiles had come from tests)."""
    named = tmp_path / "elsewhere.json"
    where = "from fuzzyspec import tuning; print(tuning.profile_path())"
    done = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FUZZYSPEC_PROFILES": str(named)})
    assert done.stdout.strip() == str(named)
    inherited = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120)
    assert Path(inherited.stdout.strip()) != cache_dir() / "profiles.json"
    unset = {key: value for key, value in os.environ.items() if key != "FUZZYSPEC_PROFILES"}
    default = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=120, env=unset)
    assert Path(default.stdout.strip()) == cache_dir() / "profiles.json"


def test_tune_says_from_what_acceptance_a_chain_pays_and_what_decoding_met():
    """Where verifying two tokens costs what one does and a draft costs a tenth of a step, a 1-token chain pays once
    its draft passes more than 1 time in 10: (1 + a) / (10 + 1) > 1 / 10. Where every token verified costs a step,
    none ever pays. What the drafter's rows met in decoding (its population under a rule) is read back with the
    pick a new row starts from; another drafter's, or one with too few drafts, is left out."""
    cheap = Profile()
    cheap.set_measured(TARGET, {w: 10.0 for w in range(1, 7)})
    cheap.set_measured("d:chain", {g: 1.0 * g for g in range(1, 6)})
    cheap.set_measured(OUTSIDE, {1: 0.0})
    assert abs(tuning.pays_from(cheap, Option("d", 5)) - 0.1) <= 0.005
    dear = Profile()
    dear.set_measured(TARGET, {w: 10.0 * w for w in range(1, 7)})
    dear.set_measured("d:chain", {1: 1.0})
    assert tuning.pays_from(dear, Option("d", 5)) is None
    chains = {"chains": Option("d", 5)}
    assert tuning.outlook(dear, chains) == {"chains": dict.fromkeys((0.3, 0.5, 0.7, 0.9), ((0, 1), 1.0))}
    assert all(shape[0] >= 1 and x > 1.0 for shape, x in tuning.outlook(cheap, chains)["chains"].values())

    for drafter, method, steps in (("d", "sd", 200), ("other", "sd", 200), ("d", "fsd", 5)):
        row = Acceptance(population=cheap.population(population_key(drafter, method, 0.0, True)))
        for step in range(steps):
            row.record(proposed=1, ranks=[1] if step % 2 else [])  # half the first drafts pass
    met = tuning.acceptance_met(cheap, "d", {"chains": Option("d", 5)})
    assert list(met) == [population_key("d", "sd", 0.0, True)]
    (found,) = met.values()
    assert abs(found["first_draft"] - 0.5) < 0.02
    (shape, faster), = found["picks"].values()
    assert shape[0] >= 1 and faster > 1.0


def test_the_widths_are_timed_in_turns_not_one_after_another(monkeypatch):
    """Each width's calls are spread over the measurement, a round at a time in an order turned every round, so a
    spell of the machine's pace falls on every width alike: timed one width after another, a 2-token pass came out
    at 0.82x to 1.18x a 1-token one in four runs, and a profile that settled it dear priced drafts out."""
    from conftest import tiny_llama
    from fuzzyspec.core.step import TargetStep

    step = TargetStep(tiny_llama(seed=3))
    called = []
    forward = TargetStep.__call__
    monkeypatch.setattr(TargetStep, "__call__", lambda self, cache, tokens, *args, **kwargs:
                        called.append(tokens.shape[1]) or forward(self, cache, tokens, *args, **kwargs))
    times, compile_s = tuning.measure_target(step, (1, 2, 4), prefix=8, rounds=3)
    assert set(times) == {1, 2, 4} and all(ms > 0 for ms in times.values()) and compile_s == {}
    assert called[0] == 8 and called[1:7] == [1, 1, 2, 2, 4, 4]  # the prompt, then each width's first calls
    assert called[7:] == [1, 2, 4, 2, 4, 1, 4, 1, 2]  # timed: a round each, turned
