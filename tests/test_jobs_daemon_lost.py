"""A daemon that goes away between creating a step's container and answering its start.

Under load the container may already run (and write) while the start's answer is still on its
way; a dockerd killed then broke the connection, and the step said "cannot start the container:
Connection aborted" instead of naming the daemon as lost, as it does when the daemon goes away
during the wait (tests/test_jobs_hostile.py: the kill raced the answer and lost on a loaded CI
machine). Here the daemon is a real unix socket that accepts a call and closes without a word.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from solar_host.jobs.docker import ContainerStartError, DaemonLostError, DockerJobs

REFUSAL = b'{"message": "cannot start: a refusal of the daemon"}'


@contextlib.contextmanager
def fake_daemon(path: Path, answer: bytes) -> Iterator[str]:
    """A unix socket whose every connection is read, then answered with `answer` (b"": closed
    with no answer at all)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    conn.sendall(answer)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        done.set()
        server.close()
        thread.join(timeout=5)


def _jobs(base_url: str) -> DockerJobs:
    import docker

    # A fixed API version: "auto" would ask the daemon first.
    return DockerJobs(docker.DockerClient(base_url=base_url, version="1.41", timeout=5))


def test_a_start_whose_answer_never_comes_names_the_daemon_lost(tmp_path: Path) -> None:
    with fake_daemon(tmp_path / "docker.sock", b"") as url:
        jobs = _jobs(url)
        with pytest.raises(DaemonLostError, match="connection to the Docker daemon was lost"):
            jobs.start("0123456789ab")
        with pytest.raises(DaemonLostError, match="connection to the Docker daemon was lost"):
            jobs.attach("0123456789ab")
    # Gone altogether (refused): the daemon that created the container is lost all the same.
    with pytest.raises(DaemonLostError):
        _jobs(url).start("0123456789ab")


def test_a_daemon_that_answers_no_is_told_as_its_refusal(tmp_path: Path) -> None:
    answer = (
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(REFUSAL), REFUSAL)
    )
    with fake_daemon(tmp_path / "docker.sock", answer) as url:
        with pytest.raises(ContainerStartError) as raised:
            _jobs(url).start("0123456789ab")
    assert not isinstance(raised.value, DaemonLostError)
    assert str(raised.value) == "cannot start the container: cannot start: a refusal of the daemon"
