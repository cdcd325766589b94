import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_llama
from fuzzyspec.api import ModelPair
from fuzzyspec.loading import LoadError, load_model, resolve_dtype, shared_vocab_size
from fuzzyspec.text import TextStream


def test_padding_rows_are_fine(tiny_dirs):
    target, tokenizer = load_model(tiny_dirs["target"], dtype="float32")
    padded, _ = load_model(tiny_dirs["draft"], dtype="float32")
    padded.resize_token_embeddings(len(tokenizer) + 64)  # unused padding rows
    assert shared_vocab_size(target, padded.get_output_embeddings().weight.shape[0], tokenizer) == len(tokenizer)


def test_pair_generates_with_chat_template(tiny_dirs):
    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="float32")
    assert pair.target.dtype == torch.float32
    chat = pair.encode("hello")
    plain = pair.encode("hello", chat=False)
    assert chat.shape[1] > plain.shape[1]  # the template wraps the message
    pieces = []
    result = pair.generate("hello", method="sd", max_new_tokens=9, on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert result.stats.new_tokens == len(result.tokens) <= 9
    assert result.finish_reason in ("stop", "length")


def test_an_unwatched_answer_is_decoded_once_with_the_same_text(tiny_dirs, monkeypatch):
    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], dtype="float32")
    pieces = []
    streamed = pair.generate("hello", method="sd", max_new_tokens=12, on_text=pieces.append)
    pushes = []
    push = TextStream.push
    monkeypatch.setattr(TextStream, "push", lambda self, tokens: pushes.append(len(tokens)) or push(self, tokens))
    quiet = pair.generate("hello", method="sd", max_new_tokens=12)
    assert quiet.text == streamed.text == "".join(pieces) and quiet.tokens == streamed.tokens
    assert pushes == [len(quiet.tokens)]  # one push at the end, none a step
    # a stop string is watched for as the answer comes, with or without a reader
    stop = streamed.text[len(streamed.text) // 2:][:3]
    assert stop.strip()
    cut = pair.generate("hello", method="sd", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == streamed.text[: streamed.text.find(stop)]


def test_dtype_choice():
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu") in (torch.bfloat16, torch.float32)
    with pytest.raises(LoadError):
        resolve_dtype("int3", "cpu")


def test_old_module_paths_still_import():
    """Modules moved into subpackages keep their old import paths (and patching one patches the module)."""
    import importlib

    from fuzzyspec.drafters.eagle import EagleDrafter
    from fuzzyspec.eval import calibrate
    from fuzzyspec.serve.app import ServeConfig

    assert importlib.import_module("fuzzyspec.eagle").EagleDrafter is EagleDrafter
    assert importlib.import_module("fuzzyspec.server").ServeConfig is ServeConfig
    from fuzzyspec.core.decoding import DecodeConfig, decode  # noqa: F401
    from fuzzyspec.train import TrainConfig, train  # noqa: F401
    old = importlib.import_module("fuzzyspec.calibrate")
    before = calibrate.CALIBRATION_PROMPTS
    old.CALIBRATION_PROMPTS = before + 1
    try:
        assert calibrate.CALIBRATION_PROMPTS == before + 1
    finally:
        old.CALIBRATION_PROMPTS = before


def test_the_weights_form_is_decided_before_loading(tmp_path):
    """auto: a GGUF target on the CPU at its own 4-bit bytes unless --dtype names a float type; the float forms
    are dtypes; int4 where it cannot apply is one clear error."""
    from fuzzyspec.core import kernels
    from fuzzyspec.loading import weight_form

    if kernels.available():
        assert weight_form(None) == "int4" and weight_form(None, "int4", "float32") == "int4"
    assert weight_form(None, dtype="float32") == "float32" and weight_form("some/folder") == "auto"
    assert weight_form(None, "fp32") == "float32" and weight_form("some/folder", "bf16") == "bfloat16"
    for weights, dtype, device, name, problem in [
            ("fp32", "bfloat16", "cpu", None, "disagree"), ("int4", "auto", "cpu", "some/folder", "GGUF"),
            ("int4", "auto", "cuda", None, "CPU"), ("int4", "bfloat16", "cpu", None, "does not apply"),
            ("int8", "auto", "cpu", None, "must be one of")]:
        with pytest.raises(LoadError, match=problem):
            weight_form(name, weights, dtype, device)
    unreadable = tmp_path / "broken.gguf"
    unreadable.write_bytes(b"GGUF\x03")  # loading it, not choosing its form, says what is wrong
    assert weight_form(str(unreadable)) == ("int4" if kernels.available() else "auto")


def test_a_gguf_header_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """The CLI, load_model and weight_form each ask whether a GGUF holds 4-bit linears: the header is read once,
    and again only once the file changed."""
    import os

    from fuzzyspec import gguf, loading

    reads = []
    monkeypatch.setattr(gguf, "GGUFFile", lambda path: reads.append(path) or (_ for _ in ()).throw(ValueError()))
    target = tmp_path / "model.gguf"
    target.write_bytes(b"GGUF\x03")
    for _ in range(3):
        assert loading.int4_likely(str(target), "auto", "cpu", "auto")
    assert len(reads) == 1
    target.write_bytes(b"GGUF\x03\x00")
    os.utime(target, ns=(1, 1))
    assert loading.int4_likely(str(target), "auto", "cpu", "auto") and len(reads) == 2


def test_where_the_kernels_cannot_run_auto_holds_floats_and_int4_says_why(monkeypatch):
    from fuzzyspec.core import kernels
    from fuzzyspec.loading import weight_form

    monkeypatch.setattr(kernels, "unavailable", lambda: "the CPU kernels could not be built here (no compiler)")
    assert weight_form(None) == "auto"  # floats, by --dtype auto
    with pytest.raises(LoadError, match=r"^--weights int4 is not available: the CPU kernels could not be built here "
                                        r"\(no compiler\); use --weights fp32$"):
        weight_form(None, "int4")


def test_auto_weights_follow_what_tune_measured_faster(tmp_path, monkeypatch):
    """Where `fuzzyspec tune` measured the dequantized float step faster than the int4 one on this machine,
    --weights auto holds floats; with no measurement, or int4 measured faster, it holds int4."""
    from fuzzyspec import tuning
    from fuzzyspec.core import kernels
    from fuzzyspec.loading import weight_form

    if not kernels.available():
        pytest.skip("this torch build has no CPU int4 kernel")
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    assert weight_form(None) == "int4"
    tuning.note(tuning.weights_key(None, "cpu"), fastest_weights="fp32", int4_ms=40.0, float_ms=30.0)
    assert weight_form(None) == "float32" and weight_form(None, "int4") == "int4"  # asked for, int4 it is
    assert tuning.profile_key(None, "auto", "auto", "cpu", False).split("|")[1] == "torch.float32"
    tuning.note(tuning.weights_key(None, "cpu"), fastest_weights="int4")
    assert weight_form(None) == "int4"


def _a_first_load(monkeypatch, tmp_path, failed: bool = False, unavailable: str | None = None) -> list[str]:
    """load_model's steps toward a GGUF target at 4 bits, recorded in order, with nothing built or made."""
    from fuzzyspec import loading
    from fuzzyspec.core import kernels

    steps: list[str] = []
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "build_soon", lambda: steps.append("build started"))
    monkeypatch.setattr(kernels, "failed", lambda: failed)
    monkeypatch.setattr(kernels, "unavailable", lambda: steps.append("kernels awaited") or unavailable)
    monkeypatch.setattr(loading, "_gguf_tokenizer", lambda name: steps.append("tokenizer") or "the tokenizer")
    monkeypatch.setattr(loading, "_load_int4", lambda name, tokenizer: steps.append("4-bit model made") or
                        ("the 4-bit model", tokenizer))
    return steps


def test_the_4_bit_model_is_made_while_the_kernels_build(tmp_path, monkeypatch):
    """A machine's first load builds the kernels in other processes: the tokenizer and the 4-bit model (which needs
    no kernel to be made) are made meanwhile, before the kernels are awaited, and the model is made once."""
    steps = _a_first_load(monkeypatch, tmp_path)
    assert load_model(None) == ("the 4-bit model", "the tokenizer")
    assert steps[:3] == ["build started", "tokenizer", "4-bit model made"] and "kernels awaited" in steps[3:]
    assert steps.count("4-bit model made") == 1


def test_no_4_bit_model_is_made_where_it_will_not_serve(tmp_path, monkeypatch):
    """Not where the kernels failed to build already, nor where `tune` measured floats faster (--weights auto) or
    --dtype asks for floats."""
    from fuzzyspec import loading, tuning

    steps = _a_first_load(monkeypatch, tmp_path, failed=True, unavailable="no compiler")
    with pytest.raises(LoadError, match="int4 is not available: no compiler"):
        load_model(None, weights="int4")
    assert "4-bit model made" not in steps
    tuning.note(tuning.weights_key(None, "cpu"), fastest_weights="fp32")
    for dtype, weights in (("auto", "auto"), ("float32", "auto")):
        steps = _a_first_load(monkeypatch, tmp_path)
        monkeypatch.setattr(loading, "weight_form", lambda *args: steps.append("decided") or "float32")
        monkeypatch.setattr(loading, "resolve_dtype", lambda *args: (_ for _ in ()).throw(LookupError("floats")))
        with pytest.raises(LookupError, match="floats"):  # (where the float load would begin)
            load_model(None, dtype, weights=weights)
        assert steps == ["build started", "tokenizer", "decided"]


def test_tune_compares_weights_again_whichever_form_auto_holds(tmp_path, monkeypatch):
    """Once float weights were measured faster, `tune` (which then loads floats) times int4 beside them, so a
    later measurement can move --weights auto back to int4."""
    import argparse

    from fuzzyspec import cli, loading, tuning
    from fuzzyspec.core import kernels
    from fuzzyspec.loading import auto_may_hold_int4, weight_form

    if not kernels.available():
        pytest.skip("this torch build has no CPU int4 kernel")
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "_cpu_has_bf16", lambda: False)  # the float form is float32 on any CPU here
    tuning.note(tuning.weights_key(None, "cpu"), fastest_weights="fp32", int4_ms=40.0, float_ms=30.0)
    assert weight_form(None) == "float32" and auto_may_hold_int4(None)
    loaded = []
    monkeypatch.setattr(loading, "load_model", lambda name, dtype, device, weights: loaded.append(weights) or
                        (tiny_llama(), None))
    monkeypatch.setattr(tuning, "measure_target", lambda step, widths: ({1: 20.0}, {}))
    args = argparse.Namespace(target=None, dtype="auto")
    report = cli._compare_weights(args, "cpu", {1: 30.0})  # auto holds float32: int4 is timed beside it
    assert loaded == ["int4"] and report == {"step_ms": {"int4": 20.0, "float32": 30.0}, "fastest": "int4"}
    assert weight_form(None) == "int4"
    report = cli._compare_weights(args, "cpu", {1: 35.0})  # and from int4, the float form is timed
    assert loaded == ["int4", "fp32"] and report["fastest"] == "fp32" and weight_form(None) == "float32"


