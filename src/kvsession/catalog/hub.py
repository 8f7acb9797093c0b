"""Models from the Hugging Face Hub, downloaded once into the Hub's own cache.

A reference names a GGUF file in a Hub repository, as llama.cpp's -hf does:

    hf:OWNER/REPO/FILE.gguf   that file (FILE may sit in folders)
    hf:OWNER/REPO:QUANT       the repository's one GGUF file whose name ends in QUANT (Q4_K_M, q8_0, ...)
    OWNER/REPO:QUANT          the same, when no such path exists here
    hf:OWNER/REPO             QUANT = Q4_K_M, llama.cpp's default

Files go through huggingface_hub (hf_hub_download) into its cache
(HF_HUB_CACHE, by default ~/.cache/huggingface/hub), shared with every other
tool that uses it. The cache is read first, without a request: a model
downloaded once starts with no network at all, and a machine with none
never waits on it. HF_HUB_OFFLINE=1 reads only the cache. Before a request
the Hub's host is tried once (a few seconds at most): where it does not
resolve or refuses the connection, the error comes at once instead of
after huggingface_hub's ~20 s of retries (not behind a proxy, which
huggingface_hub goes through and a direct connection would not). Either
way the error is one line saying the file is not in the cache and why it
could not be fetched.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import InvalidArgument, ModelNotFound

PREFIX = "hf:"
PROBE_SECONDS = 5.0  # how long the one connection to the Hub's host may take before a request
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
DEFAULT_QUANT = "Q4_K_M"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_QUANT = re.compile(rf"^({_NAME}/{_NAME})(?::({_NAME}))?$")
_REPO_FILE = re.compile(rf"^({_NAME}/{_NAME})/(.+)$")


@dataclass(frozen=True)
class Reference:
    repo: str  # OWNER/REPO
    filename: str | None  # a path inside the repository, or None: chosen by quant
    quant: str = DEFAULT_QUANT

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}/{self.filename}" if self.filename else f"{PREFIX}{self.repo}:{self.quant}"


@dataclass(frozen=True)
class CachedFile:
    """A GGUF file found in the Hub cache."""

    repo: str
    filename: str
    path: Path
    size: int
    revision: str  # commit hash
    refs: tuple[str, ...]  # branch or tag names pointing at that commit

    @property
    def reference(self) -> str:
        return f"{PREFIX}{self.repo}/{self.filename}"


def is_reference(name: str) -> bool:
    """hf:..., or OWNER/REPO:QUANT naming no file here (a path always wins: it is what the user has)."""
    return name.startswith(PREFIX) or (":" in name and bool(_REPO_QUANT.match(name)) and not Path(name).exists())


def parse(name: str) -> Reference:
    rest = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if m := _REPO_QUANT.match(rest):
        return Reference(m.group(1), None, m.group(2) or DEFAULT_QUANT)
    m = _REPO_FILE.match(rest)
    if m is None:
        raise InvalidArgument(f"{name}: not a Hub reference; write hf:OWNER/REPO/FILE.gguf or hf:OWNER/REPO:QUANT")
    if ".." in m.group(2).split("/"):
        raise InvalidArgument(f"{name}: a file name in a repository cannot hold '..'")
    if not m.group(2).lower().endswith(".gguf"):
        raise InvalidArgument(f"{name}: {m.group(2)} is not a .gguf file")
    return Reference(m.group(1), m.group(2))


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """The local path of a referenced file, downloaded into the Hub cache first if it is not there."""
    ref = parse(name)
    filename = ref.filename or _pick_quant(ref, cache_dir)
    return _download(ref, filename, cache_dir)


def _download(ref: Reference, filename: str, cache_dir) -> Path:
    from huggingface_hub import hf_hub_download, is_offline_mode
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    where = f"{PREFIX}{ref.repo}/{filename}"
    try:
        return Path(hf_hub_download(ref.repo, filename, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        if is_offline_mode():
            raise ModelNotFound(f"{where}: not in the Hub cache ({_cache(cache_dir)}) and HF_HUB_OFFLINE is set; "
                                "unset it to download the file") from None
    unreachable = ("the Hub cannot be reached{}; connect to the internet, or point HF_HUB_CACHE at a cache that "
                   "has it")
    why = _unreachable()
    if why:
        raise ModelNotFound(f"{where}: not in the Hub cache ({_cache(cache_dir)}) and "
                            + unreachable.format(f" ({why})"))
    try:
        return Path(hf_hub_download(ref.repo, filename, cache_dir=cache_dir))
    except LocalEntryNotFoundError:  # what huggingface_hub raises when the Hub cannot be reached
        raise ModelNotFound(f"{where}: not in the Hub cache ({_cache(cache_dir)}) and "
                            + unreachable.format("")) from None
    except GatedRepoError:
        raise ModelNotFound(f"{where}: {ref.repo} is gated; accept its terms on the Hub, then log in "
                            "(`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{where}: no repository {ref.repo} on the Hub (or it is private: log in with "
                            "`hf auth login`)") from None
    except EntryNotFoundError:
        raise ModelNotFound(f"{where}: no file {filename} in {ref.repo}") from None
    except HfHubHTTPError as e:
        raise ModelNotFound(f"{where}: the Hub answered {str(e).splitlines()[0]}") from None


def _pick_quant(ref: Reference, cache_dir) -> str:
    """The one single-file GGUF whose name ends in the quant: from the cached snapshot of main when it has
    one (no request), else from the Hub's file list."""
    import httpx2  # huggingface_hub's HTTP client: a network failure arrives as its TransportError
    from huggingface_hub import HfApi, is_offline_mode
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    cached = _cached_names(ref.repo, cache_dir)
    match = _matching(cached, ref.quant)
    if len(match) == 1 or is_offline_mode():
        if not cached:
            raise ModelNotFound(f"{ref}: {ref.repo} is not in the Hub cache ({_cache(cache_dir)}) and HF_HUB_OFFLINE "
                                "is set; unset it to download the file")
        return _one(ref, match, cached, f"in the Hub cache ({_cache(cache_dir)}; HF_HUB_OFFLINE is set)")
    why = _unreachable()
    if why:
        raise ModelNotFound(f"{ref}: not in the Hub cache ({_cache(cache_dir)}) and the Hub cannot be reached "
                            f"({why}); connect to the internet, or name a cached file")
    try:
        names = HfApi().list_repo_files(ref.repo)
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{ref}: no repository {ref.repo} on the Hub (or it is private: log in with "
                            "`hf auth login`)") from None
    except (HfHubHTTPError, OSError, httpx2.TransportError) as e:
        raise ModelNotFound(f"{ref}: not in the Hub cache ({_cache(cache_dir)}) and the Hub cannot be reached "
                            f"({e}); connect to the internet, or name a cached file") from None
    return _one(ref, _matching(names, ref.quant), names, "on the Hub")


