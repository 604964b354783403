"""An OCI artifact's layers: parsed from its manifest, and placed as files (directory layers
unpacked) once every blob was checked against its digest.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solar_host.model_store.pull import PullError, safe_relative

log = logging.getLogger(__name__)

TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
DIR_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"  # oras: a pushed directory


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    title: str
    unpack: bool

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


def parse_layers(manifest: Any) -> list[Layer]:
    def bad(what: str) -> PullError:
        return PullError(502, "model_pull_failed", f"Registry sent a malformed manifest: {what}")

    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers") or [], list):
        raise bad("not an object with a list of layers")
    layers = []
    for raw in manifest.get("layers") or []:
        if not isinstance(raw, dict):
            continue
        digest = str(raw.get("digest") or "")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise PullError(502, "model_pull_failed", f"unsupported layer digest {digest!r}")
        size = raw.get("size") or 0
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"layer {digest} has size {size!r}")
        ann = raw.get("annotations") or {}
        if not isinstance(ann, dict):
            raise bad(f"layer {digest} has annotations {ann!r}")
        title = ann.get(TITLE)
        if not title:
            log.warning("layer %s has no title annotation; skipped", digest)
            continue
        layers.append(
            Layer(
                digest=digest,
                size=size,
                title=safe_relative(str(title)),
                unpack=str(ann.get(UNPACK, "")).lower() == "true"
                or raw.get("mediaType") == DIR_LAYER,
            )
        )
    if not layers:
        raise PullError(502, "model_pull_failed", "artifact has no files (no titled layers)")
    titles = {x.title for x in layers}
    if len(titles) < len(layers):
        twice = next(t for t in titles if sum(1 for x in layers if x.title == t) > 1)
        raise PullError(502, "model_pull_failed", f"artifact names the file {twice!r} twice")
    for t in titles:
        parts = t.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in titles:
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"artifact file names {'/'.join(parts[:i])!r} and {t!r} collide",
                )
    return layers


def _safe_member(room: Callable[[int], None] | None) -> Callable[[Any, str], Any]:
    """The tarfile 'data' filter, plus what it misses on older Pythons (CVE-2025-4517: links
    that os.path.realpath gives up expanding): no `..` in any member name or link target, so
    nothing can climb out of the destination whatever links it makes; and `room(size)` before
    each file, so an archive that inflates past the disk floor stops."""

    def check(member: Any, dest: str) -> Any:
        name = member.name
        if ".." in name.replace("\\", "/").split("/"):
            raise PullError(
                502, "model_pull_failed", f"archive member {name!r} escapes the model directory"
            )
        if member.issym() or member.islnk():
            link = member.linkname
            if link.startswith("/") or ".." in link.replace("\\", "/").split("/"):
                raise PullError(
                    502,
                    "model_pull_failed",
                    f"archive link {name!r} -> {link!r} escapes the model directory",
                )
        member = tarfile.data_filter(member, dest)
        if room is not None and member.isfile():
            room(member.size)
        return member

    return check


def assemble(
    layers: list[Layer], blobs: Path, tree: Path, room: Callable[[int], None] | None = None
) -> None:
    """Place verified blobs under their titles in `tree` (unpacking directory layers).

    `room(n)` is called before `n` more bytes are unpacked and raises when they do not fit.
    A file that cannot be placed (an archive that made a directory where a layer's file goes)
    is the artifact's fault: a 502, as any other content the host will not store.
    """
    try:
        _assemble(layers, blobs, tree, room)
    except tarfile.TarError as err:
        raise PullError(502, "model_pull_failed", f"unreadable directory layer: {err}") from err
    except OSError as err:
        if err.errno not in _COLLISIONS:  # the machine's (a full disk, a read-only mount)
            raise
        raise PullError(
            502, "model_pull_failed", f"the artifact's files cannot be placed: {err}"
        ) from err


# A name taken twice within the artifact: one entry where another needs a directory, or the
# reverse.
_COLLISIONS = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY})


def _assemble(
    layers: list[Layer], blobs: Path, tree: Path, room: Callable[[int], None] | None
) -> None:
    tree.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for layer in layers:
        blob = blobs / f"sha256-{layer.hex}"
        if layer.unpack:
            # Like oras: the archive holds the directory named by the title.
            dest_dir = (tree / layer.title).parent
            dest_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(blob, "r:*") as tf:
                tf.extractall(dest_dir, filter=_safe_member(room))
            continue
        dest = tree / layer.title
        dest.parent.mkdir(parents=True, exist_ok=True)
        if layer.digest in used or sum(1 for x in layers if x.digest == layer.digest) > 1:
            import shutil

            shutil.copyfile(blob, dest)
            used.add(layer.digest)
        else:
            os.replace(blob, dest)
