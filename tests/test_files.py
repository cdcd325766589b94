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


def test_a_changed_source_makes_it_again_and_the_file_used_least_lately_goes(cache, tmp_path):
    source, other = tmp_path / "weights.bin", tmp_path / "other.bin"
    source.write_bytes(b"abc")
    other.write_bytes(b"xyz")
    made = []

    def version(seconds: int) -> None:  # (the source as it was, or as changed ``seconds`` later)
        os.utime(source, ns=(10**18 + seconds * 10**9, 10**18 + seconds * 10**9))
        files.made_once("thing", [source], made_counting(made))

    files.made_once("thing-other", [other], made_counting(made))  # (a name that begins as the first does)
    version(0)
    first, = cache.glob("thing-????????????????.pt")
    version(1)
    assert len(made) == 3 and len(list(cache.glob("thing-????????????????.pt"))) == 2
    second, = set(cache.glob("thing-????????????????.pt")) - {first}
    os.utime(first, (1, 1))  # (used long ago)
    version(0)  # (used again: read back, so now the one used last)
    assert len(made) == 3 and first.stat().st_mtime > 1
    version(2)  # (a third: the file of version 1, used least lately, goes)
    assert len(made) == 4
    assert len(list(cache.glob("thing-????????????????.pt"))) == 2 and first.exists() and not second.exists()
    assert len(list(cache.glob("thing-other-*.pt"))) == 1


def test_bytes_made_for_other_kernels_are_made_again(cache, tmp_path):
    """A cache shared by two machines whose kernels read other bytes (``form``: an 8-bit block with or without its
    code sums) keeps each machine's apart, rather than handing one the other's."""
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    made = []
    for form in ("q8 without sums", "q8 with sums", "q8 without sums"):
        files.made_once("thing", [source], made_counting(made), form=form)
    assert len(made) == 2 and len(list(cache.glob("thing-*.pt"))) == 2


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


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "kept" / "tokenizer"

    def fill(partial):
        partial.mkdir()
        (partial / "a.json").write_text("new")

    def fail(partial):
        partial.mkdir()
        (partial / "a.json").write_text("half")
        raise ValueError("cut short")

    with pytest.raises(ValueError):
        files.write_folder(folder, fail)
    assert list((tmp_path / "kept").iterdir()) == []  # nothing half-written left behind
    files.write_folder(folder, fill)
    assert (folder / "a.json").read_text() == "new" and list((tmp_path / "kept").iterdir()) == [folder]
    (folder / "a.json").write_text("theirs")  # (made first by another process: kept)
    files.write_folder(folder, fill)
    assert (folder / "a.json").read_text() == "theirs" and list((tmp_path / "kept").iterdir()) == [folder]
    files.write_folder(folder, fill, replace=True)  # (found damaged: replaced)
    assert (folder / "a.json").read_text() == "new" and list((tmp_path / "kept").iterdir()) == [folder]
    in_the_way = tmp_path / "kept" / "a file"
    in_the_way.write_text("not a folder")
    with pytest.raises(OSError):  # (a rename that fails with no folder there is not another process's doing)
        files.write_folder(in_the_way, fill)
    assert sorted((tmp_path / "kept").iterdir()) == sorted([folder, in_the_way])
