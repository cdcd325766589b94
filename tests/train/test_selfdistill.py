import json

import pytest
import torch

from conftest import tiny_llama
from fuzzyspec.core.config import DecodeConfig
from fuzzyspec.core.engine import decode
from fuzzyspec.train.selfdistill import AnswerSettings, generate_answers, load_answers, training_prompts

V = 32
PROMPTS = [[1, 5, 9], [4], [8, 8, 8, 1, 0, 30], [3, 3], [12, 20, 7, 7, 1], [2, 6], [9, 9, 9, 9]]
SETTINGS = AnswerSettings(temperatures=(0.0, 0.9), max_new_tokens=12, shard_size=3)


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(vocab_size=V, layers=2, seed=11)


def test_answers_are_the_targets_own_and_resume_by_shard(tmp_path, target_model):
    written = generate_answers(target_model, PROMPTS, tmp_path, SETTINGS, eos_token_ids=(31,), batch_size=2,
                               progress=False)
    assert written == 2 * len(PROMPTS)
    data = load_answers(tmp_path)
    assert len(data) == 2 * len(PROMPTS)
    assert {p.name for p in tmp_path.glob("answers-*.npz")} == {
        f"answers-t{t}-{s:05d}.npz" for s in range(3) for t in ("0", "0.9")}
    for index, prompt in enumerate(PROMPTS):
        shard, row = divmod(index, 3)
        position = shard * 6 + row  # per shard: its greedy answers, then its sampled ones
        sequence = data[position].tolist()
        assert sequence[: len(prompt)] == prompt and data.loss_from[position] == len(prompt)
        alone, _ = decode(target_model, None, torch.tensor([prompt]),
                          DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=(31,)), V)
        assert sequence[len(prompt):] == alone[0].tolist()
    # Nothing is redone; a deleted shard is.
    assert generate_answers(target_model, PROMPTS, tmp_path, SETTINGS, (31,), 2, progress=False) == 0
    (tmp_path / "answers-t0.9-00001.npz").unlink()
    assert generate_answers(target_model, PROMPTS, tmp_path, SETTINGS, (31,), 2, progress=False) == 3
    assert [s.tolist() for s in load_answers(tmp_path)] == [s.tolist() for s in data]


def test_workers_share_shards_and_answers_do_not_depend_on_the_batch(tmp_path, target_model):
    for worker in range(3):
        generate_answers(target_model, PROMPTS, tmp_path / "split", SETTINGS, (31,), batch_size=4,
                         worker=(worker, 3), progress=False)
    generate_answers(target_model, PROMPTS, tmp_path / "one", SETTINGS, (31,), batch_size=1, progress=False)
    split, one = load_answers(tmp_path / "split"), load_answers(tmp_path / "one")
    assert [s.tolist() for s in split] == [s.tolist() for s in one]
    sampled = [s.tolist() for i, s in enumerate(one) if (i // 3) % 2 == 1]
    assert sampled != [s.tolist() for i, s in enumerate(one) if (i // 3) % 2 == 0]


def test_a_folder_refuses_other_settings(tmp_path, target_model):
    generate_answers(target_model, PROMPTS[:2], tmp_path, SETTINGS, (31,), progress=False)
    with pytest.raises(ValueError, match="other settings"):
        generate_answers(target_model, PROMPTS[:2], tmp_path, AnswerSettings(max_new_tokens=5), (31,),
                         progress=False)
    with pytest.raises(ValueError, match="worker"):
        generate_answers(target_model, PROMPTS, tmp_path / "w", SETTINGS, (31,), worker=(3, 3), progress=False)
    with pytest.raises(ValueError, match="no answers"):
        load_answers(tmp_path / "empty")


def test_prompts_from_a_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [{"prompt": "hi"}, {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}]))
    assert training_prompts(str(path)) == ["hi", [{"role": "user", "content": "a"},
                                                  {"role": "assistant", "content": "b"},
                                                  {"role": "user", "content": "c"}]]
    assert len(training_prompts(str(path), limit=1)) == 1
