"""Socket.IO packets from solar-control, decoded so that no packet can wedge the link.

python-socketio's own decoder trusts its peer in two ways that a faulty or hostile control can
turn against the host:

- a binary event's header names how many binary frames follow, and every frame after it is
  taken as one of them, however many it announced: the link kept running, but each command
  after such a header was swallowed (no ack, ever) and the frames were kept in memory;
- an event whose JSON cannot be decoded (nested past the parser's recursion limit) raised in
  the library before any host code ran, so the command got no answer at all.

The contract has no binary events. `ControlPacket` turns both into an ordinary event named
REFUSED, with the packet's ack id kept, so the host answers it (a 400, like REST) and the link
goes on. Binary frames that arrive anyway are refused the same way, one by one.
"""

from __future__ import annotations

from typing import Any

from socketio import packet

REFUSED = "solar_host:refused"


class ControlPacket(packet.Packet):
    uses_binary_events = False  # nor does the host send any

    def decode(self, encoded_packet: Any) -> int:
        if not isinstance(encoded_packet, str):
            return self._refuse("a binary frame, which this link does not use")
        try:
            count = super().decode(encoded_packet)
        except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            why = "nested too deep" if isinstance(err, RecursionError) else str(err)[:200]
            return self._refuse(f"a packet that cannot be decoded ({why})")
        if count or self.packet_type in (packet.BINARY_EVENT, packet.BINARY_ACK):
            return self._refuse("a binary event, which this link does not use")
        return 0

    def _refuse(self, what: str) -> int:
        """Become the REFUSED event (the ack id, when one was read, is kept); no attachments."""
        self.packet_type = packet.EVENT
        self.data = [REFUSED, what]
        if not isinstance(getattr(self, "id", None), int):
            self.id = None
        self.namespace = self.namespace if isinstance(self.namespace, str) else None
        return 0
