"""Hugging Face Hub ids to local directories, for heads and targets alike.

A name that exists as a local path is that path (a local path wins over a Hub id). A Hub repo
id (`org/name`) is fetched with huggingface_hub's snapshot_download, only the files asked for,
which answers from the Hub cache first (HF_HOME / HF_HUB_CACHE) and asks the Hub nothing under
HF_HUB_OFFLINE=1. Every way that fails is one line (FileNotFoundError) naming the id, what was
tried and what would work: no local directory, not a Hub id, not in the cache while offline,
no network, no such repo (or a gated / private one), another Hub error.
"""

from __future__ import annotations

import os
from pathlib import Path

from specheads.heads.target.adapter import _looks_like_hub_id

# A target as llama.cpp's converter reads it: its config, tokenizer and weights
TARGET_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt")


def is_hub_id(name_or_path: str | os.PathLike) -> bool:
    """An `org/name` that is not a local path."""
    return _looks_like_hub_id(str(name_or_path)) and not Path(name_or_path).expanduser().exists()


def hub_snapshot(name_or_path: str | os.PathLike, files: tuple[str, ...], what: str) -> Path:
    """Where `name_or_path` is on disk (module doc): the local path, or the Hub snapshot holding
    `files` (file names or glob patterns). `what` ("heads", "target") starts the error line."""
    path = Path(name_or_path).expanduser()
    name = str(name_or_path)
    if path.exists() or not _looks_like_hub_id(name):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    tried = f"{what} {name!r}: no local directory of that name, and"
    try:
        return Path(snapshot_download(name, allow_patterns=list(files), library_name="specheads"))
    except HFValidationError as err:
        raise FileNotFoundError(f"{tried} it is not a Hub repo id either ({_first_line(err)})") from None
    except LocalEntryNotFoundError:
        if constants.is_offline_mode():
            raise FileNotFoundError(f"{tried} the Hub cache ({constants.HF_HUB_CACHE}) has no snapshot of the Hub repo "
                                    f"{name!r}; offline (HF_HUB_OFFLINE is set), so the Hub was not asked: download "
                                    f"it once with network access (`hf download {name}`) or pass a local "
                                    "directory") from None
        raise FileNotFoundError(f"{tried} the Hub repo {name!r} is neither in the Hub cache "
                                f"({constants.HF_HUB_CACHE}) nor reachable (no network?)") from None
    except GatedRepoError:
        raise FileNotFoundError(f"{tried} the Hub repo {name!r} is gated: log in (`hf auth login`) with an account "
                                "that has access") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise FileNotFoundError(f"{tried} the Hub has no model repo {name!r} that this account can read (a private "
                                "or gated repo needs `hf auth login`)") from None
    except HfHubHTTPError as err:
        raise FileNotFoundError(f"{tried} fetching the Hub repo {name!r} failed: {_first_line(err)}") from None


def check_hub_target(name_or_path: str) -> None:
    """A target named by Hub id must have its config.json in the Hub cache or on the Hub: checked
    (and that one small file fetched) before anything loads, so that a mistyped or unreachable
    id fails in one line within seconds, not in transformers' traceback. Local paths pass."""
    if is_hub_id(name_or_path):
        hub_snapshot(name_or_path, ("config.json",), "target")


def local_target_dir(name_or_path: str | os.PathLike) -> Path:
    """A target as a local directory with its config, tokenizer and weights (TARGET_FILES): the
    path itself, or the Hub id's snapshot (downloaded into the Hub cache when online)."""
    return hub_snapshot(name_or_path, TARGET_FILES, "target")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
