"""The typed failures: a broken rule (ProtocolError, TlsError), a peer not trusted
(PeerRefused, TlsRefused), a closed connection (PeerClosed)."""


class ProtocolError(Exception):
    """A message broke the protocol (its fds, if any, are already closed)."""


class PeerRefused(Exception):
    """The other side is not trusted: a listener that is not whom ``connect`` expects (a
    squatter), or a listener that refused this process."""


class PeerClosed(ConnectionError):
    """The other end closed the connection."""


class TlsRefused(PeerRefused):
    """A TLS peer is not trusted, or did not trust this side: its certificate failed the chain
    (CA, validity dates, key usage, CRL), or names none of the allowed names, or matches no
    pinned key; or it sent a TLS alert refusing this side's certificate. ``reason`` says
    which."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class TlsError(ProtocolError):
    """The TLS layer failed other than by a refusal: a record that did not authenticate (a
    byte changed on the way), a handshake that broke, a plaintext peer. Nothing of the message
    being read was delivered."""
