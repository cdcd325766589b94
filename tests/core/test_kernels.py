"""Our CPU kernels' builds: every instruction set's build computes the same numbers."""
import os
import subprocess
import sys

import pytest
import torch

from fuzzyspec.core import kernels
from fuzzyspec.core.attention import attend
from fuzzyspec.core.int4 import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable()}")

NARROWER_BUILD = """
import sys, torch
from fuzzyspec.core import kernels
from fuzzyspec.core.attention import attend
from fuzzyspec.core.int4 import Int4Linear, Int8Linear
assert kernels.isa() == sys.argv[1] and kernels.available(), (kernels.isa(), kernels.unavailable())
saved = torch.load(sys.argv[2])
four = Int4Linear.from_codes(saved["codes4"], saved["scales"], saved["minimums"])
eight = Int8Linear.from_codes(saved["codes8"], saved["scales"])
x = saved["x"]
torch.save({"four": four(x), "eight": eight(x), "alone": torch.cat([four(x[i: i + 1]) for i in range(len(x))]),
            "attention": attend(*saved["attention"], 0.125),
            "attention16": attend(saved["attention"][0], saved["attention"][1].half(), saved["attention"][2].half(),
                                  saved["attention"][3], 0.125),
            "long": attend(*saved["long"], 0.125),
            "norm": torch.ops.fuzzyspec_layer.rms_norm(x, saved["x"][0], 1e-5),
            "silu": torch.ops.fuzzyspec_layer.silu_mul(x[:, :90])}, sys.argv[3])
"""


