"""`solar-host restore-state`: start again from the last good copies of damaged state files.

The host refuses to start on a state file it cannot parse (statefiles.StateFileError) and names
the file's last good copy, `<file>.prev`. This command checks each state file of the settings
(config.json, the jobs store, reservations.json, api_key); for each one that does not parse and
whose last good copy does, it says what it replaces, moves the damaged file aside as
`<file>.damaged-<UTC time>` (nothing is erased) and puts the copy in its place. Files that parse
are not touched. Exit 0 when nothing is left damaged, 1 otherwise, 2 when a running host holds
the state directory (nothing is touched then).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from solar_host.platform.statefiles import (
    PRIVATE,
    StateFileError,
    atomic_write_bytes,
    check_api_key,
    last_good_path,
    read_regular,
    read_state_bytes,
    real_file,
)
from solar_host.platform.statelock import StateLock, StateLocked, holder_pid, is_locked
from solar_host.settings import Settings

Check = Callable[[Path, bytes], str]  # raises StateFileError; returns a short summary


def _check_config(models_dir: Path) -> Check:
    def check(path: Path, raw: bytes) -> str:
        from solar_host.instances.store import InstanceStore

        store = InstanceStore(path, models_dir)
        result = store.parse(raw)
        quarantined = f", {len(result.quarantined)} quarantined" if result.quarantined else ""
        return f"{len(result.records)} instance(s){quarantined}"

    return check


def _check_jobs(path: Path, raw: bytes) -> str:
    from solar_host.jobs.store import parse_store

    return f"{len(parse_store(path, raw).get('jobs', []))} job(s)"


def _check_reservations(path: Path, raw: bytes) -> str:
    from solar_host.resources.ledger_store import parse_reservations

    return f"{len(parse_reservations(path, raw))} reservation(s)"


def _check_api_key(path: Path, raw: bytes) -> str:
    # Also refuses a key that is not its copy's (a cut-short key parses as a key).
    check_api_key(path, raw)
    return "an API key"


def state_files(settings: Settings) -> list[tuple[Path, Check]]:
    from solar_host.jobs.store import STORE_FILE

    files: list[tuple[Path, Check]] = [
        (settings.config_file, _check_config(settings.models_dir)),
        (settings.jobs_dir / STORE_FILE, _check_jobs),
        (settings.reservations_file, _check_reservations),
    ]
    if not settings.api_key:
        files.append((settings.api_key_file, _check_api_key))
    return files


def _status(path: Path, check: Check) -> tuple[str | None, str | None]:
    """(summary, None) for a file that parses (or is absent), (None, error) otherwise."""
    try:
        raw = read_state_bytes(path)
        if raw is None:
            return "absent", None
        return check(path, raw), None
    except StateFileError as err:
        return None, err.error


def _saved_at(path: Path) -> str:
    mtime = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    return mtime.isoformat(timespec="seconds").replace("+00:00", "Z")


def restore_state(
    settings: Settings, *, dry_run: bool = False, say: Callable[[str], None] = print
) -> int:
    """Exit status: 0 nothing left damaged, 1 some file left damaged, 2 a host runs on these
    files (it would write over what is put back: stop it first)."""
    if not dry_run:
        # Probed, not taken: taking it would leave lock files (and directories) behind in a
        # state directory this command otherwise only repairs.
        for directory in StateLock.for_host(settings).directories:
            if is_locked(directory):
                say(f"nothing restored: {StateLocked(directory, holder_pid(directory))}")
                return 2
    return _restore(settings, dry_run=dry_run, say=say)


def _restore(settings: Settings, *, dry_run: bool, say: Callable[[str], None]) -> int:
    left_damaged = 0
    for path, check in state_files(settings):
        summary, error = _status(path, check)
        if error is None:
            say(f"{path}: ok ({summary})")
            continue
        prev = last_good_path(path)
        good, prev_error = _status(prev, check)
        if prev_error is not None or good == "absent":
            why = prev_error or "it does not exist"
            say(f"{path}: DAMAGED ({error}); the last good copy {prev} cannot be used: {why}")
            left_damaged += 1
            continue
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        # A state file that is a symlink stays one: the file it links to is set aside and
        # replaced (moving the link aside would leave a regular file in its place).
        target = real_file(path)
        aside = target.with_name(f"{target.name}.damaged-{stamp}")
        say(
            f"{path}: DAMAGED ({error})\n"
            f"  {'would be' if dry_run else 'is'} replaced by {prev} "
            f"(saved {_saved_at(prev)}, {good}); the damaged file "
            f"{'would be' if dry_run else 'is'} kept as {aside}"
        )
        if dry_run:
            continue
        data = read_regular(prev)
        if os.path.lexists(target):
            os.replace(target, aside)
        atomic_write_bytes(target, data, PRIVATE)
    return 1 if left_damaged else 0
