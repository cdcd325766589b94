import json
import subprocess
import sys

import pytest

from fuzzyspec.cli import main


def fails_cleanly(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fuzzyspec: error: ") and "\n" not in err and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    return err


@pytest.mark.parametrize("argv, fragments", [
    (["--divergence", "cosine"], ["unknown divergence 'cosine'", "js", "kl_pq", "top_k_js_div"]),
    (["--threshold", "-0.5"], ["threshold must be >= 0"]),
    (["--threshold", "nan"], ["threshold must be >= 0"]),
    (["--threshold", "abc"], ["threshold must be a number"]),
    (["--gamma", "0"], ["gamma must be >= 1"]),
    (["--max-new-tokens", "0"], ["max_new_tokens must be >= 1"]),
    (["--method", "beam"], ["invalid choice"]),
    (["--temperature", "-1"], ["temperature must be >= 0"]),
    (["--top-p", "0"], ["top_p must be in (0, 1]"]),
    (["--tree-depth", "0"], ["tree_depth must be >= 1"]),
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
                  "tree drafting needs an EAGLE head")


def test_bad_self_draft(capsys, tiny_dirs):
    fails_cleanly(capsys, ["generate", "hi", "--target", tiny_dirs["target"], "--draft", "self:5"],
                  "between 1 and 1 layers")


def test_usage_errors_are_one_line(capsys):
    fails_cleanly(capsys, [])
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
    argv = ["generate", "hello", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--max-new-tokens", "10", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
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
