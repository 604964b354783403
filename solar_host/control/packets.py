"""Socket.IO packets from solar-control, decoded so that no packet can wedge the link.

python-socketio's own decoder trusts its peer in two ways that a faulty or hostile control can
turn against the host:

- a binary event's header names how many binary frames follow, and every frame after it is
  taken as one of them, however many it announced: the link kept running, but each command
  after such a header was swallowed (no ack, ever) and the frames were kept in memory;
- an event whose JSON cannot be decoded (nested past the parser's recursion limit) raised in
  the library before any host code ran, so the command got no answer at all.

- an event named like one of Socket.IO's own (`connect`, `disconnect`, `connect_error`) ran
  the host's handler for that moment of the connection: `disconnect` closed the link, and
  `connect` called its handler with arguments it does not take (no answer, an error logged);
  an event with no name (an empty list) raised in the library.

The contract has no binary events. `ControlPacket` turns all of these into an ordinary event
named REFUSED, with the packet's ack id kept, so the host answers it (a 400, like REST) and the
link goes on. Binary frames that arrive anyway are refused the same way, one by one.
"""

from __future__ import annotations

from typing import Any

from socketio import packet

REFUSED = "solar_host:refused"
# Names python-socketio gives to moments of the connection; as an event from control they are
# an impersonation, never a message.
RESERVED_EVENTS = frozenset({"connect", "connect_error", "disconnect", "__disconnect_final"})


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
        if self.packet_type == packet.EVENT:
            name = self.data[0] if isinstance(self.data, list) and self.data else None
            if not isinstance(name, str):
                return self._refuse("an event without a name")
            if name in RESERVED_EVENTS:
                return self._refuse(f"an event named {name!r}, a name Socket.IO keeps for itself")
        return 0

    def _refuse(self, what: str) -> int:
        """Become the REFUSED event (the ack id, when one was read, is kept); no attachments."""
        self.packet_type = packet.EVENT
        self.data = [REFUSED, what]
        if not isinstance(getattr(self, "id", None), int):
            self.id = None
        self.namespace = self.namespace if isinstance(self.namespace, str) else None
        return 0
