"""HuggingFace Hub snapshots, downloaded with huggingface_hub into a local directory.

`download` is blocking and runs in a worker thread. huggingface_hub keeps per-file metadata
under `<local_dir>/.cache/huggingface/`, so a pull interrupted and started again skips every file
it already completed (huggingface_hub 2.x resumes per file: a half-downloaded file is started
over). Cancellation rides on the progress bar that snapshot_download updates for every chunk
(10 MB): our bar class raises when the pull is cancelled, which unwinds the download. Progress
is measured from the bytes on disk (`bytes_on_disk`), temporary files included.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from solar_host.model_store.pull import LowSpeedGuard, PullError

log = logging.getLogger(__name__)


class PullCancelled(Exception):
    """Raised inside a download thread when its pull was cancelled or aborted."""


# huggingface_hub asks for the repo info and the file tree with no timeout at all (file
# downloads have their own): every request of its shared client gets these where it has none.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# The file listing comes in pages of up to 1,000 entries, each linking to the next: a Hub that
# always links to another page would hold the pull (and a worker thread) for ever. A million
# files is far beyond any model repository.
MAX_LISTING_PAGES = 1000
# The Hub's API answers (repository info, file listing pages) are read whole into memory:
# one past this is refused. File downloads are not API answers, and are not capped.
MAX_METADATA_BYTES = 64 << 20
# A file body that keeps arriving at under MIN_RATE_BPS over RATE_WINDOW_S fails the pull: the
# read timeout only catches silence, and huggingface_hub retries a timed-out body without end
# as long as each try brought a byte (a peer trickling bytes would hold the pull for days).
MIN_RATE_BPS = 1024.0
RATE_WINDOW_S = 60.0
_pull_state = threading.local()  # the cancel event of the pull this thread runs
_client_lock = threading.Lock()
_client_installed = False


def _guard_request(request: Any) -> None:
    """httpx request hook: stop a cancelled pull at its next request; bound every request."""
    cancel = getattr(_pull_state, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise PullCancelled("pull cancelled")
    if "/tree/" in request.url.path and cancel is not None:
        pages = getattr(_pull_state, "listing_pages", 0) + 1
        _pull_state.listing_pages = pages
        if pages > MAX_LISTING_PAGES:
            raise PullError(
                502,
                "model_pull_failed",
                f"The Hub's file listing of this repository ran past {MAX_LISTING_PAGES} pages "
                f"({MAX_LISTING_PAGES * 1000} files); refusing to list further",
            )
    timeout = dict(request.extensions.get("timeout") or {})
    for key, default in (
        ("connect", CONNECT_TIMEOUT_S),
        ("read", READ_TIMEOUT_S),
        ("write", READ_TIMEOUT_S),
        ("pool", READ_TIMEOUT_S),
    ):
        if timeout.get(key) is None:
            timeout[key] = default
    request.extensions["timeout"] = timeout


def _bound_response(response: Any) -> None:
    """httpx response hook: an API answer is refused past MAX_METADATA_BYTES, by its declared
    length or, for one without, as its bytes arrive; any body that trickles in under
    MIN_RATE_BPS fails."""
    guard = LowSpeedGuard(
        f"The Hub's answer for {response.request.url.path}", MIN_RATE_BPS, RATE_WINDOW_S
    )
    if not response.request.url.path.startswith("/api/"):
        response.stream = _capped_stream(response.stream, response, None, guard)
        return
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_METADATA_BYTES:
        raise _too_big(response)
    response.stream = _capped_stream(response.stream, response, MAX_METADATA_BYTES, guard)


def _capped_stream(inner: Any, response: Any, limit: int | None, guard: LowSpeedGuard) -> Any:
    # The response checks its stream against its own httpx's SyncByteStream (huggingface_hub
    # may bring a fork of httpx under another name): take that class from the stream itself.
    base = next((k for k in type(inner).__mro__ if k.__name__ == "SyncByteStream"), type(inner))

    class Capped(base):  # type: ignore[misc,valid-type]
        def __iter__(self) -> Any:
            size = 0
            for chunk in inner:
                size += len(chunk)
                if limit is not None and size > limit:
                    raise _too_big(response)
                guard.feed(len(chunk))
                yield chunk

        def close(self) -> None:
            inner.close()

    return Capped()


def _too_big(response: Any) -> PullError:
    return PullError(
        502,
        "model_pull_failed",
        f"The Hub sent an answer over {MAX_METADATA_BYTES >> 20} MiB for "
        f"{response.request.url.path}; refusing to read it",
    )


def _install_client() -> None:
    global _client_installed
    with _client_lock:
        if _client_installed:
            return
        _client_installed = True
        try:  # huggingface_hub 1.0 and later (httpx); the requests-based 0.x has neither
            from huggingface_hub import set_client_factory
            from huggingface_hub.utils import _http
        except ImportError:
            log.warning(
                "huggingface_hub %s has no client factory: a Hub that stops answering its "
                "metadata requests can hold a pull until it is cancelled (upgrade to 1.0+)",
                getattr(sys.modules.get("huggingface_hub"), "__version__", "?"),
            )
            return

        def factory() -> Any:
            client = _http.default_client_factory()
            hooks = client.event_hooks
            hooks["request"] = [*hooks.get("request", []), _guard_request]
            hooks["response"] = [*hooks.get("response", []), _bound_response]
            client.event_hooks = hooks
            return client

        set_client_factory(factory)


def bytes_on_disk(local_dir: Path) -> int:
    """Bytes of regular files under `local_dir` (in-progress temporary files included)."""
    total = 0
    meta = os.path.join(str(local_dir), ".cache")
    for dirpath, _dirs, files in os.walk(local_dir):
        in_meta = dirpath == meta or dirpath.startswith(meta + os.sep)
        for fn in files:
            if in_meta and not fn.endswith(".incomplete"):
                continue  # huggingface_hub's bookkeeping, not model bytes
            try:
                st = os.lstat(os.path.join(dirpath, fn))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


# The name snapshot_download (huggingface_hub 1.x, 2.x) gives the bar of the bytes written.
# huggingface_hub checks a file's size against the announced one only once its body ended, so
# a body that never ends would fill the disk down to MIN_FREE_DISK_GB first.
BYTES_BAR = "huggingface_hub.snapshot_download"


def _bar_class(cancel: threading.Event) -> type:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class CountingBar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            # The bytes bar: every file adds its announced size to `total` before its body
            # is read, so more bytes than `total` is a body longer than announced.
            self._bytes_bar = kwargs.get("name") == BYTES_BAR
            self._received = 0.0
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel.is_set():
                raise PullCancelled("pull cancelled")
            self._received += n or 0
            total = getattr(self, "total", None)
            if self._bytes_bar and total is not None and self._received > total:
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"The Hub sent more than the {int(total)} bytes it announced for the "
                    "files; refusing to store the rest",
                )
            return None

    return CountingBar


def download(
    model_id: str,
    local_dir: Path,
    *,
    token: str | None,
    endpoint: str | None,
    allow_patterns: list[str] | None,
    cancel: threading.Event,
) -> None:
    from huggingface_hub import snapshot_download

    local_dir.mkdir(parents=True, exist_ok=True)
    _install_client()
    _pull_state.cancel = cancel
    _pull_state.listing_pages = 0
    try:
        snapshot_download(
            repo_id=model_id,
            local_dir=str(local_dir),
            token=token or None,
            endpoint=endpoint or None,
            allow_patterns=allow_patterns or None,
            tqdm_class=_bar_class(cancel),
            max_workers=4,
        )
    except (PullCancelled, PullError):
        raise
    except Exception as err:
        if cancel.is_set():
            raise PullCancelled("pull cancelled") from err
        raise map_error(err) from err
    finally:
        _pull_state.cancel = None


def map_error(err: BaseException) -> PullError:
    """huggingface_hub's errors as the contract's statuses."""
    from huggingface_hub import errors as hf

    if isinstance(err, PullError):
        return err
    if isinstance(err, hf.GatedRepoError):
        return PullError(401, "auth_failed", f"Access to the repository is restricted: {err}")
    if isinstance(err, hf.RepositoryNotFoundError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            return PullError(401, "auth_failed", f"Authentication failed: {_first_line(err)}")
        return PullError(404, "not_found", f"Repository not found: {_first_line(err)}")
    if isinstance(err, hf.RevisionNotFoundError | hf.RemoteEntryNotFoundError):
        return PullError(404, "not_found", _first_line(err))
    if isinstance(err, hf.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            return PullError(401, "auth_failed", f"Authentication failed: {_first_line(err)}")
        return PullError(502, "source_unreachable", f"HuggingFace Hub error: {_first_line(err)}")
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return PullError(507, "insufficient_storage", "Insufficient disk space.")
    if isinstance(err, hf.LocalEntryNotFoundError | ConnectionError | TimeoutError):
        return PullError(
            502, "source_unreachable", f"HuggingFace Hub unreachable: {_first_line(err)}"
        )
    mod = type(err).__module__
    if mod.startswith(("httpx", "httpcore", "requests", "urllib3")):
        return PullError(
            502, "source_unreachable", f"HuggingFace Hub unreachable: {_first_line(err)}"
        )
    # The client's own checks of what the Hub sent: a file name that leaves the directory (a
    # ValueError; the request itself was validated before the pull), a body whose size is not
    # the one announced (an OSError with no errno: no system call failed).
    if isinstance(err, ValueError) or (isinstance(err, OSError) and err.errno is None):
        return PullError(
            502,
            "model_pull_failed",
            f"HuggingFace Hub sent what cannot be stored: {_first_line(err)}",
        )
    return PullError(500, "model_pull_failed", f"{type(err).__name__}: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