def _unreachable() -> str | None:
    """Why the Hub's host (HF_ENDPOINT's) takes no connection at all -- it does not resolve, refuses, or does not
    answer within PROBE_SECONDS -- or None: it does, or a proxy stands between."""
    from huggingface_hub import constants

    if any(os.environ.get(v) for v in PROXIES):
        return None
    url = urlsplit(constants.ENDPOINT)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or e}"
    return None


def _one(ref: Reference, match: list[str], names: list[str], where: str) -> str:
    if len(match) == 1:
        return match[0]
    if match:
        raise ModelNotFound(f"{ref}: {len(match)} files match {ref.quant} ({', '.join(match)}); "
                            f"name one: hf:{ref.repo}/FILE.gguf")
    quants = sorted({_quant_of(n) for n in names if n.lower().endswith(".gguf")} - {""})
    raise ModelNotFound(f"{ref}: no single-file GGUF ending in {ref.quant} {where}"
                        + (f"; quants there: {', '.join(quants)}" if quants else ""))


def _matching(names: list[str], quant: str) -> list[str]:
    tail = re.compile(rf"(^|[-._]){re.escape(quant)}$", re.IGNORECASE)
    return sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower()
                  and tail.search(Path(n).stem))


def _quant_of(name: str) -> str:
    m = re.search(r"[-._]((?:I?Q\d\w*)|F16|BF16|F32)$", Path(name).stem, re.IGNORECASE)
    return m.group(1) if m else ""


def _cache(cache_dir) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE)


def _cached_names(repo: str, cache_dir) -> list[str]:
    """Files of the cached snapshot that refs/main names, as paths inside the repository."""
    folder = _cache(cache_dir) / ("models--" + repo.replace("/", "--"))
    try:
        snapshot = folder / "snapshots" / (folder / "refs" / "main").read_text().strip()
    except OSError:
        return []
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def cached_gguf(cache_dir: str | Path | None = None) -> list[CachedFile]:
    """Every GGUF file in the Hub cache (every cached revision of every model repository)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            for f in rev.files:
                if f.file_name.lower().endswith(".gguf"):
                    out.append(CachedFile(repo.repo_id, str(f.file_path.relative_to(rev.snapshot_path)),
                                          f.file_path, f.size_on_disk, rev.commit_hash, tuple(sorted(rev.refs))))
    return sorted(out, key=lambda c: (c.repo.lower(), c.filename, c.revision))
