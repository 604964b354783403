"""A small HTTP client of one host's REST API, for the command line.

Every failure is one of four exceptions, each of which the command line maps to its own exit
code: the host cannot be reached, it refused the key, it refused the operation, or the client
was given a bad URL. Nothing here prints.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx


class ClientError(Exception):
    """Base of the client's errors; `str()` is one line for the terminal."""


class ConfigError(ClientError):
    """The URL or key given to the client cannot work (no request was made)."""


class HostUnreachable(ClientError):
    pass


class AuthFailed(ClientError):
    pass


class NoSuchInstance(ClientError):
    """No instance has this alias, id or id prefix (nothing was asked of the host)."""

    def __init__(self, ref: str):
        self.ref = ref
        super().__init__(
            f"no instance matches {ref!r} (by alias, id or id prefix); "
            "`solar-host instances` lists them"
        )


class AmbiguousInstance(ClientError):
    """Several instances match a reference; `matches` are their instance records."""

    def __init__(self, ref: str, matches: list[dict[str, Any]]):
        self.ref = ref
        self.matches = matches
        lines = [f"{ref!r} matches {len(matches)} instances; name one by its id:"]
        for inst in matches:
            alias = (inst.get("config") or {}).get("alias")
            lines.append(f"  {inst.get('id')}  {alias}  {inst.get('status')}")
        super().__init__("\n".join(lines))


def resolve_instance(instances: list[dict[str, Any]], ref: str) -> dict[str, Any]:
    """The one instance `ref` names: its exact id, else its alias, else a unique id prefix.

    An exact id always wins (an alias can look like an id prefix); an alias shared by several
    instances, or a prefix of several ids, is ambiguous rather than a guess.
    """
    ref = ref.strip()
    if not ref:
        raise NoSuchInstance(ref)
    for inst in instances:
        if inst.get("id") == ref:
            return inst
    for pick in (
        lambda i: (i.get("config") or {}).get("alias") == ref,
        lambda i: str(i.get("id", "")).startswith(ref),
    ):
        found = [i for i in instances if pick(i)]
        if len(found) == 1:
            return found[0]
        if found:
            raise AmbiguousInstance(ref, found)
    raise NoSuchInstance(ref)


class OperationFailed(ClientError):
    """The host answered with an error; `body` is its JSON body (or {"detail": text})."""

    def __init__(self, status: int, body: dict[str, Any]):
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {describe(body)}")


def describe(body: Any) -> str:
    """The human part of an error body: `detail` (str, or FastAPI's list of field errors)."""
    if not isinstance(body, dict):
        return str(body)
    detail = body.get("detail", body.get("error", body))
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if isinstance(e, dict):
                loc = ".".join(str(x) for x in e.get("loc", ()))
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


