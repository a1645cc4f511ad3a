"""Throwaway certificates for `tandem serve --internal-tls`: a CA and one certificate its services share.

The CA lives as long as the stack: its key is never written, and nothing outside the stack trusts it. Keys are EC
P-256 (fast to make) and every private key file is created 0600. The leaf certificate is valid for TLS servers and
clients (mutual TLS) and names the loopback addresses the children of the process launcher bind, and
`INTERNAL_NAME`, which services placed on other machines (`--launcher ray` on a joined cluster, bound to their node's
address) are checked for instead of the address dialled.

`CertificatePems` carries the three files' contents to a service whose machine does not have them (a Ray actor), which
writes them into a private directory of its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

INTERNAL_NAME = "tandem-internal"  # the name every service of a stack with throwaway certificates presents
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")
VALID_FOR = datetime.timedelta(days=7)  # a stack that runs longer restarts with fresh ones
CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class CertificateFiles:
    """PEM files: the CA certificate, and a certificate and its private key signed by that CA."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_directory(cls, directory: Path) -> CertificateFiles:
        return cls(ca=directory / "ca.pem", cert=directory / "cert.pem", key=directory / "key.pem")


@dataclass(frozen=True)
class CertificatePems:
    """The contents of CertificateFiles (PEM), for a service on a machine where the files are not."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    def write(self, directory: Path) -> CertificateFiles:
        """Writes the three files into `directory` (which should be private to this process), each created 0600."""
        files = CertificateFiles.in_directory(directory)
        for path, data in ((files.ca, self.ca), (files.cert, self.cert), (files.key, self.key)):
            _write_private(path, data)
        return files


def _write_private(path: Path, data: bytes) -> None:
    """Writes `data` to a new file readable by its owner only (created 0600, never wider)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def make_certificates(
    directory: Path,
    common_name: str = INTERNAL_NAME,
    dns_names: tuple[str, ...] = (INTERNAL_NAME, *LOOPBACK_NAMES),
    ip_addresses: tuple[str, ...] = LOOPBACK_IPS,
) -> CertificateFiles:
    """Writes a fresh CA (`ca.pem`) and a leaf (`cert.pem`, `key.pem`) for `dns_names` and `ip_addresses` into
    `directory`, which must exist; the CA's own key is never written. Returns the three paths."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{common_name} CA")
    ca_cert = _ca_certificate(ca_key, ca_name, now)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(address)) for address in ip_addresses]
    leaf_cert = _leaf_certificate(leaf_key, _name(common_name), names, ca_key, ca_name, now)
    files = CertificateFiles.in_directory(directory)
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(leaf_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, _key_pem(leaf_key))
    return files


def _valid_from(
    now: datetime.datetime, subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    """A certificate of `subject`'s `key` by `issuer`, valid from now (less the clock skew a peer may have) for
    VALID_FOR."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALID_FOR)
    )


def _ca_certificate(key: ec.EllipticCurvePrivateKey, name: x509.Name, now: datetime.datetime) -> x509.Certificate:
    """A self-signed CA that signs certificates only (no intermediate CAs below it)."""
    usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        _valid_from(now, name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _leaf_certificate(
    key: ec.EllipticCurvePrivateKey,
    name: x509.Name,
    alternative_names: list[x509.GeneralName],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    now: datetime.datetime,
) -> x509.Certificate:
    """A certificate signed by the CA for TLS servers and clients alike (mutual TLS), naming `alternative_names`."""
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    return (
        _valid_from(now, name, ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(usage, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