def test_every_build_this_cpu_can_run_computes_the_same_numbers(tmp_path):
    """Each instruction set's code path (AVX-512 VNNI, AVX-VNNI, AVX2) is held to the same formula: a machine runs
    only its widest build, so the narrower ones are built here (FUZZYSPEC_INT4_ISA) and run in a fresh process.
    (The attention kernel is written for AVX2 alone, the norm in plain C++; a wider build must not change their
    numbers either.)"""
    narrower = [name for name in list(kernels.ISA_FLAGS)[list(kernels.ISA_FLAGS).index(kernels.isa()) + 1:]
                if set(kernels.ISA_FLAGS[name]) <= kernels.cpu_flags()]
    if not narrower:
        pytest.skip(f"this CPU runs only the {kernels.isa()} build")
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, 5, 40, generator=generator) < 0.6
    mask[..., 0] = True
    saved = {"codes4": torch.randint(0, 16, (40, 96), generator=generator, dtype=torch.int32),
             "codes8": torch.randint(-128, 128, (40, 96), generator=generator, dtype=torch.int32),
             "scales": (torch.rand(40, 3, generator=generator) * 0.05 + 0.001).half(),
             "minimums": (torch.randn(40, 3, generator=generator) * 0.05).half(),
             "x": torch.randn(9, 96, generator=generator),
             "attention": (torch.randn(2, 5, 6, 12, generator=generator), torch.randn(2, 2, 40, 12, generator=generator),
                           torch.randn(2, 2, 40, 12, generator=generator), mask),
             # past 128 positions, in spans; 7 heads to a kv head (three, three, one at a time)
             "long": (torch.randn(1, 3, 7, 64, generator=generator), torch.randn(1, 1, 700, 64, generator=generator),
                      torch.randn(1, 1, 700, 64, generator=generator),
                      torch.rand(1, 1, 3, 700, generator=generator) < 0.6)}
    # the largest integer sums (AVX2 adds a Q4 block's products in int16): whole rows of the extreme codes, against
    # tokens whose every activation code is 127, or -127
    saved["codes4"][:4] = 15
    saved["codes8"][:4], saved["codes8"][4:8] = -128, 127
    saved["x"][7], saved["x"][8] = 1.0, -1.0
    torch.save(saved, tmp_path / "in.pt")
    four = Int4Linear.from_codes(saved["codes4"], saved["scales"], saved["minimums"])
    eight = Int8Linear.from_codes(saved["codes8"], saved["scales"])
    for name in narrower:
        subprocess.run([sys.executable, "-c", NARROWER_BUILD, name, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       check=True, env=os.environ | {"FUZZYSPEC_INT4_ISA": name})
        out = torch.load(tmp_path / "out.pt")
        # same integer dot products, same float steps after them: equal bit for bit, and batch-invariant there too
        assert torch.equal(out["four"], four(saved["x"])), name
        assert torch.equal(out["eight"], eight(saved["x"])), name
        assert torch.equal(out["alone"], out["four"]), name
        assert torch.equal(out["attention"], attend(*saved["attention"], 0.125)), name
        query, keys, values, mask = saved["attention"]
        assert torch.equal(out["attention16"], attend(query, keys.half(), values.half(), mask, 0.125)), name
        assert torch.equal(out["long"], attend(*saved["long"], 0.125)), name
        assert torch.equal(out["norm"], torch.ops.fuzzyspec_layer.rms_norm(saved["x"], saved["x"][0], 1e-5)), name
        assert torch.equal(out["silu"], torch.ops.fuzzyspec_layer.silu_mul(saved["x"][:, :90])), name


def test_a_build_started_ahead_is_waited_for_not_repeated(monkeypatch, tmp_path):
    """``build_soon`` builds on a thread of its own while a model loads, where nothing is built yet; whoever asks
    ``available`` meanwhile waits for that build's answer instead of starting a second build of the same files."""
    import functools
    import threading
    import time

    builds, started = [], threading.Event()

    @functools.cache
    def slow_build():
        started.set()
        time.sleep(0.3)
        builds.append(threading.current_thread().name)
        return None

    monkeypatch.setattr(kernels, "_build", slow_build)
    monkeypatch.setattr(kernels, "_library", lambda: tmp_path / "not_built.so")
    kernels.build_soon()
    assert started.wait(5)
    assert kernels.available() and builds == ["fuzzyspec-kernels"]  # waited for the thread's build
    kernels.build_soon()  # built already: nothing more starts
    assert kernels.available() and builds == ["fuzzyspec-kernels"]


def test_the_build_thread_leaves_the_import_system_alone(tmp_path):
    """The kernels build while a model loads (``build_soon``). Importing ``torch.utils.cpp_extension`` imports
    setuptools, which edits ``sys.meta_path``: done on that thread, it raced the main thread's imports (a first run
    failed with ModuleNotFoundError for a module that was there). So it is imported before the thread starts."""
    probe = ("import sys, threading\n"
             "from fuzzyspec.core import kernels\n"
             "assert 'setuptools' not in sys.modules\n"
             "seen = []\n"
             "threading.Thread.start = lambda self: seen.append('setuptools' in sys.modules)\n"
             "kernels.build_soon()\n"
             "assert seen == [True], seen\n")
    empty = {**os.environ, "FUZZYSPEC_CACHE": str(tmp_path)}  # (nothing built there: a build starts)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=empty)
    assert done.returncode == 0, done.stderr[-2000:]


def test_kernels_built_already_load_at_once_without_the_build_machinery():
    """Where this machine built the kernels already, ``build_soon`` loads them on the spot: no thread, no
    cpp_extension (its import of setuptools, and ninja's check, took about 150 ms of every run), and the ops run."""
    assert kernels.available()  # (built in this test run's cache, which the probe shares)
    probe = ("import sys, threading, torch\n"
             "from fuzzyspec.core import kernels\n"
             "threading.Thread.start = lambda self: sys.exit('a thread started')\n"
             "kernels.build_soon()\n"
             "assert kernels.loaded() and 'setuptools' not in sys.modules\n"
             "assert 'torch.utils.cpp_extension' not in sys.modules\n"
             "torch.ops.fuzzyspec_layer.keep_columns([torch.zeros(1, 1, 4, 2)], 0, 0, [1])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keep_columns_moves_a_kept_path_as_indexing_does(dtype):
    """A tree's kept path, moved down in one slot of every layer's cache by one call, lands where indexing puts it;
    other slots and positions are untouched; a path it cannot take is refused before anything moves."""
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(3, 2, 40, 8, generator=generator).to(dtype) for _ in range(4)]
    for slot, start, columns in [(1, 5, [0, 2, 3, 7]), (0, 0, [1]), (2, 20, [0, 1, 4, 5, 6, 12])]:
        expected = [cache.clone() for cache in caches]
        source = torch.tensor([start + column for column in columns])
        for cache in expected:
            cache[slot, :, start: start + len(columns)] = cache[slot, :, source]
        torch.ops.fuzzyspec_layer.keep_columns(caches, slot, start, columns)
        for ours, theirs in zip(caches, expected):
            assert torch.equal(ours, theirs)
    before = [cache.clone() for cache in caches]
    for slot, start, columns in [(3, 0, [1]), (0, 35, [0, 5]), (0, 0, [2, 1]), (0, 0, [0, 0])]:
        with pytest.raises(RuntimeError, match="keep_columns"):
            torch.ops.fuzzyspec_layer.keep_columns(caches, slot, start, columns)
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_an_older_torch_is_told_in_one_line_and_nothing_is_built(monkeypatch, tmp_path):
    """ops.cpp is written against torch's stable ABI of 2.10: an older torch gets the reason, and floats serve."""
    monkeypatch.setattr(kernels, "torch_version", lambda: (2, 9))
    monkeypatch.setattr(kernels, "_library", lambda: tmp_path / "never" / "built.so")
    assert kernels._build.__wrapped__() == f"the CPU kernels need torch 2.10 or later (this is {torch.__version__})"
    assert not (tmp_path / "never").exists()


def test_the_ops_take_any_layout_and_dtype_and_refuse_bad_shapes_in_one_line():
    """A product's input in bfloat16 or strided gives what a contiguous float32 one gives (cast back); a packed weight
    that does not fit says what it expected, with no C++ file or line in the message."""
    generator = torch.Generator().manual_seed(5)
    four = Int4Linear.from_codes(torch.randint(0, 16, (32, 64), generator=generator, dtype=torch.int32),
                                 (torch.rand(32, 2, generator=generator) * 0.05 + 0.001).half(),
                                 (torch.randn(32, 2, generator=generator) * 0.05).half())
    x = torch.randn(3, 5, 64, generator=generator)
    packed = four.packed
    expected = torch.ops.fuzzyspec_int4.mm_q4(x.contiguous(), packed)
    assert expected.shape == (3, 5, 32)
    strided = torch.randn(5, 3, 64, generator=generator).transpose(0, 1)
    assert torch.equal(torch.ops.fuzzyspec_int4.mm_q4(strided, packed),
                       torch.ops.fuzzyspec_int4.mm_q4(strided.contiguous(), packed))
    half = x.bfloat16()
    out = torch.ops.fuzzyspec_int4.mm_q4(half, packed)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.ops.fuzzyspec_int4.mm_q4(half.float(), packed).bfloat16())
    with pytest.raises(RuntimeError) as refused:
        torch.ops.fuzzyspec_int4.mm_q4(torch.randn(2, 96), packed)
    assert str(refused.value).splitlines()[0] == "a packed weight [groups, 3, 320] bytes for 96 inputs"


