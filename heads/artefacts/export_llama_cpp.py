"""EAGLE-3 heads to a GGUF draft for llama.cpp's `--spec-type draft-eagle3`, through llama.cpp's
own converter (convert_hf_to_gguf.py), never a GGUF writer of ours.

    export_llama_cpp(HEADS_DIR, OUT, target_dir=HF_DIR, converter=find_converter(SRC))
    -> OUT/heads.gguf   the draft (arch "eagle3": fc, one layer, norm, lm_head, d2t)
       OUT/target.gguf  the target, same outtype (skip with with_target=False)
       OUT/llama_cpp_export.json  what was converted, how, and the llama-server command
       OUT/README.md    the model card (heads/artefacts/model_card.py)

Two steps, each a documented path of its own: `export_heads(HEADS_DIR, "eagle3", TMP)` (the
vLLM/SGLang layout, heads/artefacts/export_eagle3.py), then
    python convert_hf_to_gguf.py TMP --target-model-dir TARGET --outfile heads.gguf --outtype T
The converter takes the draft's tokenizer from TARGET (so TARGET must be a local HF directory:
config.json, a tokenizer, weights) and records the tap layers as `eagle3.target_layers`.

The llama.cpp source is the one vendored in the PyPI sdist LLAMA_CPP_PYTHON (pinned by sha256),
fetched with pip and unpacked once into the specheads cache (`pinned_source`); any other
llama.cpp checkout works if its converter knows EAGLE-3 (`find_converter`).

Tap convention, checked against that source (llama.cpp vendored in llama-cpp-python 0.3.36):
  - conversion/llama.py, LlamaModel.__init__: `target_layers = eagle3_raw_config.get(
    "eagle_aux_hidden_state_layer_ids")` (else [2, L // 2, L - 3]), written with
    `gguf_writer.add_target_layers(target_layers)` unchanged.
  - src/models/llama.cpp, the target's graph: `for (int il = 0; il < n_layer; ++il) {
    res->t_layer_inp[il] = inpL; ...` : id il is the residual stream *entering* layer il.
  - common/speculative.cpp (EAGLE-3 drafter): ids < n_layer read
    `llama_get_embeddings_layer_inp(ctx_tgt, id)`, id == n_layer reads the nextn embeddings.
  So a llama.cpp id is the input of layer id, which is our tap (heads/target/adapter.py: tap i =
  hidden_states[i], the input of decoder layer i) and vLLM's id; the top-level
  `eagle_aux_hidden_state_layer_ids` our eagle3 export writes (heads/artefacts/export_eagle3.py) is
  therefore passed through as is, and `check_draft_gguf` reads it back from the GGUF. (SGLang's
  nested `eagle_config` ids are one lower; the converter does not read them.) A wrong id does
  not fail anywhere, it only lowers acceptance.
  The fused features are concatenated in tap order and go through fc; the draft layer reads
  [input_layernorm(embed); hidden_norm(feature)] with the raw feature as residual
  (norm_before_residual false), as heads/eagle3.py does.

d2t: our d2t holds offsets (target id = draft id + d2t[draft id]); the converter adds
arange(draft vocab) and writes absolute target ids as an I64 tensor "d2t", refusing ids out of
range or repeated. t2d is not read (llama.cpp does not use it).

Targets whose tokenizer the converter does not recognise (its BPE pre-tokenizer hash is not in
get_vocab_base_pre, e.g. a byte-level BPE trained locally) fail there; `pre_tokenizer` names a
llama.cpp pre-tokenizer (e.g. "gpt-2" for HF ByteLevel with its default regex) and runs the same
converter with that one method overridden. It only changes how llama.cpp itself tokenizes text;
token ids sent to llama-server are unaffected.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from specheads.heads import atomic
from specheads.heads.artefacts import model_card
from specheads.heads.artefacts.heads_dir import read_heads_config, resolve_heads_dir
from specheads.heads.artefacts.llama_cpp_serve import DRAFT_NAME, INFO_NAME, TARGET_NAME

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp with EAGLE-3 support
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
SOURCE_ENTRY = "llama.cpp/source-llama-cpp-python-0.3.36"  # under the specheads cache
CONVERTER = "convert_hf_to_gguf.py"
EAGLE3_MARKER = "LlamaForCausalLMEagle3"  # the converter's EAGLE-3 registration
EAGLE3_SOURCES = ("conversion/llama.py", CONVERTER)  # where the marker lives (newer, older layouts)
OUTTYPES = ("f32", "bf16", "f16")
DRAFT_ARCH = "eagle3"
PRE_TOKENIZER_UNKNOWN = "BPE pre-tokenizer was not recognized"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

# Runs convert_hf_to_gguf.py with TextModel.get_vocab_base_pre returning argv[2]. The vendored
# gguf-py goes first on sys.path, as the converter's own first lines would put it.
_PRE_TOKENIZER_WRAPPER = """\
import os, runpy, sys
converter, pre = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.abspath(converter))
sys.path[:0] = [root, os.path.join(root, "gguf-py")]
sys.argv = [converter] + sys.argv[3:]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(converter, run_name="__main__")
"""


class LlamaCppError(ValueError):
    """Bad input for the llama.cpp export or bench; the message is one line saying what would be right."""


def export_llama_cpp(heads_dir: str | os.PathLike, out_dir: str | os.PathLike, *, target_dir: str | os.PathLike,
                     converter: str | os.PathLike, outtype: str = "bf16", pre_tokenizer: str | None = None,
                     with_target: bool = True, log=None) -> Path:
    """Write OUT/heads.gguf (and OUT/target.gguf) from EAGLE-3 heads and their target's HF dir."""
    from specheads.heads.artefacts.export import export_heads, resolve_target

    if outtype not in OUTTYPES:
        raise LlamaCppError(f"outtype must be one of {list(OUTTYPES)}, got {outtype!r}")
    heads_dir = resolve_heads_dir(heads_dir)
    config = read_heads_config(heads_dir)
    if config.kind != "eagle3":
        raise LlamaCppError(f"llama.cpp drafts with EAGLE-3 heads only (--spec-type draft-eagle3), but "
                            f"{str(heads_dir)!r} holds {config.kind} heads; train heads.kind: eagle3")
    if config.num_layers != 1:
        raise LlamaCppError(f"llama.cpp's EAGLE-3 drafter has one decoder layer (src/models/eagle3.cpp asserts "
                            f"n_layer == 1), these heads have {config.num_layers}; train heads.num_layers: 1 "
                            "for llama.cpp (the eagle3 export of these heads loads in vLLM)")
    if len(config.tap_layers) != 3:
        raise LlamaCppError(f"llama.cpp's EAGLE-3 drafter fuses exactly 3 target layers, these heads tap "
                            f"{config.tap_layers}")
    target_dir = check_target_dir(target_dir)
    config.check_fits(resolve_target(target_dir), source=f"heads at {str(heads_dir)!r}")
    converter = Path(converter)
    log = log or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="specheads-eagle3-") as scratch, atomic.staged_dir(out_dir) as tmp:
        eagle3_dir = export_heads(heads_dir, "eagle3", Path(scratch) / "eagle3")
        log(f"converting the heads with {converter} ({outtype})")
        run_converter(converter, eagle3_dir, tmp / DRAFT_NAME, outtype, target_model_dir=target_dir,
                      pre_tokenizer=pre_tokenizer, source=f"the heads at {str(heads_dir)!r}")
        layers = check_draft_gguf(tmp / DRAFT_NAME, config.tap_layers)
        if with_target:
            log(f"converting the target {target_dir} ({outtype})")
            run_converter(converter, target_dir, tmp / TARGET_NAME, outtype, pre_tokenizer=pre_tokenizer)
        info = {"heads_dir": str(Path(heads_dir).resolve()), "target_dir": str(target_dir),
                "converter": str(converter.resolve()), "outtype": outtype, "pre_tokenizer": pre_tokenizer,
                "tap_layers": config.tap_layers, "llama_cpp_target_layers": layers,
                "draft": DRAFT_NAME, "target": TARGET_NAME if with_target else None,
                "serve": f"llama-server -m {TARGET_NAME} -md {DRAFT_NAME} --spec-type draft-eagle3"}
        atomic.write_text(tmp / INFO_NAME, json.dumps(info, indent=2) + "\n")
        model_card.write_card(tmp, config, "llama.cpp", published=out_dir)
    return Path(out_dir)


