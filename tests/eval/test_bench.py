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
    generations = (out / "generations" / f"{specs[0].stem}.jsonl").read_text().splitlines()
    assert len(generations) == 4 and "completion" in json.loads(generations[0])


def test_a_sweep_resumes_without_redoing_rows(tmp_path, task_file, tiny_dirs, monkeypatch):
    specs = plan(["ar", tiny_dirs["draft"]], ["fsd"], ["js"], [0.3])
    first = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    calls = count_generate(monkeypatch)
    again = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)
    assert calls == [] and again == first

    # An interrupted row: its last two examples are missing (and a half-written line is ignored).
    path = tmp_path / "generations" / f"{specs[1].stem}.jsonl"
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


TIMING = {"tokens_per_s"}  # the only field a row's timing decides (wall_s is summed into it, not shown)


def without_timing(rows):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def csv_without_timing(folder):
    with (folder / "results.csv").open() as file:
        return without_timing(list(csv.DictReader(file)))


def test_workers_split_a_sweep_and_merge_to_what_one_worker_writes(tmp_path, tiny_dirs):
    path = tmp_path / "echo.py"
    path.write_text(TASK.format(compare=True))  # agreement with the greedy reference: AR rows of both workers
    specs = plan(["ar", tiny_dirs["draft"]], ["sd", "fsd"], ["js"], [0.4])
    one = Sweep(settings(str(path), tiny_dirs), tmp_path / "one", progress=False).run(specs)
    two = tmp_path / "two"
    assert Sweep(settings(str(path), tiny_dirs), two, progress=False, worker=(0, 2)).run(specs) == []
    last = Sweep(settings(str(path), tiny_dirs), two, progress=False, worker=(1, 2)).run(specs)
    assert without_timing(last) == without_timing(one)  # the last worker to finish leaves merged results

    generations = two / "generations"
    for spec in specs:  # each worker wrote only its own files: examples 0, 2 and 1, 3 of every row
        assert not (generations / f"{spec.stem}.jsonl").exists()
        for worker, ids in ((0, ["0", "2"]), (1, ["1", "3"])):
            records = (generations / f"{spec.stem}.w{worker}of2.jsonl").read_text().splitlines()
            assert [json.loads(line)["id"] for line in records] == ids
    assert (two / "greedy_reference.w0of2.jsonl").is_file() and (two / "greedy_reference.w1of2.jsonl").is_file()

    for name in ("results.csv", "results.json", "curve.png"):  # as if the workers finished elsewhere
        (two / name).unlink()
    merged = Sweep.from_folder(two).merge()
    assert without_timing(merged) == without_timing(one) and [r["prompts"] for r in merged] == [4] * len(specs)
    assert csv_without_timing(two) == csv_without_timing(tmp_path / "one")
    saved, alone = (json.loads((folder / "results.json").read_text())["rows"] for folder in (two, tmp_path / "one"))
    assert without_timing(saved) == without_timing(alone)
    assert (two / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_a_rerun_finishes_only_what_a_lost_worker_left(tmp_path, task_file, tiny_dirs, monkeypatch):
    specs = plan(["ar", tiny_dirs["draft"]], ["sd"], [], [])
    for worker in ((0, 2), (1, 2)):
        rows = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=worker).run(specs)
    lost = tmp_path / "generations" / f"{specs[1].stem}.w1of2.jsonl"
    lost.unlink()  # worker 1 of 2 died (or its machine's copy is gone): the sd row lacks examples 1 and 3
    assert Sweep.from_folder(tmp_path).merge() == [rows[0]]
    calls = count_generate(monkeypatch)
    again = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False).run(specs)  # one process, 0/1
    assert len(calls) == 2 + 1  # the two missing examples and a warm-up
    assert without_timing(again) == without_timing(rows)
    redone = (tmp_path / "generations" / f"{specs[1].stem}.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in redone] == ["1", "3"]

    (tmp_path / "generations" / f"{specs[0].stem}.w0of2.jsonl").unlink()  # the same worker, rerun
    Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=(0, 2)).run(specs)
    assert len(calls) == 3 + 2 + 1
    Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=(1, 2)).run(specs)
    assert len(calls) == 6  # its share is all done: the sd row's by the rerun above

    # Another worker count finds nothing left, and a duplicated record counts once.
    (tmp_path / "generations" / f"{specs[1].stem}.w2of3.jsonl").write_text("\n".join(redone) + "\n")
    for worker in range(3):
        Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=(worker, 3)).run(specs)
    assert len(calls) == 6
    merged = Sweep.from_folder(tmp_path).merge()
    assert without_timing(merged) == without_timing(rows) and merged[1]["prompts"] == 4


def test_a_worker_out_of_range_is_refused(tmp_path, task_file, tiny_dirs):
    for worker in ((2, 2), (0, 0), (-1, 2)):
        with pytest.raises(ValueError, match="worker must be i/n with 0 <= i < n"):
            Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=worker)


def test_workers_starting_together_share_the_settings_and_rows(tmp_path, task_file, tiny_dirs):
    specs = plan(["ar"], [], [], [])
    first = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=(0, 2))
    saved = (tmp_path / "sweep.json").read_text()
    second = Sweep(settings(task_file, tiny_dirs), tmp_path, progress=False, worker=(1, 2))
    assert (tmp_path / "sweep.json").read_text() == saved and not list(tmp_path.glob(".*"))  # no temporary left
    first.run(specs)
    second.run(plan([tiny_dirs["draft"]], ["sd"], [], []))  # a worker asking for another row adds it
    assert [s["rule"] for s in json.loads((tmp_path / "specs.json").read_text())] == ["ar", "sd"]
    with pytest.raises(ValueError, match="max_new_tokens differ"):
        Sweep(dataclasses.replace(settings(task_file, tiny_dirs), decoding={"seed": 0, "max_new_tokens": 9}),
              tmp_path, progress=False, worker=(1, 2))