@pytest.mark.embedded
def test_a_damaged_kept_tokenizer_is_converted_again_from_the_gguf(tmp_path, monkeypatch, caplog):
    """The GGUF is the source of a kept tokenizer folder: one that cannot be read is said in a line and made again."""
    import json

    from fuzzyspec.loading import _gguf_tokenizer, embedded_gguf

    gguf = tmp_path / "copy" / embedded_gguf().name
    gguf.parent.mkdir()
    gguf.symlink_to(embedded_gguf())
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("fuzzyspec.loading.embedded_gguf", lambda: gguf)
    first = _gguf_tokenizer(None)
    kept = next((tmp_path / "cache" / "tokenizers").iterdir()) / "tokenizer.json"
    whole = kept.read_text()
    kept.write_text(whole[:1000])  # cut short
    again = _gguf_tokenizer(None)
    assert "cannot be read" in caplog.text and "converting the GGUF's again" in caplog.text
    assert json.loads(kept.read_text()) == json.loads(whole)
    assert again.encode("Name three rivers.") == first.encode("Name three rivers.")
    for saved in kept.parent.iterdir():  # a folder holding neither file (no conversion leaves one): converted again
        saved.unlink()
    (kept.parent / "stray.txt").write_text("not a tokenizer")
    assert _gguf_tokenizer(None).encode("Name three rivers.") == first.encode("Name three rivers.")
    assert json.loads(kept.read_text()) == json.loads(whole)


