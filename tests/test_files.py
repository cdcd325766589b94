"""What fuzzyspec makes once a machine and reads back (``files.made_once``)."""
import os

import pytest
import torch

from fuzzyspec import files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "made"


def made_counting(counter: list):
    def make():
        counter.append(1)
        module = torch.nn.Linear(4, 3)
        module.view = module.weight.data[1:]  # (a view and a tie, kept as they were)
        module.tied = module.weight
        return module
    return make


def test_made_once_then_read_back_as_it_was(cache, tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    made = []
    first = files.made_once("thing", [source], made_counting(made))
    again = files.made_once("thing", [source], made_counting(made))
    assert len(made) == 1 and len(list(cache.glob("thing-*.pt"))) == 1
    assert torch.serialization.get_crc32_options()  # (written without checksums; the user's own saves keep them)
    assert torch.equal(again.weight, first.weight) and torch.equal(again.bias, first.bias)
    assert again.tied is again.weight
    assert again.view.untyped_storage().data_ptr() == again.weight.untyped_storage().data_ptr()


def test_a_changed_source_makes_it_again_and_the_older_file_goes(cache, tmp_path):
    source, other = tmp_path / "weights.bin", tmp_path / "other.bin"
    source.write_bytes(b"abc")
    other.write_bytes(b"xyz")
    made = []
    files.made_once("thing", [source], made_counting(made))
    files.made_once("thing-other", [other], made_counting(made))  # (a name that begins as the first does)
    status = source.stat()
    os.utime(source, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
    files.made_once("thing", [source], made_counting(made))
    assert len(made) == 3
    assert len(list(cache.glob("thing-????????????????.pt"))) == 1
    assert len(list(cache.glob("thing-other-*.pt"))) == 1


def test_an_unreadable_file_is_made_again(cache, tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    made = []
    files.made_once("thing", [source], made_counting(made))
    kept, = cache.glob("thing-*.pt")
    kept.write_bytes(b"not a pickle")
    assert isinstance(files.made_once("thing", [source], made_counting(made)), torch.nn.Linear)
    assert len(made) == 2
    assert isinstance(files.made_once("thing", [source], made_counting(made)), torch.nn.Linear)
    assert len(made) == 2  # (written again whole)


def test_a_cache_that_cannot_be_written_gives_what_was_made(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(files, "cache_dir", lambda: blocked)  # (no folder can be made under a file)
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    made = []
    assert isinstance(files.made_once("thing", [source], made_counting(made)), torch.nn.Linear)
    assert isinstance(files.made_once("thing", [source], made_counting(made)), torch.nn.Linear)
    assert len(made) == 2
