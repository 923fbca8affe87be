"""Access to the Hugging Face Hub: is it reachable, files through its cache, model snapshots.

Everything NCTV fetches from the Hub goes through the client's cache: a file downloaded once is read
from there afterwards, with no update check, so results stay reproducible. When the Hub cannot be
reached (no network, or ``HF_HUB_OFFLINE=1``) a probe says so at once, instead of after the client's
retries, and the errors say what is cached and what to do.

A model on the Hub is in timm's layout: ``config.json`` and ``model.safetensors``, with an optional
``README.md`` card. A repository without safetensors may hold ``pytorch_model.bin`` instead (many
community checkpoints do); it is fetched only when there is no ``model.safetensors``, under the same
weight cap, and ``nctv.zoo`` reads it with ``torch.load(weights_only=True)``: any other pickle is
refused. :func:`model_folder` gives the local snapshot folder holding the config and the weights;
:class:`HubOfflineError` says that a needed file is neither cached nor downloadable, so that the
caller can add what works offline. This module sits below ``nctv.data`` and ``nctv.zoo`` and imports
neither.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from nctv import forkgate

__all__ = [
    "WEIGHTS_NAME", "PICKLE_WEIGHTS_NAME", "WEIGHT_FILES", "CONFIG_NAME", "CARD_NAME", "HubOfflineError",
    "hub_reachable", "hub_file", "hub_errors",
    "check_weight_size", "snapshot_folder", "model_folder", "model_card", "DEFAULT_MAX_MODEL_MB", "max_model_bytes",
]

WEIGHTS_NAME = "model.safetensors"
#: The one pickle checkpoint read, only where a repository or folder has no safetensors.
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
#: The weight files a model may have, in the order they are preferred.
WEIGHT_FILES = (WEIGHTS_NAME, PICKLE_WEIGHTS_NAME)
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"

_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


#: Largest Hub model weights, in MB (10⁶ bytes), loaded when someone else picks the model: a visitor
#: of the app, or the config of a calibrator given to ``nctv apply``.
DEFAULT_MAX_MODEL_MB = 500


def max_model_bytes() -> int:
    """The largest Hub model weights loaded for another's choice: ``$NCTV_MAX_MODEL_MB`` megabytes."""
    from nctv.checks import env_number  # torch comes with it; the rest of this module needs none

    return int(env_number("NCTV_MAX_MODEL_MB", DEFAULT_MAX_MODEL_MB, 0) * 1e6)


class HubOfflineError(ValueError):
    """A model file is not in the Hugging Face cache and the Hub cannot be reached."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's endpoint accepts a TCP connection within ``timeout`` seconds.

    False at once with HF_HUB_OFFLINE=1. Behind a proxy (a ``*_PROXY`` variable is set) a direct
    connection says nothing, so the answer is True and the download itself decides. Without this
    probe an unreachable Hub costs half a minute of retries before the offline message.
    """
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    url = urlparse(constants.ENDPOINT)
    if not url.hostname:
        return True
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout):
            return True
    except OSError:
        return False


def hub_file(download: Callable[..., str], what: str) -> str:
    """Run a Hub download, turning 'no network' into an error that says what to do.

    ``download(offline)`` gets ``offline=True`` when the Hub cannot be reached, so that a cached file
    is used at once instead of after the client's retries.
    """
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        with forkgate.paused():  # network, not computing: a ZeroGPU server's fork need not wait for it
            return download(not hub_reachable())
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{what} is not in the local Hugging Face cache and the Hub cannot be reached "
            "(no network, or HF_HUB_OFFLINE=1). Connect once to download it; it is cached afterwards."
        ) from None


# ----------------------------------------------------------------------------- models

def _cached_hub_models() -> list[str]:
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:  # no cache folder yet, or unreadable: nothing is cached
        return []
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model")


def _offline_error(repo: str, missing: str) -> HubOfflineError:
    from huggingface_hub import constants

    cached = _cached_hub_models()
    return HubOfflineError(
        f"Model 'hf-hub:{repo}' needs the network: {missing} is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and the Hub cannot be reached (no connection, or HF_HUB_OFFLINE=1). "
        f"Cached Hub models: {', '.join(cached) if cached else 'none'}."
    )


