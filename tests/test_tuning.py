"""The profiles kept in the cache (``tuning``): what survives a save."""
from __future__ import annotations

import json
import time

from fuzzyspec import tuning
from fuzzyspec.core.cost import Profile


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