@pytest.mark.embedded
def test_a_new_conversion_removes_the_same_files_older_tokenizer_folders(tmp_path, monkeypatch):
    """The tokenizer folders an older ``TOKENIZER_VERSION`` made of the same file go when it is converted anew; another
    file's folders, and the current version's, stay."""
    from fuzzyspec import loading

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "TOKENIZER_VERSION", 3)
    current = loading.tokenizer_folder(loading.embedded_gguf())
    base = current.name.rsplit("-", 1)[0]
    older = [current.parent / base, current.parent / f"{base}-1", current.parent / f"{base}-2"]
    others = [current.parent / "Other.Q4_0-1234", current.parent / "Other.Q4_0-1234-2"]
    for folder in (*older, *others):
        folder.mkdir(parents=True)
        (folder / "tokenizer.json").write_text("{}")
    loading._gguf_tokenizer(None)
    assert (current / "tokenizer.json").is_file()
    assert not any(folder.exists() for folder in older) and all(folder.is_dir() for folder in others)


@pytest.mark.embedded
def test_the_embedded_tokenizer_converts_without_transformers_as_llama_cpp_splits(tmp_path, monkeypatch):
    """A first run converts the embedded GGUF's tokenizer itself (``gguf_tokenizer``), never through transformers'
    converter (``loading._converted_tokenizer``), and splits digits off as the model's own tokenizer did. The ids:
    for the texts without digits, those transformers' converter gave (5.24, 2026-11-26); for the one with digits,
    llama.cpp's tokenizer of the same file (llama-cpp-python 0.3.36, 2026-11-29), where transformers' converter
    gave two newline tokens before "1" and before "2", for one."""
    from fuzzyspec import loading

    gguf = tmp_path / "copy" / loading.embedded_gguf().name
    gguf.parent.mkdir()
    gguf.symlink_to(loading.embedded_gguf())
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "embedded_gguf", lambda: gguf)
    monkeypatch.setattr(loading, "_converted_tokenizer", lambda path: pytest.fail("converted by transformers"))
    tokenizer = loading._gguf_tokenizer(str(gguf))
    assert type(tokenizer).__name__ == "SavedTokenizer"
    assert tokenizer("Give me three tips for writing clear emails.")["input_ids"] == [
        26533, 549, 1296, 5608, 327, 2385, 2437, 14902, 30]
    assert tokenizer("  naïve café — 你好, <|im_end|> x\n\n\tdef f(x):\n    return x**2")["input_ids"] == [
        216, 15486, 46494, 37366, 1841, 216, 18645, 250, 48392, 138, 28, 216, 2, 1792, 1116, 197, 1604, 275, 24, 104,
        727, 472, 1003, 1792, 828, 34]
    assert tokenizer("In 2024, 13 people paid $1,250.75 each.\n\n1. First\n2. Second")["input_ids"] == [
        788, 216, 34, 32, 34, 36, 28, 216, 33, 35, 701, 5940, 1885, 33, 28, 34, 37, 32, 30, 39, 37, 971, 30, 1116, 33,
        30, 3508, 198, 34, 30, 5665]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                         add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token, len(tokenizer)) == (
        2, 1, "<|im_end|>", 49152)


