"""SGLang prompt-cache directories: per-instance paths, detach, background purge, boot sweep."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from solar_host.backends import sglang_cache
from solar_host.backends.base import LaunchContext
from solar_host.backends.sglang import BACKEND
from solar_host.backends.sglang_config import SglangConfig

ID1 = "0b7c2f7e-1d2a-4c3b-9e8f-0123456789ab"
ID2 = "5f0e9d8c-7b6a-4d5c-8e7f-fedcba987654"


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def filled(path: Path, files: int = 3) -> Path:
    (path / "sub").mkdir(parents=True)
    for i in range(files):
        (path / "sub" / f"page-{i}.bin").write_bytes(b"x" * 16)
    return path


def trash_in(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(".trash-"))


# --- Paths ---------------------------------------------------------------------------------------


def test_instance_cache_dir() -> None:
    assert sglang_cache.instance_cache_dir("", "a", "inst-1") is None
    assert sglang_cache.instance_cache_dir(None, "a", "inst-1") is None
    assert sglang_cache.instance_cache_dir("  ", "a", "inst-1") is None
    path = sglang_cache.instance_cache_dir("/cache", "qwen3.6:8b/merged", "inst-1")
    assert path == Path("/cache/qwen3.6-8b-merged-inst-1")
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError):
            sglang_cache.instance_cache_dir("/cache", "a", bad)


# --- Detach --------------------------------------------------------------------------------------


def test_detach_renames_to_trash_keeping_contents(tmp_path: Path) -> None:
    d = filled(tmp_path / "deepseek-flash-inst-1")
    trash = sglang_cache.detach(tmp_path, "deepseek:flash", "inst-1")
    assert trash is not None and trash.parent == tmp_path
    assert trash.name.startswith(".trash-")
    uuid.UUID(trash.name[len(".trash-") :])
    assert not d.exists()
    assert sorted(p.name for p in (trash / "sub").iterdir()) == [
        "page-0.bin",
        "page-1.bin",
        "page-2.bin",
    ]
    assert sglang_cache.detach(tmp_path, "deepseek:flash", "inst-1") is None


def test_detach_missing_or_unset_is_a_no_op(tmp_path: Path) -> None:
    assert sglang_cache.detach(tmp_path, "a", "inst-1") is None
    assert sglang_cache.detach("", "a", "inst-1") is None
    assert sglang_cache.detach(tmp_path / "no-root", "a", "inst-1") is None


def test_detach_leaves_symlinks_alone(tmp_path: Path) -> None:
    target = filled(tmp_path / "precious")
    root = tmp_path / "root"
    root.mkdir()
    (root / "a-inst-1").symlink_to(target, target_is_directory=True)
    assert sglang_cache.detach(root, "a", "inst-1") is None
    assert (root / "a-inst-1").is_symlink()
    assert len(list((target / "sub").iterdir())) == 3


def test_detach_failure_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    filled(tmp_path / "a-inst-1")

    def refuse(*_a: object) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(sglang_cache.os, "rename", refuse)
    with caplog.at_level(logging.WARNING):
        assert sglang_cache.detach(tmp_path, "a", "inst-1") is None
    assert (tmp_path / "a-inst-1").is_dir()
    assert "cannot detach prompt cache" in caplog.text


# --- Purge ---------------------------------------------------------------------------------------


def test_purge_removes_trash_in_background(tmp_path: Path) -> None:
    filled(tmp_path / "a-inst-1", files=50)
    trash = sglang_cache.detach(tmp_path, "a", "inst-1")
    thread = sglang_cache.purge_in_background([trash])
    assert thread is not None and thread.daemon
    thread.join(10)
    assert not trash.exists()
    assert list(tmp_path.iterdir()) == []


def test_purge_of_nothing_or_a_missing_dir_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert sglang_cache.purge_in_background([]) is None
    assert sglang_cache.purge_in_background([None]) is None
    with caplog.at_level(logging.WARNING):
        sglang_cache.purge_in_background([tmp_path / ".trash-gone"]).join(5)
    assert caplog.text == ""


def test_purge_reports_what_it_left_once_per_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = shutil.rmtree
    stuck = tmp_path / ".trash-x" / "sub" / "page-0.bin"

    def rmtree(path: Path, **kw: object) -> None:
        handler = kw.get("onexc") or kw.get("onerror")
        assert callable(handler)
        exc_v = FileNotFoundError("vanished")  # raced with another delete: not counted
        perm = PermissionError("busy")
        for err, entry in ((exc_v, "gone"), (perm, str(stuck))):
            if "onexc" in kw:
                handler(os.unlink, entry, err)
            else:
                handler(os.unlink, entry, (type(err), err, None))
        real(path)

    filled(tmp_path / ".trash-x")
    monkeypatch.setattr(sglang_cache.shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING):
        sglang_cache.purge_in_background([tmp_path / ".trash-x"]).join(5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"Purge of {tmp_path / '.trash-x'} left 1 entries behind; first: {stuck}"]


def test_purge_continues_after_a_failing_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = shutil.rmtree
    bad, good = filled(tmp_path / ".trash-bad"), filled(tmp_path / ".trash-good")

    def rmtree(path: Path, **kw: object) -> None:
        if Path(path) == bad:
            raise RuntimeError("boom")
        real(path, **kw)

    monkeypatch.setattr(sglang_cache.shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING):
        sglang_cache.purge_in_background([bad, good]).join(5)
    assert bad.exists() and not good.exists()
    assert "Purge of" in caplog.text and "boom" in caplog.text


# --- Prepare (start) -----------------------------------------------------------------------------


def test_prepare_gives_a_fresh_private_dir(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    path = sglang_cache.prepare(root, "a:b", "inst-1")
    assert path == root / "a-b-inst-1" and path.is_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    (path / "page.bin").write_bytes(b"old run")
    again = sglang_cache.prepare(root, "a:b", "inst-1")
    assert again == path and list(path.iterdir()) == []  # never inherits an old cache
    assert wait_until(lambda: trash_in(root) == [])  # the old one is purged
    assert sglang_cache.prepare("", "a", "inst-1") is None


def test_prepare_refuses_a_symlinked_dir(tmp_path: Path) -> None:
    target = filled(tmp_path / "precious")
    root = tmp_path / "root"
    root.mkdir()
    (root / "a-inst-1").symlink_to(target, target_is_directory=True)
    assert sglang_cache.prepare(root, "a", "inst-1") is None
    assert len(list((target / "sub").iterdir())) == 3


def test_prepare_failure_is_none(tmp_path: Path) -> None:
    root = tmp_path / "a-file"
    root.write_text("not a dir")
    assert sglang_cache.prepare(root, "a", "inst-1") is None


# --- Sweep (boot) --------------------------------------------------------------------------------


def test_sweep_detaches_instance_dirs_and_collects_trash(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    ids = [ID1, ID2, str(uuid.uuid4())]
    for i, iid in enumerate(ids):
        filled(root / f"model{i}-{iid}")
    old_trash = filled(root / f".trash-{uuid.uuid4()}")
    shared = filled(root / "shared-data")
    (root / f"loose-{ID1}").write_text("a file")  # wrong shape: a file
    outside = filled(tmp_path / "outside")
    (root / f"link-{ID2}").symlink_to(outside, target_is_directory=True)

    trash = sglang_cache.sweep(root)
    assert len(trash) == 4 and old_trash in trash
    for i, iid in enumerate(ids):
        assert not (root / f"model{i}-{iid}").exists()
    assert wait_until(lambda: trash_in(root) == [])
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["shared-data", f"loose-{ID1}", f"link-{ID2}"]
    )
    assert len(list((shared / "sub").iterdir())) == 3
    assert len(list((outside / "sub").iterdir())) == 3


def test_backend_sweeps_at_boot(tmp_path: Path) -> None:
    filled(tmp_path / f"a-{ID1}")
    assert len(BACKEND.sweep_caches(str(tmp_path))) == 1
    assert not (tmp_path / f"a-{ID1}").exists()
    assert BACKEND.sweep_caches("") == []


def test_sweep_of_nothing(tmp_path: Path) -> None:
    assert sglang_cache.sweep("") == []
    assert sglang_cache.sweep(None) == []
    assert sglang_cache.sweep(tmp_path / "missing") == []
    assert sglang_cache.sweep(tmp_path) == []


def test_sweep_survives_a_failing_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stays, goes = filled(tmp_path / f"a-{ID1}"), filled(tmp_path / f"b-{ID2}")
    real = os.rename

    def rename(src: object, dst: object) -> None:
        if Path(str(src)) == stays:
            raise PermissionError("busy")
        real(src, dst)

    monkeypatch.setattr(sglang_cache.os, "rename", rename)
    trash = sglang_cache.sweep(tmp_path)
    assert len(trash) == 1
    assert stays.is_dir() and not goes.exists()


def test_sweep_survives_a_failing_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    filled(tmp_path / f"a-{ID1}")

    def scandir(_path: object) -> None:
        raise PermissionError("no")

    monkeypatch.setattr(sglang_cache.os, "scandir", scandir)
    assert sglang_cache.sweep(tmp_path) == []
    assert (tmp_path / f"a-{ID1}").is_dir()


# --- The backend's hooks -------------------------------------------------------------------------


def ctx(root: Path | str, instance_id: str = ID1) -> LaunchContext:
    return LaunchContext(
        instance_id=instance_id,
        port=30000,
        host_api_key="k",
        models_dir=Path("/models"),
        sglang_prompt_cache_dir=str(root),
        gpu_type="nvidia_cuda",
    )


def test_hooks_prepare_before_start_and_discard_after_stop(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    config = SglangConfig(alias="deepseek:flash", model_path="/m")
    path = root / f"deepseek-flash-{ID1}"
    filled(path)  # left over from a crashed run
    assert BACKEND.before_start(config, ctx(root)) == []
    assert path.is_dir() and list(path.iterdir()) == []
    (path / "page.bin").write_bytes(b"kv")
    assert BACKEND.after_stop(config, str(root), ID1) is None
    assert not path.exists()
    assert wait_until(lambda: list(root.iterdir()) == [])
    # Another instance's directory is never touched.
    other = filled(root / f"deepseek-flash-{ID2}")
    BACKEND.after_stop(config, str(root), ID1)
    assert other.is_dir()


def test_hooks_without_a_cache_root_do_nothing(tmp_path: Path) -> None:
    config = SglangConfig(alias="a", model_path="/m")
    assert BACKEND.before_start(config, ctx("")) == []
    BACKEND.after_stop(config, "", ID1)
    assert list(tmp_path.iterdir()) == []


def test_before_start_reports_an_unusable_root(tmp_path: Path) -> None:
    root = tmp_path / "a-file"
    root.write_text("x")
    config = SglangConfig(alias="a", model_path="/m")
    warnings = BACKEND.before_start(config, ctx(root))
    assert len(warnings) == 1 and str(root) in warnings[0]
