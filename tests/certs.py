"""Test certificates made with `cryptography`: a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate, all signed by the CA, written as PEM files."""

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
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA and a server and a client certificate signed by it, in `directory`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pagefleet test CA")
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": _write(directory / "ca.pem", ca)}
    for who, usage, names in (
        (
            "server",
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
        ),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("client.test")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(_name(f"pagefleet test {who}"), ca_name, key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        paths[f"{who}_cert"] = _write(directory / f"{who}.pem", cert)
        key_path = directory / f"{who}-key.pem"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        paths[f"{who}_key"] = key_path
    return Certs(**paths)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path
