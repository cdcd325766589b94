import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuzzyspec.cli import main


def fails_cleanly(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fuzzyspec: error: ") and "\n" not in err and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    return err


@pytest.mark.parametrize("argv, fragments", [
    (["--divergence", "cosine"], ["--divergence 'cosine' is unknown", "js", "kl_pq", "top_k_js_div"]),
    (["--threshold", "-0.5"], ["--threshold: must be >= 0"]),
    (["--threshold", "nan"], ["--threshold: must be >= 0"]),
    (["--threshold", "abc"], ["--threshold: must be a number"]),
    (["--gamma", "0"], ["--gamma must be >= 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens must be >= 1"]),
    (["--method", "beam"], ["invalid choice"]),
    (["--temperature", "-1"], ["--temperature must be a finite number >= 0"]),
    (["--top-p", "0"], ["--top-p must be in (0, 1]"]),
    (["--tree-depth", "0"], ["--tree-depth must be >= 1"]),
    (["--draft", "nosuch"], ["unknown drafter 'nosuch'", "eagle:DIR", "lookup"]),
    (["--draft", "lookup", "--tree"], ["--tree needs a drafter that drafts trees"]),
    (["--device", "tpu"], ["--device tpu: unknown"]),
])
def test_bad_options(capsys, argv, fragments):
    fails_cleanly(capsys, ["generate", "hello", *argv], *fragments)


def test_empty_prompt(capsys):
    fails_cleanly(capsys, ["generate", "   "], "the prompt is empty")


def test_missing_model_paths(capsys, tmp_path):
    fails_cleanly(capsys, ["generate", "hi", "--target", str(tmp_path / "nope")], "model path not found")
    fails_cleanly(capsys, ["generate", "hi", "--target", str(tmp_path / "nope.gguf")], "model file not found")


def test_missing_draft_path(capsys, tiny_dirs, tmp_path):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", str(tmp_path / "x")],
                  "model path not found")


def test_vocabulary_mismatch(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["other_vocab"]],
                  "vocabularies differ")
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["short_logits"]],
                  "do not share a vocabulary")


def test_trees_need_an_eagle_head(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--tree"],
                  "--tree needs a drafter that drafts trees")


