"""Mutual TLS settings: the certificates, the CA, CRLs, and the allow-list of names or SPKI
pins a peer must match (``TlsConfig``, ``spki_of``); and the trust rules OpenSSL does not make
by itself (``check_chain``), so that this peer and Rust's enforce one rule set (docs/security.md,
"Trust rules")."""

import hashlib
import ipaddress

try:
    import ssl
except ImportError:  # a Python built without OpenSSL: everything but TLS works
    ssl = None

from .constants import DEFAULT_TIMEOUT, MAX_INTERMEDIATES
from .errors import TlsReason, TlsRefused


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
    pos, after, _ = _spki_span(data)
    return data[pos:after]


def _spki_span(data):
    """Where subjectPublicKeyInfo starts and ends in the certificate ``data``, and where its
    tbsCertificate ends."""
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
    return pos, after, end


_OID_KEY_USAGE = bytes.fromhex("551d0f")          # 2.5.29.15
_OID_BASIC_CONSTRAINTS = bytes.fromhex("551d13")  # 2.5.29.19


def extensions_of(cert_der):
    """The extensions of an X.509 certificate (DER): {OID content bytes: extnValue content}.
    ValueError for a malformed certificate or an extension that appears twice."""
    data = bytes(cert_der)
    _, pos, end = _spki_span(data)
    found = {}
    while pos < end:
        tag, start, after = _der_tlv(data, pos, end)
        pos = after
        if tag != 0xA3:  # [1] issuerUniqueID, [2] subjectUniqueID
            continue
        tag, seq, seq_end = _der_tlv(data, start, after)
        if tag != 0x30:
            raise ValueError("extensions are not a SEQUENCE")
        while seq < seq_end:
            tag, ext, ext_end = _der_tlv(data, seq, seq_end)
            if tag != 0x30:
                raise ValueError("an extension is not a SEQUENCE")
            seq = ext_end
            tag, oid, oid_end = _der_tlv(data, ext, ext_end)
            if tag != 0x06:
                raise ValueError("an extension without its OID")
            tag, value, value_end = _der_tlv(data, oid_end, ext_end)
            if tag == 0x01:  # critical
                tag, value, value_end = _der_tlv(data, value_end, ext_end)
            if tag != 0x04 or value_end != ext_end:
                raise ValueError("an extension's value is not one OCTET STRING")
            key = data[oid:oid_end]
            if key in found:
                raise ValueError("an extension appears twice")
            found[key] = data[value:value_end]
    return found


def _key_usage_bits(extensions):
    """keyUsage as an int (bit 0: digitalSignature, ... bit 5: keyCertSign, as RFC 5280
    numbers them), or None without keyUsage."""
    value = extensions.get(_OID_KEY_USAGE)
    if value is None:
        return None
    tag, start, end = _der_tlv(value, 0, len(value))
    if tag != 0x03 or end != len(value) or end - start < 1:
        raise ValueError("keyUsage is not a BIT STRING")
    bits = 0
    for i, byte in enumerate(value[start + 1:end]):
        for b in range(8):
            if byte & (0x80 >> b):
                bits |= 1 << (8 * i + b)
    return bits


_DIGITAL_SIGNATURE, _KEY_CERT_SIGN = 1 << 0, 1 << 5


def _is_ca(extensions):
    """basicConstraints' cA (False without basicConstraints)."""
    value = extensions.get(_OID_BASIC_CONSTRAINTS)
    if value is None:
        return False
    tag, start, end = _der_tlv(value, 0, len(value))
    if tag != 0x30 or end != len(value):
        raise ValueError("basicConstraints is not a SEQUENCE")
    if start == end:
        return False
    tag, first, first_end = _der_tlv(value, start, end)
    return tag == 0x01 and first_end - first == 1 and value[first] != 0


def check_chain(chain, what):
    """The trust rules OpenSSL does not make (or makes only in part) on a verified chain
    (DER, leaf first, the root last): at most MAX_INTERMEDIATES intermediates; the leaf is no
    CA and carries keyUsage with digitalSignature; every issuer (intermediates and root)
    carries keyUsage with keyCertSign. TlsRefused with the rule's TlsReason; the chain's
    validity, signatures, extended key usage and CRLs are OpenSSL's checks, made before."""
    if not chain:
        raise TlsRefused(f"{what}: the verified chain of the peer cannot be read",
                         TlsReason.BAD_CERTIFICATE)
    intermediates = max(0, len(chain) - 2)
    if intermediates > MAX_INTERMEDIATES:
        raise TlsRefused(f"{what}: the peer's chain has {intermediates} intermediates, more "
                         f"than {MAX_INTERMEDIATES}", TlsReason.CHAIN_TOO_LONG)
    try:
        leaf = extensions_of(chain[0])
        if _is_ca(leaf):
            raise TlsRefused(f"{what}: the peer's certificate is a CA certificate (cA true)",
                             TlsReason.CA_LEAF)
        usage = _key_usage_bits(leaf)
        if usage is None or not usage & _DIGITAL_SIGNATURE:
            raise TlsRefused(f"{what}: the peer's certificate has no keyUsage with "
                             f"digitalSignature", TlsReason.WRONG_USAGE)
        for depth, der in enumerate(chain[1:], 1):
            usage = _key_usage_bits(extensions_of(der))
            if usage is None or not usage & _KEY_CERT_SIGN:
                raise TlsRefused(f"{what}: the issuer at depth {depth} of the peer's chain "
                                 f"has no keyUsage with keyCertSign", TlsReason.NOT_AN_ISSUER)
    except ValueError as e:
        raise TlsRefused(f"{what}: a certificate of the peer's chain cannot be read ({e})",
                         TlsReason.BAD_CERTIFICATE) from None