def test_rope_store_reads_q_k_and_v_where_a_fused_projection_left_them():
    """q, k and v split from one product are strided views: read in place, they give what dense copies give."""
    generator = torch.Generator().manual_seed(7)
    rows, width, heads, kv_heads, dim = 2, 3, 4, 2, 8
    fused = torch.randn(rows, width, (heads + 2 * kv_heads) * dim, generator=generator)
    q, k, v = fused.split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
    cos, sin = torch.randn(2, rows, width, 1, dim, generator=generator)
    where = torch.tensor([[1], [0]])
    write = torch.tensor([[4, 5, 6], [0, 1, 2]])
    results = []
    for inputs in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        keys, values = torch.zeros(2, 2, kv_heads, 8, dim).half()
        rotated = torch.ops.fuzzyspec_layer.rope_store(*inputs, cos, sin, keys, values, where, write, heads, kv_heads)
        results.append((rotated, keys, values))
    assert not q.is_contiguous() and results[0][1].abs().sum() > 0
    for strided, dense in zip(*results):
        assert torch.equal(strided, dense)


def test_silu_mul_is_silu_of_the_gate_times_up_each_number_alike():
    """A fused gate|up output's silu(gate) * up: as close to float64's as PyTorch's is, and each number by the same
    operations wherever it lies: a row alone or in a batch, and in a row's last few (narrower than a vector) or
    not."""
    generator = torch.Generator().manual_seed(11)
    gate_up = torch.randn(6, 2 * 24, generator=generator) * 6
    out = torch.ops.fuzzyspec_layer.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, -1)
    exact = torch.nn.functional.silu(gate) * up
    assert out.shape == (6, 24) and ((out.double() - exact).abs() <= 4e-7 * exact.abs() + 1e-30).all()
    assert torch.equal(torch.cat([torch.ops.fuzzyspec_layer.silu_mul(row[None]) for row in gate_up]), out)
    narrow = torch.cat([gate_up[:, :13], gate_up[:, 24:37]], -1)  # 13 each: one vector and 5 more
    assert torch.equal(torch.ops.fuzzyspec_layer.silu_mul(narrow), out[:, :13])
    assert torch.equal(torch.ops.fuzzyspec_layer.silu_mul(gate_up[:, None]), out[:, None])  # any leading shape
    with pytest.raises(RuntimeError) as refused:
        torch.ops.fuzzyspec_layer.silu_mul(torch.randn(2, 7))
    assert str(refused.value).splitlines()[0] == "silu_mul: a float32 gate|up output of even width"