def test_a_compiled_generate_compiles_the_eagle_heads_step_first(capsys, tiny_dirs, tmp_path, monkeypatch):
    """With --compile an EAGLE head's own steps compile before the answer, with a line saying so (the target's
    shapes then compile as the answer meets them, each with its own line); a second run loads the head's, and says
    nothing of compiling them."""
    from transformers import AutoModelForCausalLM

    from fuzzyspec.core import kept
    from fuzzyspec.drafters.eagle_head import EagleHead

    monkeypatch.setattr(kept, "folder", lambda: tmp_path / "kept")  # (no graph another test kept: each compiles)

    torch.manual_seed(0)
    EagleHead.for_target(AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])).save(tmp_path / "head")
    assert main(["generate", "hello there", "--target", tiny_dirs["target"], "--draft", f"eagle:{tmp_path / 'head'}",
                 "--tree", "--compile", "--max-new-tokens", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stats"]["new_tokens"] == 6
    assert 0 <= err.find("compiling the drafter's step") < err.find("compiling the target's step")
    assert main(["generate", "hello there", "--target", tiny_dirs["target"], "--draft", f"eagle:{tmp_path / 'head'}",
                 "--tree", "--compile", "--max-new-tokens", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stats"]["new_tokens"] == 6 and "compiling the drafter's step" not in err


def test_bad_self_draft(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", "self:5"],
                  "between 1 and 1 layers")


def test_usage_errors_are_one_line(capsys):
    assert main([]) == 2  # bare: the usage, then one error line
    err = capsys.readouterr().err
    assert err.startswith("usage: fuzzyspec") and err.strip().splitlines()[-1].startswith("fuzzyspec: error: ")
    fails_cleanly(capsys, ["generate"])
    fails_cleanly(capsys, ["generate", "hi", "--no-such-flag"])


@pytest.mark.parametrize("method", ["ar", "sd", "fsd", "fsd-hybrid"])
def test_json_output(capsys, tiny_dirs, method):
    argv = ["generate", "hello there", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--method", method, "--max-new-tokens", "12", "--json", "--dtype", "float32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out)  # exactly one JSON object and nothing else on stdout
    assert set(result) >= {"text", "method", "stats"} and result["method"] == method
    stats = result["stats"]
    for key in ("new_tokens", "target_forwards", "mean_accepted", "acceptance_rate", "tokens_per_s", "wall_s"):
        assert key in stats
    assert 1 <= stats["new_tokens"] <= 12 and stats["target_forwards"] >= 1


def test_streams_text_and_reports_on_stderr(capsys, tiny_dirs):
    # Constant draft sizes: under the cost schedule the sizes follow the costs measured so far (the first run
    # of a fresh target measures from nothing), and a seeded sampled run's text follows its sizes.
    argv = ["generate", "hello", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--max-new-tokens", "10", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3",
            "--gamma-schedule", "constant"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert first.out == second.out  # seeded sampling is reproducible
    assert "tokens/s" in first.err


def test_console_script(tiny_dirs):
    done = subprocess.run([sys.executable, "-m", "fuzzyspec.cli", "generate", "hi", "--target", tiny_dirs["target"],
                           "--draft", "self:1", "--json", "--max-new-tokens", "5"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["new_tokens"] <= 5
    done = subprocess.run([sys.executable, "-m", "fuzzyspec.cli", "generate", "hi", "--gamma", "-3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, fragments", [
    (["--task", "nope"], ["unknown task 'nope'"]),
    (["--task", "freeform", "--thresholds", "0.1,-1"], ["--thresholds: in '0.1,-1': must be >= 0"]),
    (["--task", "freeform", "--rules", "beam"], ["unknown rule"]),
    (["--task", "freeform", "--divergences", "cosine"], ["'cosine' is unknown"]),
    (["--task", "freeform", "--target-acceptance", "1.5"], ["--target-acceptance must be in (0, 1)"]),
    (["--task", "freeform", "--thresholds", "0.1", "--target-acceptance", "0.5"], ["not allowed with"]),
    (["--task", "freeform", "--limit", "0"], ["--limit must be >= 1"]),
    (["--task", "gsm8k", "--data", "/no/such.jsonl"], ["no such file"]),
    (["--task", "freeform", "--gamma", "0"], ["--gamma must be >= 1"]),
    (["--task", "humaneval"], ["runs the model's code", "--allow-code-execution"]),
    (["--task", "freeform", "--worker", "2/2"], ["--worker must be i/n with 0 <= i < n, got '2/2'"]),
    (["--task", "freeform", "--worker", "0/0"], ["--worker must be i/n with 0 <= i < n"]),
    (["--task", "freeform", "--worker=-1/2"], ["--worker must be i/n with 0 <= i < n"]),
    (["--task", "freeform", "--worker", "1"], ["--worker must be i/n (worker i of n), got '1'"]),
    (["--task", "freeform", "--worker", "a/b"], ["--worker must be i/n (worker i of n)"]),
    (["--merge"], ["not a sweep folder (it has no sweep.json)"]),
    (["--merge", "--task", "freeform"], ["not allowed with"]),
    ([], ["one of the arguments --task --merge is required"]),
])
def test_bench_bad_input(capsys, tmp_path, argv, fragments):
    fails_cleanly(capsys, ["bench", "--out", str(tmp_path / "out"), *argv], *fragments)


@pytest.mark.parametrize("argv, fragments", [
    ([], ["one of the arguments --acceptance --mean-accepted is required"]),
    (["--acceptance", "1.2"], ["--acceptance must be in (0, 1)"]),
    (["--mean-accepted", "9"], ["gamma + 1"]),
    (["--acceptance", "0.5", "--method", "sd"], ["invalid choice"]),
    (["--acceptance", "0.5", "--divergences", "js,cosine"], ["'cosine' is unknown"]),
    (["--acceptance", "0.5", "--prompts", "0"], ["--prompts must be >= 1"]),
])
def test_calibrate_bad_input(capsys, argv, fragments):
    fails_cleanly(capsys, ["calibrate", *argv], *fragments)


def test_generate_target_acceptance_bad_input(capsys):
    fails_cleanly(capsys, ["generate", "hi", "--target-acceptance", "0.8", "--method", "sd"], "--target-acceptance needs a fuzzy method")
    fails_cleanly(capsys, ["generate", "hi", "--target-acceptance", "0.8", "--threshold", "0.3"], "--target-acceptance excludes a threshold")
    fails_cleanly(capsys, ["generate", "hi", "--target-acceptance", "1"], "--target-acceptance must be in (0, 1)")


PROMPTS = str(Path(__file__).parent / "fixtures" / "prompts.jsonl")


def test_bench_command(capsys, tmp_path, tiny_dirs):
    out = tmp_path / "sweep"
    argv = ["bench", "--task", "freeform", "--data", PROMPTS, "--out", str(out), "--target", tiny_dirs["target"],
            "--methods", f"ar,{tiny_dirs['draft']}", "--rules", "sd,fsd", "--thresholds", "0.2,0.5",
            "--max-new-tokens", "4", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["configuration", "nll"] and len(table) == 1 + 4
    assert "fsd js T=0.5" in table[-1]
    for name in ("results.csv", "results.json", "curve.png", "greedy_reference.jsonl"):
        assert (out / name).is_file()


def test_bench_bad_torchrun_ranks(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fails_cleanly(capsys, ["bench", "--task", "freeform", "--out", str(tmp_path)],
                  "RANK/WORLD_SIZE (torchrun's) must be i/n with 0 <= i < n, got '2/2'")


def test_compiling_by_default_only_where_tune_measured_it_pays_and_never_sharded(monkeypatch):
    import argparse

    from fuzzyspec import cli, tuning

    monkeypatch.setattr(tuning, "facts", lambda key: {"compile_pays": True})
    unset = argparse.Namespace(compile=None, target=None, weights="auto", dtype="auto")
    assert cli._compiles(unset, "cpu", long_running=True)
    assert not cli._compiles(unset, "cpu", long_running=False)  # a one-shot answer
    assert not cli._compiles(unset, "cpu", long_running=True, sharded=True)  # a sharded server or sweep
    assert cli._compiles(argparse.Namespace(compile=True), "cpu", long_running=True, sharded=True)  # asked for


def test_bench_tp_needs_torchrun(capsys, tmp_path):
    fails_cleanly(capsys, ["bench", "--task", "freeform", "--out", str(tmp_path), "--tp"],
                  "--tp shards the target over the ranks of a torchrun launch: run it under torchrun "
                  "--nproc-per-node N (or without --tp)")


def test_bench_workers_from_torchrun_ranks_and_merge(capsys, tmp_path, tiny_dirs, monkeypatch):
    from fuzzyspec.eval.bench import Spec

    out = tmp_path / "sweep"
    argv = ["bench", "--task", "freeform", "--data", PROMPTS, "--out", str(out), "--target", tiny_dirs["target"],
            "--drafts", f"ar,{tiny_dirs['draft']}", "--rules", "sd", "--max-new-tokens", "3", "--dtype", "float32",
            "--quiet"]
    monkeypatch.setenv("RANK", "0")  # as torchrun sets them; nothing else of torch.distributed is used
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # the table's header: no row is finished yet
    generations = out / "generations"
    stems = [Spec("ar", "ar").stem, Spec(tiny_dirs["draft"], "sd").stem]
    assert sorted(p.name for p in generations.iterdir()) == sorted(f"{stem}.w0of2.jsonl" for stem in stems)
    assert len((generations / f"{stems[0]}.w0of2.jsonl").read_text().splitlines()) == 2  # of 3 examples: 0, 2
    assert main(argv + ["--worker", "1/2"]) == 0  # --worker wins over the environment
    table = capsys.readouterr().out
    assert len(table.splitlines()) == 1 + 2
    assert len((generations / f"{stems[0]}.w1of2.jsonl").read_text().splitlines()) == 1
    for name in ("results.csv", "results.json", "curve.png"):
        (out / name).unlink()
    assert main(["bench", "--merge", "--out", str(out)]) == 0
    merged = capsys.readouterr().out
    assert [line.split()[:2] for line in merged.splitlines()] == [line.split()[:2] for line in table.splitlines()]
    assert all((out / name).is_file() for name in ("results.csv", "results.json", "curve.png"))


def test_calibrate_command(capsys, tiny_dirs):
    argv = ["calibrate", "--acceptance", "0.5", "--divergences", "js,tv", "--task", "freeform", "--data", PROMPTS,
            "--prompts", "3", "--max-new-tokens", "8", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--dtype", "float32", "--json"]
    assert main(argv) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["divergence"] for r in results] == ["js", "tv"]
    for r in results:
        assert r["requested"] == 0.5 and r["prompts"] == 3 and r["runs"] >= 1 and r["threshold"] >= 0


def test_generate_with_target_acceptance_calibrates_once(capsys, tmp_path, tiny_dirs, monkeypatch):
    from fuzzyspec.eval.tasks import FreeForm
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("fuzzyspec.eval.tasks.get_task", lambda name, data=None: FreeForm(PROMPTS))
    monkeypatch.setattr("fuzzyspec.eval.calibrate.CALIBRATION_PROMPTS", 3)
    argv = ["generate", "hello", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--json",
            "--target-acceptance", "0.5", "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    saved = json.loads((tmp_path / "calibrations.json").read_text())
    (calibration,) = saved.values()
    assert json.loads(captured.out)["threshold"] == calibration["threshold"]
    assert "[calibrated] js T=" in captured.err
    monkeypatch.setattr("fuzzyspec.eval.calibrate.calibrate_pair", None)  # a second call must read the cache
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["threshold"] == calibration["threshold"]


def test_version_threads_and_python_dash_m(capsys, tiny_dirs):
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.startswith("fuzzyspec ")
    assert main(["--threads", "1", "generate", "hi", "--target", tiny_dirs["target"], "--method", "ar", "--json",
                 "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    fails_cleanly(capsys, ["--threads", "0", "generate", "hi"], "--threads must be >= 1")
    done = subprocess.run([sys.executable, "-m", "fuzzyspec", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "generate" in done.stdout


COLLECTOR_SEEN = """
import atexit, gc, sys
from fuzzyspec import cli
seen = []
load = cli._load_pair
def traced(*args, **kwargs):
    seen.append(gc.isenabled())
    pair = load(*args, **kwargs)
    seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
    return pair
cli._load_pair = traced
atexit.register(lambda: print("seen", seen))
sys.argv = ["fuzzyspec", "generate", "hi", "--method", "ar", "--max-new-tokens", "2", "--target", sys.argv[1]]
cli.run()
"""


def test_the_collector_waits_for_start_up_in_a_process_of_its_own_and_only_there(tiny_dirs):
    """The console script (``run``) holds Python's garbage collector off while a command starts, and turns it on,
    start-up's objects frozen, once the models are loaded; ``main`` called from Python leaves it as it was."""
    done = subprocess.run([sys.executable, "-c", COLLECTOR_SEEN, tiny_dirs["target"]], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "seen [False, (True, True)]"
    frozen = gc.get_freeze_count()
    assert main(["generate", "hi", "--target", tiny_dirs["target"], "--method", "ar", "--max-new-tokens", "2"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen


LEFT_AT_ONCE = """
import atexit, pathlib, sys, threading, time, weakref
from fuzzyspec import cli
out = pathlib.Path(sys.argv[2])
def late():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
class Held:
    pass
held = Held()
weakref.finalize(held, lambda: (out / "finalized").write_text("ran"))
atexit.register(lambda: (out / "handler").write_text("ran"))
sys.argv = ["fuzzyspec", "generate", "hi", "--method", "ar", "--max-new-tokens", "3", "--json", "--target", sys.argv[1]]
cli.run()
"""


def test_an_answered_generate_leaves_at_once_having_done_what_an_exit_does(tiny_dirs, tmp_path):
    """The console script ends an answered ``generate`` without the interpreter's tear-down (0.15 s of the main
    command), after what a normal exit does that anyone relies on: other threads joined, exit handlers and
    ``weakref.finalize`` callbacks run, the output whole."""
    done = subprocess.run([sys.executable, "-c", LEFT_AT_ONCE, tiny_dirs["target"], str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["new_tokens"] <= 3
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == {
        "thread": "joined", "handler": "ran", "finalized": "ran"}


def test_a_prompt_longer_than_the_context_is_refused_before_decoding(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi " * 2000, "--target", tiny_dirs["target"], "--method", "ar"],
                  "the target's context holds")


def test_cuda_without_cuda_and_unwritable_outputs_are_one_line(capsys, tmp_path):
    import torch
    if not torch.cuda.is_available():
        fails_cleanly(capsys, ["generate", "hi", "--device", "cuda"], "no CUDA GPU")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails_cleanly(capsys, ["bench", "--task", "freeform", "--data", PROMPTS, "--out", str(blocker / "sub")],
                  "cannot write there")


def test_bench_methods_is_the_old_name_of_drafts(capsys, tmp_path, tiny_dirs):
    argv = ["bench", "--task", "freeform", "--data", PROMPTS, "--out", str(tmp_path), "--target", tiny_dirs["target"],
            "--methods", "ar", "--limit", "1", "--max-new-tokens", "3", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    assert "now --drafts" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--temperature", "inf"], "finite number"), (["--seed", str(2**70)], "seed must be in"),
])
def test_out_of_range_numbers_are_one_line(capsys, argv, fragment):
    fails_cleanly(capsys, ["generate", "hi", *argv], fragment)


def test_a_truncated_gguf_is_one_line(capsys, tmp_path):
    from fuzzyspec.loading import embedded_gguf
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(embedded_gguf().read_bytes()[:100_000])
    fails_cleanly(capsys, ["generate", "hi", "--target", str(broken), "--method", "ar"], "could not load model")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything loads a model: every check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr("fuzzyspec.loading.load_model", refuse)
    monkeypatch.setattr("fuzzyspec.api.load_model", refuse)


@pytest.mark.parametrize("argv, fragment", [
    (["--temperature", "-1"], "--temperature"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--gamma", "0"], "--gamma"), (["--seed", "-4"], "--seed"), (["--device", "tpu"], "--device"),
    (["--draft", "lookup", "--tree"], "--tree"), (["--draft", "nosuch"], "unknown drafter 'nosuch'"),
    (["--draft", "someone/no-such-model"], "the hub is unreachable"), (["--method", "sd", "--draft", "self:x"], "self:N"),
])
def test_every_check_runs_before_any_model_loads(capsys, no_model_loads, monkeypatch, argv, fragment):
    monkeypatch.setattr("fuzzyspec.loading._hub_reachable", lambda timeout=3.0: False)  # as on an offline machine
    fails_cleanly(capsys, ["generate", "hi", *argv], fragment)


def test_prompts_from_standard_input_and_files(capsys, tiny_dirs, tmp_path, monkeypatch):
    import io
    common = ["--target", tiny_dirs["target"], "--draft", "lookup", "--json", "--max-new-tokens", "4"]
    assert main(["generate", "hello there", *common]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("hello there".encode())))
    assert main(["generate", "-", *common]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    path = tmp_path / "prompt.txt"
    path.write_text("hello there", encoding="utf-8")
    assert main(["generate", "--prompt-file", str(path), *common]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    path.write_bytes(b"caf\xe9")
    fails_cleanly(capsys, ["generate", "--prompt-file", str(path)], "not UTF-8 text")
    fails_cleanly(capsys, ["generate", "--prompt-file", str(tmp_path / "missing.txt")], "--prompt-file")
    fails_cleanly(capsys, ["generate"], "a prompt is required")


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates: one line, exit 2, no traceback."""
    done = subprocess.run([sys.executable.encode(), b"-m", b"fuzzyspec", b"generate", b"caf\xe9 \xff"],
                          capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "not valid UTF-8" in err and "Traceback" not in err


def test_help_shows_every_default_and_why_the_default_job_is_lossless(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "lossless" in text and "(default: sd;" in text and "(default: 0.3)" in text
    assert "(default: on with the default drafter" in text and "(default: default)" in text


def test_stats_name_a_threshold_only_where_a_rule_reads_it(capsys, tiny_dirs):
    common = ["generate", "hi", "--target", tiny_dirs["target"], "--draft", "lookup", "--json", "--max-new-tokens", "3"]
    for method, threshold in (("sd", None), ("ar", None), ("fsd", 0.3)):
        assert main([*common, "--method", method]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["method"] == method and result["threshold"] == threshold


def test_the_python_api_runs_the_same_job_as_the_command_line(capsys, tiny_dirs):
    from fuzzyspec.api import ModelPair
    assert main(["generate", "hello there", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--json",
                 "--max-new-tokens", "10", "--dtype", "float32"]) == 0
    cli = json.loads(capsys.readouterr().out)
    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], "float32")
    config = pair.config(max_new_tokens=10)
    result = pair.generate("hello there", max_new_tokens=10)
    assert {k: cli[k] for k in config.describe()} == config.describe() and cli["method"] == "sd"
    assert result.text == cli["text"] and result.stats.target_forwards == cli["stats"]["target_forwards"]


def test_int4_weights_need_a_gguf_target(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--weights", "int4", "--method", "ar"],
                  "--weights int4 holds a GGUF target")


def test_tune_measures_keeps_and_explains_the_profile(capsys, tiny_dirs, tmp_path, monkeypatch):
    """`fuzzyspec tune` measures the target's widths and the drafter's sizes, keeps the profile where decoding
    finds it, and prints the draft sizes the planner picks from it."""
    from fuzzyspec import tuning
    from fuzzyspec.api import ModelPair

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    assert main(["tune", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--dtype", "float32",
                 "--no-compile", "--widths", "1,2,4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    eager = report["profiles"]["eager"]
    assert set(eager["target_ms"]) == {"1", "2", "4"} and all(ms > 0 for ms in eager["target_ms"].values())
    (drafting,) = eager["draft_ms"].values()
    assert set(drafting) == {"1", "2", "3", "4", "5"}  # chains up to the default --gamma
    (choices,) = eager["choices"].values()
    assert all(0 <= depth <= 5 and breadth == 1 for depth, breadth in choices.values())  # a draft LM: chains
    (speedup,) = eager["speedup"].values()  # the planner's x AR at each first-draft acceptance: never below AR
    assert speedup.keys() == choices.keys() and all(x >= 1.0 for x in speedup.values())
    assert eager["chain_pays_from"] is None or 0 < eager["chain_pays_from"] <= 1
    assert eager["acceptance_met"] == {}  # no decoding has run under this profile yet
    assert "avx2" in report["machine"] or "threads" in report["machine"]
    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="float32")
    assert pair.profile_key == eager["key"] and tuning.load(pair.profile_key).target.keys() >= {1, 2, 4}
    assert tuning.load(pair.profile_key).outside_ms(1) > 0  # what a step spends around its forward, for the planner


def test_tune_prints_from_what_acceptance_drafting_pays_and_what_decoding_met(capsys, tiny_dirs, tmp_path, monkeypatch):
    """Printed, `fuzzyspec tune` says the planner's speed over AR at each first-draft acceptance, from which one a
    chain pays, and what the drafter's rows met in decoding on this machine with the draft a new row starts from."""
    from fuzzyspec import tuning
    from fuzzyspec.core.cost import Acceptance, population_key

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "measure_target", lambda step, widths, **kwargs: ({w: 10.0 for w in widths}, {}))
    monkeypatch.setattr(tuning, "measure_drafter", lambda pair, breadth, sizes: {s: 1.0 * s for s in sizes})
    command = ["tune", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--dtype", "float32",
               "--no-compile", "--widths", "1,2,4,6"]
    assert main(command + ["--json"]) == 0
    key = json.loads(capsys.readouterr().out)["profiles"]["eager"]["key"]
    profile = tuning.load(key)
    (drafter,) = {name.split(":")[0] for name in profile.draft}
    row = Acceptance(population=profile.population(population_key(drafter, "sd", 0.0, True)))
    for step in range(100):
        row.record(proposed=1, ranks=[1] if step % 2 else [])  # half the first drafts pass
    tuning.save(key, profile)
    assert main(command) == 0
    printed = capsys.readouterr().out
    pays_from = float(re.search(r"a chain pays from a first-draft acceptance of ([0-9.]+)", printed).group(1))
    assert "0.5 -> " in printed and abs(pays_from - 0.1) < 0.006  # (1 + a) / (10 + 1) > 1 / 10
    assert f"met in decoding here ({population_key(drafter, 'sd', 0.0, True)}): first drafts passed 0.5" in printed


def test_tune_prices_compiled_drafting_after_preparing_it_as_decoding_does(capsys, tiny_dirs, tmp_path, monkeypatch):
    """Compiled, `fuzzyspec tune` prepares the pair as serve and bench do (every shape the default job's drafts
    verify, and an EAGLE head's direct calls) before it times drafting: timed unprepared, an EAGLE head's calls
    went through dynamo, and a 1-token chain was priced at 1.4-2.2 ms where decoding pays about 0.6."""
    from fuzzyspec import cli, tuning

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    events = []
    monkeypatch.setattr(cli, "_persist_compiled_code", lambda: None)
    monkeypatch.setattr(tuning, "measure_target", lambda step, widths, **kwargs: ({w: 1.0 + w for w in widths}, {}))
    monkeypatch.setattr(tuning, "prepare", lambda pair, config, **kwargs: events.append(("prepare", config.method,
                                                                                         pair.step.compile)))
    monkeypatch.setattr(tuning, "measure_drafter",
                        lambda pair, breadth, sizes: events.append(("drafting", breadth)) or {s: 0.5 for s in sizes})
    assert main(["tune", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--dtype", "float32",
                 "--compile", "--widths", "1,2", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["profiles"]) == {"compiled"}
    assert events[0][0] == "prepare" and events[0][1] != "ar" and events[0][2] is True
    assert [event for event in events if event[0] == "drafting"] and "prepare" not in [e[0] for e in events[1:]]


def test_compiled_code_is_kept_per_kind_of_cpu(monkeypatch, tmp_path):
    """Inductor's cache reused under another CPU capability ran code built for the other (garbage logits, or a
    crash): the compiled code a command keeps goes to a folder of the cache per kind of CPU, unless the user names
    one. Importing torch._dynamo sets the variable to inductor's default folder, which does not count as named."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from fuzzyspec import cli

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    folders = []
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        cli._persist_compiled_code()
        folders.append(Path(cli.os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    assert folders[0] != folders[1] and all(folder.parent == tmp_path / "inductor" for folder in folders)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cli._persist_compiled_code()
    assert cli.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
