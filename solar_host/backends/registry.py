"""Which backend serves which backend_type, and which of them this host can really run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from solar_host.backends.base import Availability, Backend, HostFacts


class BackendRegistry:
    def __init__(self, backends: Iterable[Any]):
        self._by_type: dict[str, Backend] = {}
        for backend in backends:
            for bt in backend.backend_types:
                self._by_type[bt] = backend

    @classmethod
    def default(cls) -> BackendRegistry:
        from solar_host.backends import huggingface, llamacpp, sglang

        return cls([llamacpp.BACKEND, huggingface.BACKEND, sglang.BACKEND])

    def for_type(self, backend_type: str) -> Backend:
        try:
            return self._by_type[backend_type]
        except KeyError:
            raise KeyError(f"Unknown backend_type: {backend_type!r}") from None

    def register(self, backend_type: str, backend: Any) -> None:
        """Replace the backend of one type (tests use scripted backends)."""
        self._by_type[backend_type] = backend

    def types(self) -> list[str]:
        return list(self._by_type)

    def supported(self, facts: HostFacts) -> list[str]:
        """The backend types this host can actually run, in a stable order."""
        return [bt for bt, b in self._by_type.items() if b.is_available(facts)]

    def availability(self, facts: HostFacts) -> dict[str, Availability]:
        """For every backend type: available or not, what it runs, why not."""
        from solar_host.backends.availability import describe

        return {bt: describe(b, facts) for bt, b in self._by_type.items()}
