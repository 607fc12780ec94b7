"""A throwaway certificate authority for the TLS tests: a CA, a server certificate for loopback and
a client certificate, written as PEM files (the ``cryptography`` package; no ``openssl`` needed)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def make_certs(root: Path, *, client_name: str = "resilrun") -> TlsFiles:
    """A CA and, signed by it, a server certificate for 127.0.0.1/localhost and a client one."""
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("resilrun test CA"))
        .issuer_name(_name("resilrun test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(
        root / "ca.pem", root / "server.pem", root / "server-key.pem", root / "client.pem", root / "client-key.pem"
    )
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for common, usages, cert_path, key_path in (
        ("127.0.0.1", server_usages, files.server_cert, files.server_key),
        (client_name, [ExtendedKeyUsageOID.CLIENT_AUTH], files.client_cert, files.client_key),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            # etcd's gateway dials etcd itself with the server's certificate: it must be a client one too
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if ExtendedKeyUsageOID.SERVER_AUTH in usages:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert_path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return files
