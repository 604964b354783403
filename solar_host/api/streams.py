"""WebSocket streams of an instance's log lines and runtime state.

The state stream carries two message types: `instance_state` (the runtime state parsed from
the backend's log) and `instance_status` (its lifecycle: starting, spawned, ready, failed,
stopping, stopped, with pid and port), so a client can show a start's phases as they happen.

Each client reads the ring at its own pace: the host never waits for a client. A client that
falls behind by more than the ring gets a gap marker and continues from the oldest line kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from solar_host.instances.errors import InstanceNotFound

router = APIRouter()

SEND_TIMEOUT_S = 10.0
BATCH = 500


async def _send_text(ws: WebSocket, text: str) -> None:
    async with asyncio.timeout(SEND_TIMEOUT_S):
        await ws.send_text(text)


async def _accept(ws: WebSocket, manager: Any, instance_id: str) -> Any:
    """Accept the socket; the instance's supervisor, or None (told and closed) if unknown."""
    await ws.accept()
    try:
        return manager.supervisor(instance_id)
    except InstanceNotFound:
        await ws.send_json({"error": "Instance not found"})
        await ws.close(code=1008)
        return None


@router.websocket("/instances/{instance_id}/logs")
async def stream_logs(ws: WebSocket, instance_id: str, since_seq: int | None = None) -> None:
    manager = ws.app.state.host.instances
    sup = await _accept(ws, manager, instance_id)
    if sup is None:
        return
    next_seq = since_seq if since_seq is not None and since_seq >= 0 else sup.ring.first_seq
    # A since_seq past the newest line would skip every line until the count caught up: the
    # stream starts after the newest line instead.
    next_seq = min(next_seq, sup.ring.next_seq)
    closed = asyncio.create_task(_wait_closed(ws))
    woken: asyncio.Future[Any] | None = None
    try:
        while not closed.done():
            ring = sup.ring
            changed = ring.changed()
            gap, entries = ring.since(next_seq)
            if gap is not None and gap < ring.first_seq:
                await _send_text(
                    ws, json.dumps({"gap": {"from_seq": gap, "to_seq": ring.first_seq - 1}})
                )
            send = ws.send_text
            dumps = json.dumps
            for i in range(0, len(entries), BATCH):
                # One deadline per batch: a client that cannot take BATCH lines in
                # SEND_TIMEOUT_S is dropped, and the per-message cost stays low.
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    for e in entries[i : i + BATCH]:
                        await send(
                            dumps(
                                {"seq": e.seq, "timestamp": e.timestamp, "line": e.line},
                                ensure_ascii=False,
                            )
                        )
            if entries:
                next_seq = entries[-1].seq + 1
            elif gap is not None:
                next_seq = ring.first_seq
            if manager.supervisors.get(instance_id) is not sup:
                break  # deleted
            # Its own waiter each pass, cancelled when the socket closes first: left pending,
            # one per closed socket piled up on a quiet instance until its next line.
            woken = asyncio.ensure_future(changed.wait())
            await asyncio.wait([woken, closed], return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
    except (WebSocketDisconnect, TimeoutError, RuntimeError):
        pass
    finally:
        closed.cancel()
        if woken is not None:
            woken.cancel()
        with contextlib.suppress(Exception):
            await ws.close()


async def _wait_closed(ws: WebSocket) -> None:
    with contextlib.suppress(Exception):
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return


@router.websocket("/instances/{instance_id}/state")
async def stream_state(ws: WebSocket, instance_id: str) -> None:
    manager = ws.app.state.host.instances
    sup = await _accept(ws, manager, instance_id)
    if sup is None:
        return
    from solar_host.events import InstancesChanged, RuntimeStateChanged, iso_now

    queue: asyncio.Queue[dict | None] = asyncio.Queue(maxsize=256)

    def put(msg: dict[str, Any] | None) -> None:
        if queue.full():  # a slow client only ever misses intermediate states
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
        queue.put_nowait(msg)

    def on_state(event: RuntimeStateChanged) -> None:  # type: ignore[override]
        if event.instance_id == instance_id:
            put({"type": "instance_state", "timestamp": event.timestamp, "data": event.state})

    def on_status(event: InstancesChanged) -> None:  # type: ignore[override]
        if event.instance_id != instance_id:
            return
        if event.status is None:
            if manager.supervisors.get(instance_id) is not sup:
                put(None)  # deleted: the stream ends (as the log stream does)
            return
        # Published synchronously by set_status: the record already holds the new fields.
        inst = sup.instance
        data = {
            "instance_id": instance_id,
            "status": event.status,
            "reason": event.reason,
            "pid": inst.pid,
            "port": inst.port,
            "retry_count": inst.retry_count,
            "error_message": inst.error_message,
        }
        put({"type": "instance_status", "timestamp": iso_now(), "data": data})

    unsubscribes = [
        manager.bus.subscribe(on_state, RuntimeStateChanged),  # type: ignore[arg-type]
        manager.bus.subscribe(on_status, InstancesChanged),  # type: ignore[arg-type]
    ]
    closed = asyncio.create_task(_wait_closed(ws))
    try:
        await _send_text(
            ws, json.dumps({"type": "instance_state", "data": sup.telemetry.snapshot()})
        )
        while not closed.done():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait([getter, closed], return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            msg = getter.result()
            if msg is None:
                break
            await _send_text(ws, json.dumps(msg))
    except (WebSocketDisconnect, TimeoutError, RuntimeError):
        pass
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()
        closed.cancel()
        with contextlib.suppress(Exception):
            await ws.close()
