"""The known-answer canary of one running backend: its probe when it is first ready (after a
start, a restart, a re-adoption) and then every CANARY_INTERVAL_S while it is idle, judged
against the fingerprint kept with the instance (canary.py says what is compared).

A wrong answer, or none, is confirmed by one more probe, then ends the backend as liveness
does (health.watch_liveness): the reason is told first (the crash's reason, cause
`canary_mismatch`), then the backend is SIGKILLed, and its exit is a crash like any other
(restart under the policy; an intent-managed instance goes failed for control).

Never ahead of a user's request: a probe waits until the host's view of the backend (its log
and /metrics, telemetry.py) has shown no request in flight for QUIET_S, and a round that
finds it busy waits for it to be idle. Busy is not stuck: requests in flight that have
shown no progress (no log line, no finished request, no /metrics value moved) for a whole
interval are probed anyway, so an engine that hangs on a user's request (its /health still
200) meets the probe's CANARY_TIMEOUT_S; a backend making progress is never probed while busy.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from solar_host.instances import canary, flight
from solar_host.instances import process as procs
from solar_host.instances.httpcheck import http_post_json, probe_address
from solar_host.instances.states import InstanceStatus

if TYPE_CHECKING:
    from solar_host.instances.supervising import Supervising
    from solar_host.instances.telemetry import Telemetry

log = logging.getLogger(__name__)

QUIET_S = 1.0  # no request seen for this long before a probe
IDLE_POLL_S = 0.25  # how often a busy backend is looked at again
CONFIRM_S = 0.5  # a failed probe is asked once more, this much later, before it counts
OWN_LINES_S = 2.0  # the log lines of a probe's generation come this late at most
MODEL_FILES_KEPT = 256  # files of a model directory that go into a fingerprint's identity
# Answers that say nothing about the model: a probe this config does not take (llama-server's
# embeddings with pooling none answer 400), a key the backend does not share (rotated), an
# endpoint it lacks, a busy or overloaded server. The probe is skipped, never failed.
SKIPPED_STATUSES = frozenset({400, 401, 403, 404, 405, 422, 429, 503})


def probe_of(sup: Supervising) -> canary.Probe | None:
    """The backend's known-answer probe for this instance's config; None: it has none."""
    backend, config = sup.backend(), sup.instance.config
    ask = backend.canary_probe(config)
    return canary.probe_for(ask, backend.served_model_name(config)) if ask else None


def model_files(paths: list[str], models_dir: Path) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each model file; a model directory by the files at its top
    (weights, config, tokenizer). Blocking: off the loop. A missing file is (path, -1, -1)."""
    out: list[tuple[str, int, int]] = []
    for raw in paths:
        path = Path(raw) if Path(raw).is_absolute() else models_dir / raw
        try:
            if path.is_dir():
                for child in sorted(path.iterdir())[:MODEL_FILES_KEPT]:
                    st = child.stat()
                    if child.is_file():
                        out.append((str(child), st.st_size, st.st_mtime_ns))
            else:
                st = path.stat()
                out.append((str(path), st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((str(path), -1, -1))
    return out


def identity_of(sup: Supervising, probe: canary.Probe) -> str:
    """What a fingerprint of this backend holds for (canary.identity). Blocking."""
    config = sup.instance.config
    # The build this host runs for the backend type (the llama-server executable's identity,
    # else this host's version): the same at a re-adoption, whose log may no longer show the
    # build line the first start printed.
    version = flight.version_of(sup, [])
    files = model_files(sup.backend().model_paths(config), sup.ctx.settings.models_dir)
    return canary.identity(
        flight.config_digest(config.model_dump(mode="json")), files, version, probe
    )


def idle(sup: Supervising, quiet_s: float) -> bool:
    """No request in flight, and none begun or ended within `quiet_s`."""
    t = sup.telemetry
    state = t.state
    return (
        not state.busy and not state.active_slots and time.monotonic() - t.state_changed >= quiet_s
    )


def stalled_for(sup: Supervising) -> float:
    """How long the requests in flight have shown no progress; 0 when none is in flight."""
    t = sup.telemetry
    if not t.state.busy and not t.state.active_slots:
        return 0.0
    return max(0.0, time.monotonic() - t.progress_at)


async def ask(
    address: str,
    port: int,
    probe: canary.Probe,
    bearer: str,
    timeout: float,
    telemetry: Telemetry | None = None,
) -> canary.Answer | None:
    """One probe; None when the answer says nothing about the model (SKIPPED_STATUSES, a
    connection refused: the exit watch and liveness judge a backend that is gone). The
    generation it causes is not kept in `telemetry` as a user's."""
    own = telemetry if probe.kind == canary.GENERATION else None
    if own is not None:
        own.own_request(time.monotonic() + timeout + OWN_LINES_S)
    try:
        status, body = await http_post_json(
            address, port, probe.path, probe.payload(), bearer=bearer, timeout=timeout
        )
    except TimeoutError:
        return canary.Answer(
            probe.kind, fault=f"no answer to {probe.path} within {timeout:g}s (CANARY_TIMEOUT_S)"
        )
    except (OSError, asyncio.IncompleteReadError):
        return None
    answer = canary.read_answer(probe, status, body)
    if own is not None:
        own.own_request_answered(OWN_LINES_S, answer.prompt_tokens)
    if status in SKIPPED_STATUSES:
        text = body[:200].decode("utf-8", "replace")
        log.info("known-answer probe %s skipped: HTTP %s %s", probe.path, status, text)
        return None
    return answer


async def watch(sup: Supervising, proc: procs.BackendProcess, probe: canary.Probe) -> None:
    """Probe the backend `proc` of `sup` until it is no longer the instance's running one."""
    settings = sup.ctx.settings
    interval = settings.canary_interval_s
    address = probe_address(sup.instance.config.host)

    def current() -> bool:
        return sup.proc is proc and sup.status == InstanceStatus.RUNNING

    ident = await asyncio.to_thread(identity_of, sup, probe)
    known = sup.stored.canary
    # Taken for another config, model file, build or probe: a new one is taken.
    expected = known if known is not None and known.identity == ident else None
    first = True
    while True:
        if not first:
            await asyncio.sleep(interval)
        first = False
        stalled = await _until_idle(sup, current, interval)
        if stalled is None:
            continue
        port = sup.instance.port
        if port is None or not current():
            return
        if stalled:
            log.warning(
                "requests in flight on %s have made no progress for %.0fs: probing it anyway",
                sup.id,
                stalled,
            )
        verdict, answer = await _probe(sup, address, port, probe, expected, current)
        if verdict is None or answer is None or not current():
            continue  # skipped; or stopped or replaced meanwhile: the loop's check ends it
        if not verdict.ok:
            await _end(sup, proc, probe, verdict, stalled)
            return
        sup.counters["canary_probes"] = sup.counters.get("canary_probes", 0) + 1
        # A known answer is taken from a backend alone, not one asked beside stuck requests.
        if expected is None and not stalled:
            expected = canary.fingerprint(answer, ident, datetime.now(UTC).isoformat())
            sup.stored.canary = expected
            sup.ctx.persist_soon()
            log.info("known answer of %s recorded (%s %s)", sup.id, probe.kind, probe.path)


async def _until_idle(
    sup: Supervising, current: Callable[[], bool], stuck_after: float
) -> float | None:
    """Wait for the backend to be idle (0.0), or for its requests in flight to have shown no
    progress for `stuck_after` seconds (stuck: how long, > 0); None: it is no longer the one
    watched. A busy backend is looked at until one or the other, so a request that stops
    making progress is met one interval after its last sign of life, however long it was busy
    before."""
    quiet = min(QUIET_S, stuck_after)
    while not idle(sup, quiet):
        if not current():
            return None
        stalled = stalled_for(sup)
        if stalled >= stuck_after:
            return stalled
        await asyncio.sleep(IDLE_POLL_S)
    return 0.0


async def _probe(
    sup: Supervising,
    address: str,
    port: int,
    probe: canary.Probe,
    expected: canary.Fingerprint | None,
    current: Callable[[], bool],
) -> tuple[canary.Verdict | None, canary.Answer | None]:
    """A probe judged, a failure confirmed by a second one (a transient never ends a backend);
    (None, None) when it was skipped."""
    timeout = sup.ctx.settings.canary_timeout_s
    answer = await ask(address, port, probe, sup.bearer(), timeout, sup.telemetry)
    if answer is None:
        return None, None
    verdict = canary.judge(expected, answer)
    if verdict.ok:
        return verdict, answer
    log.warning("known-answer probe of %s failed, asking again: %s", sup.id, verdict.evidence)
    await asyncio.sleep(CONFIRM_S)
    if not current():
        return None, None
    again = await ask(address, port, probe, sup.bearer(), timeout, sup.telemetry)
    if again is None:
        return None, None
    return canary.judge(expected, again), again


async def _end(
    sup: Supervising,
    proc: procs.BackendProcess,
    probe: canary.Probe,
    verdict: canary.Verdict,
    stalled: float,
) -> None:
    stuck = (
        f" (asked while requests in flight had made no progress for {stalled:.0f}s)"
        if stalled
        else ""
    )
    why = (
        f"The backend's answer to the known-answer probe ({probe.kind}, {probe.path}) is "
        f"wrong: {verdict.evidence}{stuck}; the host ended it"
    )
    sup.ended_why = why  # the crash's reason (crashes.crashed), cause canary_mismatch
    log.error("backend pid %s of %s: %s", proc.pid, sup.id, why)
    # As liveness ends a backend: SIGKILL (an engine that hangs seldom honours SIGTERM), and
    # its exit is a crash like any other, workers included.
    await asyncio.to_thread(procs.signal_tree, proc, signal.SIGKILL)
