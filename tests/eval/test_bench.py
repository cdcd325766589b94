import csv
import dataclasses
import json

import pytest

from fuzzyspec.api import ModelPair
from fuzzyspec.eval.bench import Settings, Spec, Sweep, plan

TASK = '''
from fuzzyspec.eval.tasks import Example, Task


class Echo(Task):
    """Asks to repeat a number; right when the completion contains it."""
    metric = "accuracy"
    compare_to_greedy = {compare}

    def load(self):
        return [Example(str(i), f"Say {{i}} {{'please ' * i}}", str(i)) for i in range(4)]

    def score(self, example, completion):
        return {{"accuracy": float(example.reference in completion)}}
'''


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "echo.py"
    path.write_text(TASK.format(compare=False))
    return str(path)


def settings(task_file, tiny_dirs, **extra):
    return Settings(task=task_file, target=tiny_dirs["target"], dtype="float32", calibration_prompts=3,
                    calibration_tokens=6, decoding={"seed": 0, "max_new_tokens": 6}, **extra)


def count_generate(monkeypatch):
    calls = []
    original = ModelPair.generate

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(ModelPair, "generate", counting)
    return calls


def test_plan():
    specs = plan(["ar", "default", "eagle+tree"], ["sd", "fsd"], ["js", "tv"], [0.1, 0.2], [0.8])
    keys = [s.key for s in specs]
    assert keys[:2] == ["ar ar", "default sd"]
    assert "default fsd js T=0.1" in keys and "eagle+tree fsd tv acc=0.8" in keys
    assert len(specs) == 1 + 2 * (1 + 2 * 3)
    with pytest.raises(ValueError, match="unknown rule"):
        plan(["default"], ["beam"], ["js"], [0.1])
    with pytest.raises(ValueError, match="empty"):
        plan(["default"], [], ["js"], [0.1])


def test_a_sweep_writes_rows_csv_json_and_png(tmp_path, task_file, tiny_dirs):
    specs = plan(["ar", tiny_dirs["draft"]], ["sd", "fsd"], ["js"], [0.2, 0.6])
    rows = Sweep(settings(task_file, tiny_dirs), tmp_path / "out", progress=False).run(specs)
    assert [r["key"] for r in rows] == [s.key for s in specs]
    by_rule = {(r["rule"], r["threshold"]): r for r in rows}
    ar, sd = by_rule[("ar", None)], by_rule[("sd", None)]
    assert ar["mean_accepted"] == 1 and ar["acceptance_rate"] is None and ar["draft"] == "ar"
    # float32 greedy SD is the target's greedy output: same scores as AR
    assert sd["accuracy"] == ar["accuracy"] and sd["nll"] == pytest.approx(ar["nll"], abs=1e-4)
    for row in rows:
        assert row["prompts"] == 4 and row["tokens_per_s"] > 0 and row["new_tokens"] > 0
        assert row["task"] == "echo" and row["metric"] == "accuracy" and row["seed"] == 0 and row["hardware"]
    assert by_rule[("fsd", 0.6)]["acceptance_rate"] >= by_rule[("fsd", 0.2)]["acceptance_rate"]
    out = tmp_path / "out"
    with (out / "results.csv").open() as file:
        table = list(csv.DictReader(file))
    assert [r["key"] for r in table] == [s.key for s in specs]
    assert json.loads((out / "results.json").read_text())["rows"] == json.loads(json.dumps(rows))
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    generations = (out / "generations" / specs[0].file_name).read_text().splitlines()
    assert len(generations) == 4 and "completion" in json.loads(generations[0])


def test_a_sweep_resumes_without_redoing_rows(tmp_path, task_file, tiny_dirs, monkeypatch):
    specs = plan(["ar", tiny_dirs["draft"]], ["fsd"], ["js"], [0.3])
    first = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    calls = count_generate(monkeypatch)
    again = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    assert calls == [] and again == first

    # An interrupted row: its last two examples are missing (and a half-written line is ignored).
    path = tmp_path / "generations" / specs[1].file_name
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    # A new threshold in the same sweep: only its row runs.
    more = plan(["ar", tiny_dirs["draft"]], ["fsd"], ["js"], [0.3, 0.5])
    rows = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(more)
    assert len(calls) == 2 + 4 + 1  # 2 missing examples, the new row's 4, one warm-up
    assert [r["key"] for r in rows] == [s.key for s in more]
    assert rows[1]["new_tokens"] == first[1]["new_tokens"]  # greedy: the redone examples match
    # A later run naming fewer rows still reports (and writes) all of the folder's rows.
    again = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(more[:1])
    assert [r["key"] for r in again] == [s.key for s in more]
    assert len(json.loads((tmp_path / "results.json").read_text())["rows"]) == len(more)


def test_a_sweep_folder_refuses_other_settings(tmp_path, task_file, tiny_dirs):
    Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens differ"):
        Sweep(dataclasses.replace(settings(task_file, tiny_dirs), decoding={"seed": 0, "max_new_tokens": 9}),
              tmp_path, progress=False)


def test_target_acceptance_rows_are_calibrated_once(tmp_path, task_file, tiny_dirs, monkeypatch):
    specs = [Spec(tiny_dirs["draft"], "fsd", "js", target_acceptance=0.5)]
    rows = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    calibrations = json.loads((tmp_path / "calibrations.json").read_text())
    found = calibrations[specs[0].key]
    assert rows[0]["threshold"] == found["threshold"] and rows[0]["target_acceptance"] == 0.5
    assert found["runs"] >= 1 and 0 <= found["acceptance"] <= 1
    calls = count_generate(monkeypatch)
    Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    assert calls == []


def test_free_form_rows_compare_with_the_greedy_output(tmp_path, tiny_dirs):
    path = tmp_path / "echo.py"
    path.write_text(TASK.format(compare=True))
    specs = plan(["ar", tiny_dirs["draft"]], ["sd", "fsd"], ["js"], [1.0])
    rows = Sweep(settings(str(path), tiny_dirs), tmp_path / "out", progress=False).run(specs)
    ar, sd, fsd = rows
    assert ar["exact_match"] == 1 and ar["first_diff"] == ar["new_tokens"] / 4
    assert sd["exact_match"] == 1  # float32 greedy SD is lossless
    assert 0 <= fsd["exact_match"] <= 1 and (tmp_path / "out" / "greedy_reference.jsonl").is_file()


def test_the_greedy_ar_row_is_the_greedy_reference(tmp_path, tiny_dirs, monkeypatch):
    path = tmp_path / "echo.py"
    path.write_text(TASK.format(compare=True))
    calls = count_generate(monkeypatch)
    Sweep(settings(str(path), tiny_dirs), tmp_path / "out", progress=False).run([Spec("ar", "ar")])
    assert len(calls) == 1 + 4  # warm-up and the row: no separate reference pass
    references = (tmp_path / "out" / "greedy_reference.jsonl").read_text().splitlines()
    assert len(references) == 4