def check_target_dir(target_dir: str | os.PathLike) -> Path:
    """A local HF directory the converter reads (config.json, a tokenizer, weights), or a one-line error."""
    path = Path(target_dir).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise LlamaCppError(f"llama.cpp's converter reads the target from a local HF directory (config.json, "
                            f"tokenizer, weights), and {str(target_dir)!r} is not one; pass --target DIR "
                            "(a .gguf target or an embedded name is converted to one first)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise LlamaCppError(f"target directory {str(path)!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
                            "the GGUF draft takes its vocabulary from the target")
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise LlamaCppError(f"target directory {str(path)!r} has no weights (*.safetensors or pytorch_model*.bin)")
    return path.resolve()


def run_converter(converter: Path, model_dir: Path, outfile: Path, outtype: str, *,
                  target_model_dir: Path | None = None, pre_tokenizer: str | None = None,
                  source: str | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in a subprocess; its last error line on failure. A draft
    (target_model_dir given) takes its tokenizer from target_model_dir."""
    source = source or repr(str(model_dir))
    args = [str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    if target_model_dir is not None:
        args += ["--target-model-dir", str(target_model_dir)]
    command = [sys.executable, str(converter), *args] if pre_tokenizer is None else \
        [sys.executable, "-c", _PRE_TOKENIZER_WRAPPER, str(converter), pre_tokenizer, *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode == 0 and outfile.is_file():
        return outfile
    if PRE_TOKENIZER_UNKNOWN in result.stdout:
        raise LlamaCppError(f"llama.cpp's converter does not recognise the tokenizer of "
                            f"{str(target_model_dir or model_dir)!r} (its BPE "
                            "pre-tokenizer hash is not in get_vocab_base_pre); pass --pre-tokenizer NAME, e.g. "
                            "gpt-2 for a byte-level BPE with GPT-2's regex")
    if "No module named 'sentencepiece'" in result.stdout:
        raise LlamaCppError("llama.cpp's converter needs sentencepiece: pip install sentencepiece (in a clone of specheads: "
                            "pip install -e '.[llama-cpp]')")
    raise LlamaCppError(f"llama.cpp's converter failed on {str(model_dir)!r} (exit {result.returncode}): "
                        f"{_last_error(result.stdout)}")


def check_draft_gguf(path: Path, tap_layers: list[int]) -> list[int]:
    """The draft GGUF's `eagle3.target_layers`, which must equal our taps (see the tap convention)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch != DRAFT_ARCH:
        raise LlamaCppError(f"{path}: the converter wrote architecture {arch!r}, not {DRAFT_ARCH!r}; it did not "
                            "take these heads for an EAGLE-3 draft")
    field = reader.fields.get(f"{DRAFT_ARCH}.target_layers")
    layers = [int(v) for v in field.contents()] if field is not None else None
    if layers != list(tap_layers):
        raise LlamaCppError(f"{path}: {DRAFT_ARCH}.target_layers={layers}, but the heads tap {tap_layers} "
                            "(llama.cpp id = input of layer id = our tap); the converter read other ids")
    return layers


def find_converter(directory: str | os.PathLike) -> Path:
    """convert_hf_to_gguf.py of a llama.cpp directory (a checkout, its build/bin, or our cache entry),
    checked to know EAGLE-3 drafts."""
    start = Path(directory).expanduser().resolve()
    if not start.is_dir():
        raise LlamaCppError(f"llama.cpp directory {str(directory)!r} does not exist; build one with "
                            "`specheads llama-cpp build` or pass a llama.cpp checkout")
    for root in (start, start.parent, start.parent.parent):
        if (root / CONVERTER).is_file():
            if not any(EAGLE3_MARKER in _read(root / name) for name in EAGLE3_SOURCES):
                raise LlamaCppError(f"the llama.cpp at {str(root)!r} is too old: its {CONVERTER} does not convert "
                                    f"EAGLE-3 drafts ({EAGLE3_MARKER}); use {LLAMA_CPP_PYTHON}'s "
                                    "(`specheads llama-cpp build`) or a newer checkout")
            return root / CONVERTER
    raise LlamaCppError(f"no {CONVERTER} in {str(start)!r} or its parents; pass a llama.cpp checkout (or "
                        "`specheads llama-cpp build`'s directory)")


def pinned_source(cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The llama.cpp source vendored in LLAMA_CPP_PYTHON's sdist, fetched and unpacked once."""

    final = Path(cache_dir) / SOURCE_ENTRY
    return atomic.build_once(final, lambda staging: _fetch_source_into(staging, progress))


def _fetch_source_into(directory: Path, progress: bool) -> None:
    from specheads.heads.target.gguf import _pip_reason, _say, _sha256

    download = Path(tempfile.mkdtemp(prefix="specheads-sdist-"))
    try:
        _say(progress, f"llama.cpp: downloading the {LLAMA_CPP_PYTHON} sdist (77 MB, once) with pip")
        start = time.perf_counter()
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "--retries", "1", "--timeout", "30", "--dest", str(download),
                   LLAMA_CPP_PYTHON]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sdist = download / SDIST
        if result.returncode != 0 or not sdist.is_file():
            raise LlamaCppError(f"could not download {LLAMA_CPP_PYTHON} ({_pip_reason(result.stdout)}); pass a "
                                "llama.cpp checkout instead")
        if _sha256(sdist) != SDIST_SHA256:
            raise LlamaCppError(f"{SDIST} does not have the pinned sha256 {SDIST_SHA256}; nothing was kept")
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(SDIST_VENDOR)]
            for member in members:
                member.name = member.name[len(SDIST_VENDOR):]
            archive.extractall(directory, members=[m for m in members if m.name], filter="data")
        _say(progress, f"llama.cpp: unpacked its source in {time.perf_counter() - start:.0f}s")
    finally:
        shutil.rmtree(download, ignore_errors=True)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:400]
