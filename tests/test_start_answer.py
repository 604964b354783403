"""What a start answers when its backend dies right after the start succeeded."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from tests.fixtures.host import host_settings, running_host
from tests.test_lifecycle_fake import cfg, create, registry


async def test_start_answers_the_state_it_reached_not_a_later_crash(tmp_path: Path) -> None:
    """The backend is killed after the start succeeded and before its answer is written (while
    the manager saves the state): the answer is the running instance the start reached, with
    its pid and port, not the failure the crash handling recorded a moment later."""
    async with running_host(host_settings(tmp_path, max_retries=0), backends=registry()) as h:
        svc = h.host.instances
        iid = await create(h, cfg(tmp_path, "--ready-after", "0.1"))
        sup = svc.supervisor(iid)
        real_persist = svc.persist
        armed = True

        async def persist() -> None:
            nonlocal armed
            # The start's own save (the request's task), not a background save of the record.
            background = asyncio.current_task() in svc._pending_saves
            if armed and not background and sup.instance.status == "running":
                armed = False
                os.kill(sup.instance.pid, signal.SIGKILL)
                for _ in range(200):  # the crash handling runs meanwhile (10 s at most)
                    if sup.instance.status != "running":
                        break
                    await asyncio.sleep(0.05)
            await real_persist()

        svc.persist = persist
        r = await h.client.post(f"/instances/{iid}/start")
        assert not armed, "the fault was not injected"
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["instance"]["status"] == "running", body
        assert body["instance"]["pid"] and body["instance"]["port"]
        # The crash is what the instance says now (failed, or restarted as a new process).
        now = (await h.client.get(f"/instances/{iid}")).json()
        assert now["status"] != "running" or now["pid"] != body["instance"]["pid"]
