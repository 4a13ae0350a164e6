"""Where a model's files are: a local folder, or a Hugging Face Hub id (`Qwen/Qwen3-0.6B`,
optionally at a `revision`) found through `huggingface_hub`'s own cache, so a model that
vLLM or transformers already downloaded is used where it lies. The cache location,
`HF_HUB_OFFLINE` and the access token come from the environment as the user set them.

Serving never downloads by surprise on a machine that cannot: a model missing from the
cache with no network is an error that says how to fetch it (`cluster download MODEL`
where there is network, then copy the cache).
"""

from __future__ import annotations

import os
import re

# What serving needs from a repository (no other weight formats, no images or notebooks).
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    """Whether `name` is a Hub id rather than a local folder (which wins if both)."""
    return not os.path.isdir(name) and bool(_REPO_ID.match(name)) and ".." not in name


def resolve_model_path(
    name: str, revision: str | None = None, download: bool = False, cached_only: bool = False
) -> str:
    """The local folder holding `name`'s files. A folder is returned as it is; a Hub id is
    looked up in the Hugging Face cache (and fetched when `download`, or when the
    environment allows it, the cache lacks it and not `cached_only`); anything else is
    returned as it is. Raises ValueError naming what is wrong."""
    if os.path.isdir(name):
        in_cache = os.path.basename(os.path.dirname(os.path.normpath(name))) == "snapshots"
        if revision is not None and not (in_cache and os.path.basename(name) == revision):
            raise ValueError(
                f"revision={revision!r} applies to Hugging Face ids; {name!r} is a local folder"
            )
        return name
    if not is_hub_id(name):  # a path that is not here: the caller's checks name it
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face ids, not {name!r}")
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(
            name,
            revision=revision,
            allow_patterns=list(DOWNLOAD_PATTERNS),
            local_files_only=not download and (cached_only or _offline()),
        )
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"model {name!r}{f' at revision {revision!r}' if revision else ''} is not in the "
            f"Hugging Face cache and cannot be downloaded here ({type(e).__name__}); run "
            f"`cluster download {name}` where there is network, or give a local folder"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model {name!r}: {e}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