def _body(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        return {"detail": resp.text.strip() or resp.reason_phrase}
    return data if isinstance(data, dict) else {"detail": data}


class HostClient:
    """Synchronous calls to one host. `timeout` bounds connecting and short calls."""

    def __init__(self, url: str, api_key: str, *, timeout: float = 10.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"host URL must be http(s)://HOST:PORT, not {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        headers = {"X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HostClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport --------------------------------------------------------------------------

    def request(
        self, method: str, path: str, *, json_body: Any = None, read_timeout: float | None = -1.0
    ) -> httpx.Response:
        """Send one request; raise a ClientError for anything but a 2xx answer.

        `read_timeout` None waits as long as the operation takes (starts, pulls); -1 uses the
        client's timeout.
        """
        timeout = httpx.Timeout(
            self.timeout, read=self.timeout if read_timeout == -1.0 else read_timeout
        )
        try:
            resp = self._http.request(method, path, json=json_body, timeout=timeout)
        except httpx.TimeoutException:
            raise HostUnreachable(f"{self.url} did not answer within {self.timeout:g} s") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as err:
            raise HostUnreachable(f"cannot reach {self.url}: {err}") from None
        except httpx.InvalidURL as err:
            raise ConfigError(f"invalid host URL {self.url!r}: {err}") from None
        if resp.status_code == 401:
            raise AuthFailed(f"{self.url} refused the API key: {describe(_body(resp))}")
        if resp.status_code >= 400:
            raise OperationFailed(resp.status_code, _body(resp))
        return resp

    def get_json(self, path: str) -> Any:
        return self.request("GET", path).json()

    # --- operations -------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.get_json("/health")

    def info(self) -> dict[str, Any]:
        return self.get_json("/")

    def instances(self) -> list[dict[str, Any]]:
        return self.get_json("/instances")

    def instance(self, instance_id: str) -> dict[str, Any]:
        return self.get_json(f"/instances/{quote(instance_id, safe='')}")

    def find_instance(self, ref: str) -> dict[str, Any]:
        """The instance named by alias, id or unique id prefix (see resolve_instance)."""
        return resolve_instance(self.instances(), ref)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/instances", json_body=body).json()

    def delete(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}"
        return self.request("DELETE", path, read_timeout=None).json()

    def start(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/start"
        return self.request("POST", path, read_timeout=None).json()

    def stop(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/stop"
        return self.request("POST", path, read_timeout=None).json()

    def restart(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/restart"
        return self.request("POST", path, read_timeout=None).json()

    def jobs(self) -> list[dict[str, Any]]:
        return self.get_json("/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get_json(f"/jobs/{quote(job_id, safe='')}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self.request("DELETE", f"/jobs/{quote(job_id, safe='')}", read_timeout=None).json()

    def logs(self, instance_id: str) -> list[dict[str, Any]]:
        return self.get_json(f"/instances/{quote(instance_id, safe='')}/logs")

    def models(self) -> list[dict[str, Any]]:
        return self.get_json("/models")

    def pull(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/models/pull", json_body=body, read_timeout=None).json()

    def metrics_text(self) -> str:
        return self.request("GET", "/metrics").text

    # --- WebSocket log stream -----------------------------------------------------------------

    def ws_url(self, path: str) -> str:
        parts = urlsplit(self.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, "", ""))

    async def follow_logs(
        self, instance_id: str, since_seq: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Messages of WS /instances/{id}/logs: {seq, timestamp, line} or {gap: {...}}.

        Ends when the host closes the stream (the instance was deleted).
        """
        query = f"?since_seq={since_seq}" if since_seq is not None else ""
        async for msg in self._follow(f"/instances/{quote(instance_id, safe='')}/logs", query):
            if isinstance(msg, dict) and "error" in msg and "seq" not in msg:
                raise OperationFailed(404, {"detail": msg["error"]})
            yield msg

    async def follow_state(self, instance_id: str) -> AsyncIterator[dict[str, Any]]:
        """Messages of WS /instances/{id}/state: `instance_state` (runtime) and
        `instance_status` (lifecycle: starting, spawned, ready, failed, ...)."""
        async for msg in self._follow(f"/instances/{quote(instance_id, safe='')}/state", ""):
            if isinstance(msg, dict) and "error" in msg and "type" not in msg:
                raise OperationFailed(404, {"detail": msg["error"]})
            yield msg

    async def _follow(self, path: str, query: str) -> AsyncIterator[Any]:
        """JSON messages of one WebSocket stream until the host closes it.

        The key goes in the X-API-Key header, never in the URL (URLs end up in logs).
        """
        url = self.ws_url(path) + query
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        try:
            ws_cm = _ws_connect(url, headers, self.timeout)
            async with ws_cm as ws:
                while True:
                    try:
                        raw = await ws.recv()
                    except Exception as err:
                        _raise_for_close(err, self.url)
                        return
                    yield json.loads(raw)
        except (OSError, TimeoutError) as err:
            raise HostUnreachable(f"cannot reach {self.url}: {err}") from None
        except ClientError:
            raise
        except Exception as err:  # websockets' handshake errors: the host answered, but not a WS
            if not type(err).__module__.startswith("websockets"):
                raise
            status = getattr(getattr(err, "response", None), "status_code", None)
            if status == 401:
                raise AuthFailed(f"{self.url} refused the API key") from None
            if status is not None:
                raise OperationFailed(status, {"detail": f"stream refused: {err}"}) from None
            raise HostUnreachable(f"stream from {self.url} failed: {err}") from None


def _ws_connect(url: str, headers: dict[str, str], timeout: float) -> Any:
    # websockets >= 13 has the new asyncio client (additional_headers); older ones the legacy.
    try:
        from websockets.asyncio.client import connect
    except ImportError:  # pragma: no cover - old websockets
        import websockets

        return websockets.connect(url, extra_headers=headers, open_timeout=timeout)
    return connect(url, additional_headers=headers, open_timeout=timeout, max_size=None)


def _raise_for_close(err: Exception, url: str) -> None:
    """A normal close ends the stream; 1008 after accept is the host refusing the key."""
    rcvd = getattr(err, "rcvd", None)
    code = getattr(rcvd, "code", None)
    if code == 1008:
        reason = getattr(rcvd, "reason", "") or "policy violation"
        if "key" in reason.lower():
            raise AuthFailed(f"{url} refused the API key: {reason}") from None
        raise OperationFailed(404, {"detail": reason}) from None
    if code in (1000, 1001, None) and type(err).__name__.startswith("ConnectionClosed"):
        return
    if type(err).__name__.startswith("ConnectionClosed"):
        raise HostUnreachable(f"stream from {url} closed: {err}") from None
    raise err