@contextmanager
def hub_errors(what: str, repo: str, revision: str | None, filename: str, missing: str,
               offline_error: Callable[[str], Exception]) -> Iterator[None]:
    """Hub client errors about ``filename`` while loading ``what`` ("Model", "Calibrator") from
    ``repo`` as messages that say what to do; other errors pass unchanged. ``missing``: what the
    repository lacking ``filename`` means for ``what``; ``offline_error(filename)``: the error when
    the file is not cached and could not be downloaded."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        yield
        return
    # Most specific first: a gated repository is also "not found", a missing local file also a missing entry.
    except LocalEntryNotFoundError:
        raise offline_error(filename) from None
    except GatedRepoError:
        why = "is gated: accept its terms on the Hub and log in (HF_TOKEN)"
    except RepositoryNotFoundError:
        why = "does not exist on the Hub (or is private: log in with HF_TOKEN)"
    except RevisionNotFoundError:
        why = f"has no revision '{revision}'"
    except EntryNotFoundError:
        why = missing
    raise ValueError(f"{what} 'hf-hub:{repo}' {why}.")


def _model_errors(repo: str, revision: str | None, filename: str):
    """:func:`hub_errors` of a Hub model."""
    missing = (f"has no {filename}: NCTV reads weights from {WEIGHTS_NAME}, or from {PICKLE_WEIGHTS_NAME} where "
               "there are no safetensors" if filename in WEIGHT_FILES else f"has no {filename}: it is not a timm model")
    return hub_errors("Model", repo, revision, filename, missing, lambda name: _offline_error(repo, name))


def check_weight_size(what: str, size: int | None, limit: int | None) -> None:
    """Refuse a model whose ``size`` bytes of weights exceed ``limit`` (None: no limit); an unknown
    size is refused too when there is a limit."""
    if limit is None:
        return
    cap = f"this server loads Hub models with at most {limit / 1e6:,.1f} MB of weights"
    if size is None:
        raise ValueError(f"{what}: the Hub did not say how large its weights are, and {cap}.")
    if size > limit:
        raise ValueError(f"{what} has {size / 1e6:,.1f} MB of weights; {cap}. Pick a smaller model.")


def _weights_on_hub(repo: str, revision: str | None, token: str | None) -> tuple[str, int | None]:
    """(file name, bytes) of the model's weights on the Hub, from its metadata (nothing is downloaded):
    ``model.safetensors``, else ``pytorch_model.bin``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError

    for filename in WEIGHT_FILES:
        with _model_errors(repo, revision, filename):
            try:
                url = hf_hub_url(repo, filename, revision=revision)
                return filename, get_hf_file_metadata(url, token=token, library_name="nctv").size
            except RemoteEntryNotFoundError:
                continue  # this file is not there: the next one may be
    raise ValueError(f"Model 'hf-hub:{repo}' has neither {WEIGHTS_NAME} nor {PICKLE_WEIGHTS_NAME}: "
                     "it holds no weights NCTV can read.")


def _weights_to_use(repo: str, revision: str | None, token: str | None) -> tuple[str, int | None]:
    """(file name, bytes or None) of the weights to load: the cached snapshot's own, safetensors first
    (it is used as it is, as every cached file is); else asked of the Hub when it can be reached.
    Offline with no weights cached: ``model.safetensors``, which the offline error then names."""
    from huggingface_hub import try_to_load_from_cache

    for filename in WEIGHT_FILES:
        cached = try_to_load_from_cache(repo, filename, revision=revision)
        if isinstance(cached, str):
            return filename, Path(cached).stat().st_size
    if not hub_reachable():
        return WEIGHTS_NAME, None
    return _weights_on_hub(repo, revision, token)


def snapshot_folder(repo: str, files: tuple[str, ...], revision: str | None = None, token: str | None = None, *,
                    errors: Callable[[str], Any], offline_error: Callable[[str], Exception],
                    check: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """The local snapshot folder of Hub repository ``repo`` holding all of ``files``: from the cache
    when every file is there, else downloaded together (so that they come from one snapshot).

    ``offline_error(missing)`` is raised when a file is not cached and the Hub cannot be reached;
    ``errors(filename)`` is a context manager turning the client's errors into messages; ``check``
    sees what is cached (a path, or not a string) before anything is downloaded.
    """
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = {f: try_to_load_from_cache(repo, f, revision=revision) for f in files}
    complete = all(isinstance(p, str) for p in cached.values())
    if not complete and not hub_reachable():
        raise offline_error(next(f for f in files if not isinstance(cached[f], str)))
    if check is not None:
        check(cached)
    if complete:
        return Path(cached[files[0]]).parent
    paths = []
    for filename in files:
        with errors(filename), forkgate.paused():  # network, not computing (see hub_file)
            paths.append(Path(hf_hub_download(repo, filename, revision=revision, token=token, library_name="nctv")))
    if len({p.parent for p in paths}) > 1:
        raise ValueError(f"hf-hub:{repo}: {' and '.join(files)} come from different snapshots; clear it from "
                         "the Hugging Face cache and load it again.")
    return paths[0].parent


def model_folder(repo: str, revision: str | None = None, token: str | None = None,
                 max_weight_bytes: int | None = None) -> Path:
    """Snapshot folder of Hub model ``repo`` holding config.json and its weights, model.safetensors or,
    where the repository has none, pytorch_model.bin (downloads once, after checking that the weights
    are at most ``max_weight_bytes``: their size comes from the cached file or the Hub's metadata).

    Raises :class:`HubOfflineError` when a file is not cached and the Hub cannot be reached.
    """
    weights, size = _weights_to_use(repo, revision, token)

    def check(cached: dict[str, Any]) -> None:
        if max_weight_bytes is not None:
            check_weight_size(f"hf-hub:{repo}", size, max_weight_bytes)

    return snapshot_folder(repo, (CONFIG_NAME, weights), revision, token, check=check,
                           errors=lambda filename: _model_errors(repo, revision, filename),
                           offline_error=lambda missing: _offline_error(repo, missing))


def model_card(repo: str, revision: str | None = None, token: str | None = None) -> Path | None:
    """The Hub model card if cached, else fetched when online; a card is never required."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo, CARD_NAME, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if not hub_reachable():  # also False with HF_HUB_OFFLINE=1
        return None
    try:
        return Path(hf_hub_download(repo, CARD_NAME, revision=revision, token=token,
                                    library_name="nctv", etag_timeout=5))
    except Exception:  # a missing or unreachable card only costs the card text
        return None
