"""The link to solar-control: Socket.IO client, payloads, outbox and socket commands."""

from solar_host.control.client import ControlLink, ControlLinkUnavailable, normalize_url

__all__ = ["ControlLink", "ControlLinkUnavailable", "normalize_url"]
