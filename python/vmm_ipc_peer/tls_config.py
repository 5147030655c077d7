"""Mutual TLS settings: the certificates, the CA, CRLs, and the allow-list of names or SPKI
pins a peer must match (``TlsConfig``, ``spki_of``)."""

import hashlib

try:
    import ssl
except ImportError:  # a Python built without OpenSSL: everything but TLS works
    ssl = None

from .constants import DEFAULT_TIMEOUT
from .errors import TlsRefused


def _der_tlv(data, pos, end):
    """The DER element at ``pos`` (within ``end``): (tag, content start, content end). Only
    what a certificate uses: one-byte tags, definite lengths in the fewest bytes."""
    if end - pos < 2:
        raise ValueError("a DER element is cut short")
    tag, length = data[pos], data[pos + 1]
    if tag & 0x1F == 0x1F:
        raise ValueError("a multi-byte DER tag")
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        if not 1 <= n <= 4 or end - pos < n:
            raise ValueError("a DER length of an unsupported form")
        length = int.from_bytes(data[pos:pos + n], "big")
        if data[pos] == 0 or length < 0x80:
            raise ValueError("a DER length not in its shortest form")
        pos += n
    if length > end - pos:
        raise ValueError("a DER element longer than what holds it")
    return tag, pos, pos + length


def spki_of(cert_der):
    """The DER SubjectPublicKeyInfo of an X.509 certificate (DER): Certificate = SEQUENCE {
    tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber INTEGER, signature SEQUENCE,
    issuer SEQUENCE, validity SEQUENCE, subject SEQUENCE, subjectPublicKeyInfo SEQUENCE, ... },
    ... }. ValueError for anything else."""
    data = bytes(cert_der)
    tag, start, end = _der_tlv(data, 0, len(data))
    if tag != 0x30 or end != len(data):
        raise ValueError("not one DER SEQUENCE: not a certificate")
    tag, pos, end = _der_tlv(data, start, end)
    if tag != 0x30:
        raise ValueError("a certificate's first element is not tbsCertificate")
    tag, _, after = _der_tlv(data, pos, end)
    if tag == 0xA0:  # [0] EXPLICIT version
        pos = after
    for expected, field in ((0x02, "serialNumber"), (0x30, "signature"), (0x30, "issuer"),
                            (0x30, "validity"), (0x30, "subject")):
        tag, _, after = _der_tlv(data, pos, end)
        if tag != expected:
            raise ValueError(f"tbsCertificate's {field} has tag {tag:#04x}")
        pos = after
    tag, _, after = _der_tlv(data, pos, end)
    if tag != 0x30:
        raise ValueError(f"tbsCertificate's subjectPublicKeyInfo has tag {tag:#04x}")
    return data[pos:after]


def spki_sha256_of(cert_der):
    """The pin of a certificate: SHA-256 of its DER SubjectPublicKeyInfo (32 bytes)."""
    return hashlib.sha256(spki_of(cert_der)).digest()


def _pin_bytes(pin):
    if isinstance(pin, str):
        try:
            pin = bytes.fromhex(pin.replace(":", ""))
        except ValueError:
            raise ValueError("an SPKI pin is 64 hex digits (SHA-256)") from None
    pin = bytes(pin)
    if len(pin) != 32:
        raise ValueError(f"an SPKI pin is a SHA-256: 32 bytes, not {len(pin)}")
    return pin


class TlsConfig:
    """One side's mutual-TLS settings: its certificate chain ``cert`` and key ``key``, the CA
    (``ca``) that must have issued the other side's certificate, an optional CRL (``crl``;
    then the other side's certificate must not be revoked, and a CRL of its issuer must be
    there), all PEM file paths; and whom to accept, exactly one of:
    - ``allow_names``: DNS names; the other side's certificate must carry at least one in its
      subjectAltName (compared whole, ignoring ASCII case; a wildcard is only itself);
    - ``spki_sha256``: pins, each the SHA-256 of the other side's DER SubjectPublicKeyInfo
      (64 hex digits, or 32 bytes).
    There is no mode that accepts any certificate the CA signed: ValueError without one (or
    with both). The chain is always verified, strictly (``VERIFY_X509_STRICT``: RFC 5280's
    rules on the certificates' form), a client certificate fit for client authentication, a
    server's for server authentication (OpenSSL's purpose checks), dates included. TLS 1.3 only; no session tickets or resumption; a stream cut without a TLS
    close_notify is an error, never a clean end.

    ``handshake_timeout`` bounds a whole handshake (seconds); ``timeout`` each whole message
    on a connection (None: no limit)."""

    def __init__(self, cert, key, ca, allow_names=(), spki_sha256=(), crl=None,
                 handshake_timeout=10.0, timeout=DEFAULT_TIMEOUT):
        if ssl is None:
            raise ImportError("this Python has no ssl module: mutual TLS is not available")
        if isinstance(allow_names, str):
            allow_names = (allow_names,)
        if isinstance(spki_sha256, (str, bytes, bytearray)):
            spki_sha256 = (spki_sha256,)
        names = tuple(str(n).lower() for n in allow_names)
        pins = tuple(_pin_bytes(p) for p in spki_sha256)
        if bool(names) == bool(pins):
            raise ValueError("TlsConfig names whom to accept: exactly one of allow_names (DNS "
                             "names the peer's certificate must carry) or spki_sha256 (pins of "
                             "its key); a certificate the CA signed is not enough")
        if any(not n or not n.isascii() for n in names):
            raise ValueError("allow_names: each a non-empty ASCII DNS name")
        if handshake_timeout is None or handshake_timeout <= 0:
            raise ValueError("handshake_timeout: a positive number of seconds")
        self.cert, self.key, self.ca, self.crl = cert, key, ca, crl
        self.allow_names, self.spki_sha256 = names, pins
        self.handshake_timeout, self.timeout = float(handshake_timeout), timeout
        self.server_context = self._context(ssl.PROTOCOL_TLS_SERVER)
        self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT)

    def _context(self, protocol):
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the names are checked here, against every allowed name
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        ctx.options |= ssl.OP_NO_TICKET | ssl.OP_NO_COMPRESSION
        ctx.options &= ~getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
        if protocol == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0
        try:
            ctx.load_cert_chain(self.cert, self.key)
            ctx.load_verify_locations(cafile=self.ca)
            if self.crl is not None:
                ctx.load_verify_locations(cafile=self.crl)
                ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TlsConfig: cannot load the certificate, key, CA or CRL: {e}") \
                from None
        return ctx

    def check_peer(self, sock, what):
        """After a verified handshake: the peer's DNS names and pin, or TlsRefused."""
        der = sock.getpeercert(binary_form=True)
        if not der:
            raise TlsRefused(f"{what}: the peer sent no certificate")
        names = [v.lower() for k, v in sock.getpeercert().get("subjectAltName", ())
                 if k == "DNS"]
        try:
            pin = spki_sha256_of(der)
        except ValueError as e:
            raise TlsRefused(f"{what}: the peer's certificate cannot be read ({e})") from None
        if self.allow_names:
            if not set(names) & set(self.allow_names):
                raise TlsRefused(f"{what}: the peer's certificate names "
                                 f"{', '.join(names) or 'no DNS name'}, none of the allowed "
                                 f"{', '.join(self.allow_names)}")
        elif pin not in self.spki_sha256:
            raise TlsRefused(f"{what}: the peer's key (SPKI SHA-256 {pin.hex()}) is not pinned")
        return names, pin.hex()
