"""fuzzyspec.tokenizer: a converted tokenizer read without transformers, against transformers' own."""
import json
import subprocess
import sys

import pytest
import torch

from fuzzyspec.tokenizer import SavedTokenizer, transformers_tokenizer

TEXTS = ["Give me three tips for writing clear emails.", "", " ", "<|im_start|>user\nhi<|im_end|>",
         "  naïve café — 你好, <|im_end|> x\n\n\tdef f(x):\n    return x**2", "emoji 🤖🧪 and\r\nCRLF",
         "<repo_name>x<file_sep>"]
CHATS = [[{"role": "user", "content": "Hi there"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? <|im_end|>"}]]


@pytest.fixture(scope="module")
def both():
    """The embedded target's converted tokenizer, read here and by transformers."""
    from fuzzyspec.loading import _gguf_tokenizer, embedded_gguf, tokenizer_folder

    _gguf_tokenizer(None)  # (converted where it is not yet)
    folder = tokenizer_folder(embedded_gguf())
    return SavedTokenizer(folder), transformers_tokenizer(folder)


@pytest.mark.embedded
def test_it_encodes_decodes_and_renders_chats_as_transformers_does(both):
    light, full = both
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == full.encode(text, add_special_tokens=special)
        assert light(text, return_tensors="pt")["input_ids"].tolist() == \
            full(text, return_tensors="pt")["input_ids"].tolist()
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        length = int(torch.randint(40, (1,), generator=generator))
        ids = torch.randint(len(full), (length,), generator=generator).tolist()
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                full.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert light.apply_chat_template(chat, add_generation_prompt=prompt) == \
                dict(full.apply_chat_template(chat, add_generation_prompt=prompt))
            tensors = [t.apply_chat_template(chat, add_generation_prompt=prompt, return_tensors="pt")["input_ids"]
                       for t in (light, full)]
            assert tensors[0].tolist() == tensors[1].tolist()
    assert light.get_vocab() == full.get_vocab() and len(light) == len(full) == 49152
    special = [(t.eos_token_id, t.bos_token_id, t.pad_token_id, t.pad_token, t.special_tokens_map)
               for t in (light, full)]
    assert special[0] == special[1] and special[0][0] is not None
    assert light.chat_template == full.chat_template


@pytest.mark.embedded
def test_what_it_does_not_do_itself_goes_to_transformers(both):
    """Other attributes, and chats with options or messages beyond a role and a text, are transformers' answers."""
    light, full = both
    assert light.all_special_ids == full.all_special_ids and light.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    batches = [t(["Hi", "Hi there"], padding=True, return_tensors="np")["input_ids"].tolist() for t in (light, full)]
    assert batches[0] == batches[1]
    chat = [{"role": "user", "content": "Hi", "name": "ann"}]
    assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        full.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert light.apply_chat_template(CHATS[0], tokenize=False, continue_final_message=True) == \
        full.apply_chat_template(CHATS[0], tokenize=False, continue_final_message=True)


@pytest.mark.embedded
def test_the_main_command_answers_without_importing_transformers(both):
    """A 4-bit GGUF target's answer needs nothing of transformers, whose import took 0.75 s of a 3.3 s answer (once
    its tokenizer is converted, which ``both`` sees to: converting it is transformers' work, a first run's)."""
    from fuzzyspec.core import kernels

    if not kernels.available():
        pytest.skip("no CPU kernels here: the target loads as floats, through transformers")
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('transformers' in sys.modules, file=sys.stderr))\n"
             "sys.argv = ['fuzzyspec', 'generate', 'Name three rivers.', '--max-new-tokens', '8', '--json']\n"
             "from fuzzyspec.cli import run\n"
             "run()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["new_tokens"] > 0
    assert done.stderr.strip().splitlines()[-1] == "False"


@pytest.mark.embedded
def test_transformers_first_load_notes_the_added_tokens_and_loads_the_same(tmp_path):
    """transformers' first load of a converted tokenizer writes its added tokens into tokenizer_config.json (so
    later loads skip transformers' parse of the whole tokenizer.json in Python); what later loads make is the same
    tokenizer."""
    import shutil

    from fuzzyspec.loading import _gguf_tokenizer, embedded_gguf, tokenizer_folder

    _gguf_tokenizer(None)  # (the embedded target's folder, converted where it is not yet)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_folder(embedded_gguf()) / name, folder / name)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    first = transformers_tokenizer(folder)
    noted = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert noted["2"] == {"content": "<|im_end|>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} and len(noted) == 17
    again = transformers_tokenizer(folder)
    assert {k: repr(v) for k, v in again.init_kwargs.items()} == {k: repr(v) for k, v in first.init_kwargs.items()}
    assert again.added_tokens_decoder == first.added_tokens_decoder and again.get_vocab() == first.get_vocab()
    assert (again.eos_token_id, again.bos_token_id, again.pad_token_id, again.unk_token_id, again.all_special_ids) == (
        first.eos_token_id, first.bos_token_id, first.pad_token_id, first.unk_token_id, first.all_special_ids)
    text = "<|im_start|>user\nnaïve café <repo_name> x<file_sep>\t\n<|endoftext|> 你好<|im_end|>"
    assert again(text)["input_ids"] == first(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi there"}]
    assert again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = list(range(0, len(first), 5))
    assert again.decode(ids) == first.decode(ids) and \
        again.decode(ids, skip_special_tokens=True) == first.decode(ids, skip_special_tokens=True)


@pytest.mark.embedded
def test_other_templates_render_as_transformers_renders_them(both, tmp_path):
    """Templates using loop controls, namespaces, tojson and strftime_now render here as there; one marking the
    assistant's tokens with transformers' own ``{% generation %}`` tag goes to transformers."""
    import shutil

    light, _ = both
    templates = {
        "controls": "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}"
                    "{% endif %}{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m['content'] | tojson }}\n{% endfor %}"
                    "{% if add_generation_prompt %}{{ bos_token }}{{ strftime_now('%Y') | length }}{% endif %}",
        "generation": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                      "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}",
    }
    for name, template in templates.items():
        folder = tmp_path / name
        folder.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(light.folder / file, folder / file)
        (folder / "chat_template.jinja").write_text(template)
        ours, theirs = SavedTokenizer(folder), transformers_tokenizer(folder)
        for prompt in (True, False):
            assert ours.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=prompt)
        assert (ours._transformers is None) == (name == "controls")  # (the generation tag went to transformers)


@pytest.mark.embedded
def test_a_folder_whose_settings_transformers_builds_on_is_read_by_transformers(both, tmp_path):
    """With ``add_bos_token`` set, transformers builds the tokenizer's post-processor anew from its settings: such a
    folder is read by transformers, so its ids stay transformers' whatever they build."""
    import shutil

    from fuzzyspec.loading import _saved_tokenizer

    light, _ = both
    assert isinstance(_saved_tokenizer(light.folder), SavedTokenizer)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(light.folder / file, tmp_path / file)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": True}))
    tokenizer = _saved_tokenizer(tmp_path)
    assert not isinstance(tokenizer, SavedTokenizer)
    assert tokenizer.encode("Hi") == transformers_tokenizer(tmp_path).encode("Hi")