@pytest.mark.embedded
def test_a_gguf_tokenizer_that_gguf_tokenizer_does_not_convert_goes_to_transformers(tmp_path, monkeypatch):
    """Any GGUF tokenizer but a byte-level BPE split as ``gguf_tokenizer.SPLITS`` says goes to transformers'
    converter, as before 2026-11-29 (here the embedded file, made to look unknown: its digits are not isolated)."""
    from fuzzyspec import gguf_tokenizer, loading

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_tokenizer, "convertible", lambda read: False)
    tokenizer = loading._gguf_tokenizer(None)
    assert tokenizer("Give me three tips for writing clear emails.")["input_ids"] == [
        26533, 549, 1296, 5608, 327, 2385, 2437, 14902, 30]
    assert tokenizer.convert_ids_to_tokens(tokenizer("\n\n1")["input_ids"]) == ["Ċ", "Ċ", "1"]


@pytest.mark.embedded
def test_a_conversion_that_fails_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    from fuzzyspec import gguf_tokenizer, loading

    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path / "cache"))

    def half_written(read, folder):
        folder.mkdir(parents=True)
        (folder / "tokenizer.json").write_text("{")
        raise TypeError("'float' object is not iterable")

    monkeypatch.setattr(gguf_tokenizer, "write", half_written)
    with pytest.raises(LoadError, match="malformed"):
        loading._gguf_tokenizer(None)
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == []


@pytest.mark.embedded
def test_a_first_conversion_imports_nothing_of_transformers(tmp_path):
    """On a fresh cache holding only the GGUF, the tokenizer's conversion needs no transformers (its import and
    converter took about 2.2 s of CPU of a first run)."""
    from fuzzyspec.loading import embedded_gguf

    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / embedded_gguf().name).symlink_to(embedded_gguf())
    probe = ("import sys\n"
             "from fuzzyspec.loading import _gguf_tokenizer\n"
             "print(_gguf_tokenizer(None).encode('In 2024'), 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FUZZYSPEC_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[788,", "216,", "34,", "32,", "34,", "36]", "False"]
