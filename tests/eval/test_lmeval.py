"""The lm-eval-harness model: generation through the engine, likelihoods from the target, a local task end to end."""
from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from fuzzyspec.cli import main  # noqa: E402
from fuzzyspec.eval.lmeval import FuzzySpecLM  # noqa: E402

CONTEXTS = ["w1 w2 w3 one two", "The capital of France is", "3 + 4 ="]


def generation_requests(max_tokens: int = 12, until=("\n\n",)) -> list[Instance]:
    return [Instance("generate_until", {}, (context, {"until": list(until), "max_gen_toks": max_tokens}), i)
            for i, context in enumerate(CONTEXTS)]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    load = dict(target=tiny_dirs["target"], dtype="float32")
    return {"ar": FuzzySpecLM(method="ar", **load),
            "sd": FuzzySpecLM(draft=tiny_dirs["draft"], method="sd", gamma=4, **load),
            "everything": FuzzySpecLM(draft=tiny_dirs["draft"], method="fsd", threshold="inf", **load)}


def test_greedy_sd_generations_are_the_targets(models):
    ar = models["ar"].generate_until(generation_requests())
    assert models["sd"].generate_until(generation_requests()) == ar
    assert all(text for text in ar)
    assert models["sd"].target_forwards > 0


def test_model_arguments_reach_the_engine(models):
    """fsd at an infinite threshold accepts every draft, so the target never runs: the draft's text."""
    texts = models["everything"].generate_until(generation_requests(max_tokens=20, until=()))
    assert models["everything"].new_tokens > 0 and models["everything"].target_forwards == 0
    assert texts != models["ar"].generate_until(generation_requests(max_tokens=20, until=()))


def test_loglikelihood_is_the_targets(models):
    model = models["sd"]
    requests = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
                Instance("loglikelihood", {}, ("w1 w2", " w3 w4 w5"), 1)]
    results = model.loglikelihood(requests)
    for (context, continuation), (log_prob, greedy) in zip([r.args for r in requests], results):
        whole = model.tok_encode(context + continuation)
        start = len(model.tok_encode(context))
        with torch.no_grad():
            logits = model.pair.target(input_ids=torch.tensor([whole])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(start - 1, len(whole) - 1), whole[start:]].sum()
        assert log_prob == pytest.approx(float(expected), abs=1e-4)
        assert isinstance(greedy, bool)
    rolling = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("w1 w2 w3 w4",), 0)])
    assert rolling[0] < 0


def test_unknown_model_arguments_are_named(tiny_dirs):
    with pytest.raises(ValueError, match="thresold"):
        FuzzySpecLM(target=tiny_dirs["target"], draft=tiny_dirs["draft"], thresold=0.3)
    with pytest.raises(ValueError, match="temperature"):
        FuzzySpecLM(target=tiny_dirs["target"], draft=tiny_dirs["draft"], temperature=0.5)


def test_a_local_task_through_the_command_line(tiny_dirs, tmp_path, capsys, monkeypatch):
    """`fuzzyspec lm-eval run --model fuzzyspec` on a task read from local JSONL: nothing from the network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"w{i} w{i + 1} w{i + 2}", "answer": f"w{i + 3}"}) + "\n"
                            for i in range(1, 5)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_gen.yaml").write_text(f"""task: fuzzyspec_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    (tasks / "tiny_choice.yaml").write_text(f"""task: fuzzyspec_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: ["w1", "w2", "w3"]
doc_to_target: 0
metric_list:
  - metric: acc
""")
    out = tmp_path / "results"
    code = main(["lm-eval", "run", "--model", "fuzzyspec", "--model_args",
                 f"target={tiny_dirs['target']},draft={tiny_dirs['draft']},method=fsd,threshold=0.2,dtype=float32",
                 "--tasks", "fuzzyspec_tiny_gen", "fuzzyspec_tiny_choice", "--include_path", str(tasks),
                 "--output_path", str(out)])
    assert code in (0, None)
    printed = capsys.readouterr().out
    assert "fuzzyspec_tiny_gen" in printed and "exact_match" in printed
    assert "fuzzyspec_tiny_choice" in printed and "acc" in printed
    results = json.loads(next(out.rglob("results*.json")).read_text())["results"]
    assert set(results) == {"fuzzyspec_tiny_gen", "fuzzyspec_tiny_choice"}