def _has_verified_chain():
    """Whether ``verified_chain`` can read a chain in this Python."""
    return (hasattr(ssl.SSLSocket, "get_verified_chain")
            or hasattr(getattr(ssl._ssl, "_SSLSocket", None), "get_verified_chain"))


def verified_chain(sock):
    """The chain OpenSSL verified for ``sock``'s peer, DER, leaf first, root last (public
    since Python 3.13; ``_sslobj``'s before, since 3.10); [] where there is none."""
    get = getattr(sock, "get_verified_chain", None)
    if get is None:
        get = getattr(getattr(sock, "_sslobj", None), "get_verified_chain", None)
    if get is None:
        return []
    chain = get() or []
    return [c if isinstance(c, (bytes, bytearray)) else c.public_bytes(ssl._ssl.ENCODING_DER)
            for c in chain]


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
    - ``allow_names``: DNS names or IP addresses; the other side's certificate must carry at
      least one in its subjectAltName (compared whole, a DNS name ignoring ASCII case; a
      wildcard in a certificate matches nothing, and no allowed name may be one);
    - ``spki_sha256``: pins, each the SHA-256 of the other side's DER SubjectPublicKeyInfo
      (64 hex digits, or 32 bytes).
    There is no mode that accepts any certificate the CA signed: ValueError without one (or
    with both). The chain is always verified, strictly (``VERIFY_X509_STRICT``: RFC 5280's
    rules on the certificates' form), a client certificate fit for client authentication, a
    server's for server authentication (OpenSSL's purpose checks), dates included, and then by
    the trust rules of docs/security.md that OpenSSL does not make itself (``check_chain``: no
    CA leaf, keyUsage, at most ``MAX_INTERMEDIATES`` intermediates). With a CRL file, every
    certificate of the chain is checked (``VERIFY_CRL_CHECK_CHAIN``): the file must hold a
    current CRL of every CA of the chain (the root's included); a CA without one, or a CRL past
    its nextUpdate, refuses the peer (fail closed). TLS 1.3 only; no session tickets or
    resumption; a stream cut without a TLS close_notify is an error, never a clean end.

    ``handshake_timeout`` bounds a whole handshake (seconds); ``timeout`` each whole message
    on a connection (None: no limit)."""

    def __init__(self, cert, key, ca, allow_names=(), spki_sha256=(), crl=None,
                 handshake_timeout=10.0, timeout=DEFAULT_TIMEOUT):
        if ssl is None:
            raise ImportError("this Python has no ssl module: mutual TLS is not available")
        if not _has_verified_chain():
            raise ImportError("this Python's ssl does not give a peer's verified chain (3.10 "
                              "and later do): the trust rules of docs/security.md cannot be "
                              "checked, so mutual TLS is not available")
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
        if any("*" in n for n in names):
            raise ValueError("allow_names: names match whole; a wildcard is not a name")
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
                ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TlsConfig: cannot load the certificate, key, CA or CRL: {e}") \
                from None
        return ctx

    def check_peer(self, sock, what):
        """After a verified handshake: the trust rules OpenSSL does not make
        (``check_chain``), then the peer's names (DNS, and IP addresses as text) and pin, or
        TlsRefused."""
        der = sock.getpeercert(binary_form=True)
        if not der:
            raise TlsRefused(f"{what}: the peer sent no certificate", TlsReason.NO_CERTIFICATE)
        check_chain(verified_chain(sock), what)
        sans = sock.getpeercert().get("subjectAltName", ())
        names = [v.lower() for k, v in sans if k == "DNS"]
        ips = set()
        for k, v in sans:
            if k == "IP Address":
                try:
                    ips.add(ipaddress.ip_address(v.strip()))
                except ValueError:
                    pass
        try:
            pin = spki_sha256_of(der)
        except ValueError as e:
            raise TlsRefused(f"{what}: the peer's certificate cannot be read ({e})",
                             TlsReason.BAD_CERTIFICATE) from None
        if self.allow_names:
            if not self._allowed(names, ips):
                shown = names + sorted(str(ip) for ip in ips)
                raise TlsRefused(f"{what}: the peer's certificate names "
                                 f"{', '.join(shown) or 'no DNS name'}, none of the allowed "
                                 f"{', '.join(self.allow_names)}", TlsReason.NAME_NOT_ALLOWED)
        elif pin not in self.spki_sha256:
            raise TlsRefused(f"{what}: the peer's key (SPKI SHA-256 {pin.hex()}) is not pinned",
                             TlsReason.PIN_MISMATCH)
        return names, pin.hex()

    def _allowed(self, names, ips):
        """Whether a DNS name (whole; a wildcard matches nothing) or an IP address of the
        certificate is allowed."""
        for allowed in self.allow_names:
            try:
                if ipaddress.ip_address(allowed) in ips:
                    return True
            except ValueError:
                if allowed in names and "*" not in allowed:
                    return True
        return False
