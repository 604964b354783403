"""Known-answer canaries through a real host, against scripted backends that misbehave on
purpose (real processes speaking the OpenAI API on real sockets, /health 200 all along): each
silent fault is caught at the first probe that meets it (and its confirmation), handled as a
crash with cause canary_mismatch and the expected and received answers as evidence; a healthy
backend is never flagged, and its fingerprint is kept in config.json across restarts."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from solar_host.backends.base import CanaryAsk
from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config
from tests.fixtures.waiting import wait_until

INTERVAL_S = 0.5
GOOD = " mat and the dog ran"


class CanaryScript(ScriptBackend):
    """The scripted backend, with the probe its config's `fake_canary` names."""

    def canary_probe(self, config: Any) -> CanaryAsk | None:
        kind = (config.model_extra or {}).get("fake_canary")
        if kind == "generation":
            return CanaryAsk("generation", "/v1/completions")
        if kind == "embedding":
            return CanaryAsk("embedding", "/v1/embeddings")
        return None


def scripted(tmp_path: Path, alias: str, kind: str, answers: list[str]) -> dict[str, Any]:
    config = script_config(tmp_path, "--answers", json.dumps(answers), alias=alias)
    return {**config, "fake_canary": kind}


# (name, probe kind, answers: the first two right, then the fault for good, what names it).
FAULTS = [
    ("garbage", "generation", [GOOD, GOOD, "x7#qz@@w0p~~"], "a different completion"),
    ("empty", "generation", [GOOD, GOOD, ""], "an empty completion"),
    ("repeated", "generation", [GOOD, GOOD, " the the the the the"], "one token repeated"),
    ("http500", "generation", [GOOD, GOOD, "@500"], "HTTP 500 to /v1/completions"),
    ("hang", "generation", [GOOD, GOOD, "@hang"], "no answer to /v1/completions within"),
    ("nan", "embedding", ["@vec", "@vec", "@nan"], "values NaN or infinite"),
    ("zero", "embedding", ["@vec", "@vec", "@zero"], "an all-zero embedding"),
    ("rotated", "embedding", ["@vec", "@vec", "@other"], "a different embedding"),
]


def stored(config_file: Path, iid: str) -> dict[str, Any]:
    doc = json.loads(config_file.read_text())
    return next(e for e in doc["instances"] if e["instance"]["id"] == iid)


def replace_model(path: Path) -> None:
    path.write_bytes(b"GGUF-new")


async def test_every_silent_fault_is_caught_and_a_healthy_one_never(tmp_path: Path) -> None:
    s = host_settings(tmp_path, max_retries=0, canary_interval_s=INTERVAL_S, canary_timeout_s=1.5)
    async with running_host(s, backends=BackendRegistry([CanaryScript()])) as h:
        ids: dict[str, str] = {}
        configs = {name: scripted(tmp_path, f"c:{name}", k, a) for name, k, a, _ in FAULTS}
        configs["healthy"] = scripted(tmp_path, "c:healthy", "generation", [GOOD])
        configs["healthy_emb"] = scripted(tmp_path, "c:healthy-emb", "embedding", ["@vec"])
        for name, config in configs.items():
            r = await h.client.post("/instances", json={"config": config, "managed_by": "intent"})
            assert r.status_code == 200, r.text
            ids[name] = r.json()["instance"]["id"]
        answers = await asyncio.gather(
            *(h.client.post(f"/instances/{iid}/start") for iid in ids.values())
        )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]

        async def record(iid: str) -> dict[str, Any] | None:
            recs = (await h.client.get(f"/instances/{iid}/flight-records")).json()["records"]
            return recs[0] if recs else None

        for name, _, _, named in FAULTS:
            rec = await wait_until(lambda n=name: record(ids[n]), 30, f"{name} caught")
            assert rec["cause"] == "canary_mismatch", (name, rec)
            assert rec["phase"] == "running" and rec["signal"] == "SIGKILL"
            assert named in rec["message"], (name, rec["message"])
            # The fault was met by one probe and its confirmation, no more: caught within one
            # probe interval of its start.
            faults = [ln for ln in rec["log_tail"] if re.search(r"POST \S+ #[3-9]", ln)]
            assert len(faults) == 2, (name, rec["log_tail"])
            # Intent-managed: failed for control (the record is kept first, then the status
            # changes), led by the cause, with both answers.

            async def failed(n: str = name) -> dict[str, Any] | None:
                inst = (await h.client.get(f"/instances/{ids[n]}")).json()
                return inst if inst["status"] == "failed" else None

            inst = await wait_until(failed, 10, f"{name} failed")
            assert inst["error_message"].startswith("canary_mismatch: "), inst
            if FAULTS[[f[0] for f in FAULTS].index(name)][1] == "generation" and name != "hang":
                assert "expected " + repr(GOOD) in inst["error_message"] or name == "http500"

        # The healthy ones served every probe since (more than the faulty ones lived for).
        for name in ("healthy", "healthy_emb"):
            inst = (await h.client.get(f"/instances/{ids[name]}")).json()
            assert inst["status"] == "running", inst
            assert await record(ids[name]) is None
            fp = stored(s.config_file, ids[name])["canary"]
            assert fp["kind"] in ("generation", "embedding") and fp["identity"].startswith("sha")
        assert stored(s.config_file, ids["healthy"])["canary"]["text"] == GOOD
        metrics = (await h.client.get("/metrics")).text
        m = re.search(
            rf'solar_host_instance_canary_probes_total{{instance_id="{ids["healthy"]}"}} (\d+)',
            metrics,
        )
        assert m and int(m.group(1)) >= 3, metrics[-2000:]
        m = re.search(r'solar_host_backend_ends_total{cause="canary_mismatch"} (\d+)', metrics)
        assert m and int(m.group(1)) == len(FAULTS)
        for iid in ids.values():
            await h.client.post(f"/instances/{iid}/stop")


