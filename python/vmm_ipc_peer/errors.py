"""The typed failures: a broken rule (ProtocolError, TlsError), a peer not trusted
(PeerRefused, TlsRefused, with its TlsReason), a closed connection (PeerClosed)."""

import enum


class ProtocolError(Exception):
    """A message broke the protocol (its fds, if any, are already closed)."""


class PeerRefused(Exception):
    """The other side is not trusted: a listener that is not whom ``connect`` expects (a
    squatter), or a listener that refused this process."""


class PeerClosed(ConnectionError):
    """The other end closed the connection."""


class TlsReason(enum.Enum):
    """Why a TLS peer was refused: the same reasons, by the same names, as Rust's
    ``vmm_core::error::TlsReason`` (each value is the Rust variant's name). The trust rules
    behind them are listed once in docs/security.md ("Trust rules")."""

    NO_CERTIFICATE = "NoCertificate"
    UNKNOWN_ISSUER = "UnknownIssuer"
    EXPIRED = "Expired"
    NOT_YET_VALID = "NotYetValid"
    REVOKED = "Revoked"
    # No digitalSignature in the leaf's keyUsage, or not the extended key usage of its role.
    WRONG_USAGE = "WrongUsage"
    NAME_NOT_ALLOWED = "NameNotAllowed"
    PIN_MISMATCH = "PinMismatch"
    BAD_CERTIFICATE = "BadCertificate"
    # The peer refused this side (a TLS alert).
    REFUSED_BY_PEER = "RefusedByPeer"
    # A CRL given is past its nextUpdate: fail closed.
    CRL_EXPIRED = "CrlExpired"
    # CRLs are given, but none from a CA of the peer's chain: fail closed.
    REVOCATION_UNKNOWN = "RevocationUnknown"
    # An issuer of the chain (intermediate or root) lacks keyCertSign, or is no CA.
    NOT_AN_ISSUER = "NotAnIssuer"
    # The peer's own certificate is a CA certificate.
    CA_LEAF = "CaLeaf"
    # More intermediates than MAX_INTERMEDIATES.
    CHAIN_TOO_LONG = "ChainTooLong"


class TlsRefused(PeerRefused):
    """A TLS peer is not trusted, or did not trust this side: its certificate failed the chain
    (CA, validity dates, key usage, CRL), or names none of the allowed names, or matches no
    pinned key; or it sent a TLS alert refusing this side's certificate. ``reason`` says
    which in words, ``kind`` as a TlsReason."""

    def __init__(self, reason, kind=TlsReason.BAD_CERTIFICATE):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class TlsError(ProtocolError):
    """The TLS layer failed other than by a refusal: a record that did not authenticate (a
    byte changed on the way), a handshake that broke, a plaintext peer. Nothing of the message
    being read was delivered."""
