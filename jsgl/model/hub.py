"""Models named by their Hugging Face Hub id, ``org/name[@revision]``: the config, tokenizer and safetensors are
fetched by huggingface_hub into its usual cache (with its progress bars), or found there when offline
(``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from jsgl.errors import ModelNotFoundError

# What jsgl reads from an HF model folder: no PyTorch .bin, no GGUF, no ONNX or other exports.
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``org/name`` or ``org/name@revision`` (a local path by that name wins)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


@functools.lru_cache(maxsize=64)  # one resolution a process: the loader, tokenizer and memory plan each ask
def resolve_hub_model(name: str, config_only: bool = False) -> Path:
    """The snapshot folder of Hub model ``name`` (``org/name[@revision]``), downloaded into the Hugging Face cache
    if it is not there; offline, the cached one or a ModelNotFoundError (a FileNotFoundError) that says what to
    download. ``config_only``: its config.json alone (a memory plan reads nothing else)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, _, revision = name.partition("@")
    patterns = ["config.json"] if config_only else HUB_PATTERNS
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns))
    except GatedRepoError as exc:
        raise ModelNotFoundError(f"{repo_id} is gated on the Hub: accept its terms on huggingface.co and log in "
                                 "(`hf auth login`, or HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r} on the Hub") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"unknown model {name!r}: not a local path, and no Hub repository {repo_id} "
                                 "(or it is private: log in with `hf auth login`, or set HF_TOKEN)") from exc
    except LocalEntryNotFoundError as exc:
        include = " ".join(f"--include '{p}'" for p in patterns)
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached") + \
            f" and {name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
        fix = "Unset HF_HUB_OFFLINE to fetch it, or download it" if constants.HF_HUB_OFFLINE else "Download it"
        raise ModelNotFoundError(f"{why}. {fix} where the Hub is reachable: "
                                 f"`hf download {repo_id}{f' --revision {revision}' if revision else ''} {include}` "
                                 "(into the same cache, or copy the cache folder over), or pass a local "
                                 "folder") from exc