async def test_a_restart_compares_and_a_changed_model_takes_it_afresh(tmp_path: Path) -> None:
    """Host-managed: a mismatch restarts it under the policy, and the restarted backend is
    judged against the fingerprint it had (same config and model file). A new model file
    (another mtime) takes a new fingerprint at the next start; so does a host restart only
    when something changed (the fingerprint is in config.json)."""
    s = host_settings(tmp_path, canary_interval_s=INTERVAL_S, canary_timeout_s=1.5)
    reg = BackendRegistry([CanaryScript()])
    config = scripted(tmp_path, "c:restart", "generation", [GOOD, GOOD, GOOD, "@500"])
    async with running_host(s, backends=reg) as h:
        r = await h.client.post("/instances", json={"config": config})
        iid = r.json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        pid = r.json()["instance"]["pid"]

        async def fingerprint() -> dict[str, Any] | None:
            return stored(s.config_file, iid).get("canary")

        first = await wait_until(fingerprint, 20, "the fingerprint")

        async def restarted() -> bool:
            recs = (await h.client.get(f"/instances/{iid}/flight-records")).json()["records"]
            inst = (await h.client.get(f"/instances/{iid}")).json()
            # A new backend serves (the record is kept before the old one's status changes).
            return bool(recs) and inst["status"] == "running" and inst["pid"] != pid

        await wait_until(restarted, 30, "a canary crash and its restart")
        recs = (await h.client.get(f"/instances/{iid}/flight-records")).json()["records"]
        assert recs[0]["cause"] == "canary_mismatch"
        # The restarted backend answers right again: compared, not taken afresh.
        await asyncio.sleep(3 * INTERVAL_S)
        assert await fingerprint() == first
        await h.client.post(f"/instances/{iid}/stop")

        # Another model file under the same name: a new fingerprint at the next start.
        replace_model(Path(config["model"]))
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200

        async def retaken() -> dict[str, Any] | None:
            fp = await fingerprint()
            return fp if fp and fp["identity"] != first["identity"] else None

        second = await wait_until(retaken, 20, "a fingerprint for the new model file")
        assert second["taken_at"] > first["taken_at"]
    # A host restart (its backends stopped and started again): the same fingerprint.
    async with running_host(s, backends=reg) as h:

        async def running() -> bool:
            inst = (await h.client.get(f"/instances/{iid}")).json()
            return inst["status"] == "running"

        await wait_until(running, 20, "the instance started at boot")
        await asyncio.sleep(3 * INTERVAL_S)
        assert stored(s.config_file, iid)["canary"] == second
        await h.client.post(f"/instances/{iid}/stop")


async def test_a_re_adopted_backend_is_judged_against_its_fingerprint(tmp_path: Path) -> None:
    """The host goes away leaving its backends serving; the next one re-adopts them and probes
    each at once against the fingerprint in config.json: the one whose answers stayed right
    keeps serving, the one that went wrong while no host watched is caught."""
    s = host_settings(
        tmp_path, canary_interval_s=60.0, canary_timeout_s=1.5, keep_backends_on_shutdown=True
    )
    reg = BackendRegistry([CanaryScript()])
    configs = {
        "steady": scripted(tmp_path, "c:steady", "generation", [GOOD]),
        "drifted": scripted(tmp_path, "c:drifted", "generation", [GOOD, "zz9 qq9 xx9"]),
    }
    ids: dict[str, str] = {}
    pids: dict[str, int] = {}
    async with running_host(s, backends=reg) as h:
        for name, config in configs.items():
            r = await h.client.post("/instances", json={"config": config, "managed_by": "intent"})
            ids[name] = r.json()["instance"]["id"]
            r = await h.client.post(f"/instances/{ids[name]}/start")
            assert r.status_code == 200, r.text
            pids[name] = r.json()["instance"]["pid"]
        for name, iid in ids.items():

            async def taken(i: str = iid) -> bool:
                return bool(stored(s.config_file, i).get("canary"))

            await wait_until(taken, 20, f"the fingerprint of {name}")
        first = {n: stored(s.config_file, i)["canary"] for n, i in ids.items()}
    async with running_host(s, backends=reg) as h:

        async def caught() -> dict[str, Any] | None:
            recs = (await h.client.get(f"/instances/{ids['drifted']}/flight-records")).json()
            return recs["records"][0] if recs["records"] else None

        rec = await wait_until(caught, 30, "the drifted backend caught at re-adoption")
        assert rec["cause"] == "canary_mismatch" and "zz9 qq9 xx9" in rec["message"], rec
        steady = (await h.client.get(f"/instances/{ids['steady']}")).json()
        assert steady["status"] == "running" and steady["pid"] == pids["steady"], steady

        async def compared() -> bool:
            metrics = (await h.client.get("/metrics")).text
            return f'canary_probes_total{{instance_id="{ids["steady"]}"}} 1' in metrics

        await wait_until(compared, 20, "the re-adopted steady backend's probe")
        assert stored(s.config_file, ids["steady"])["canary"] == first["steady"]
        for iid in ids.values():
            await h.client.post(f"/instances/{iid}/stop")
