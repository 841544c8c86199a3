"""TLS for a stack: the files a service is given, the gRPC credentials made of them, and the
local certificate authority `kvmesh up --tls` makes (with the `cryptography` package).

A member's certificate names it in its common name, "role:name" (mesh_auth.py reads it back
on the server), and carries the hosts it is reached on as subject alternative names, so
channels verify the server they dial. The internal services ask every caller for a
certificate signed by the stack's CA (mutual TLS); the gateway serves its clients with a
server certificate only (they prove themselves with tenant keys).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.config import ServerConfig

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
VALID_DAYS = 365


@dataclass(slots=True, frozen=True)
class TlsFiles:
    """One member's certificate and key (PEM), and the stack's CA certificate."""

    cert: bytes
    key: bytes
    ca: bytes | None

    @classmethod
    def load(
        cls, cert_file: Path | None, key_file: Path | None, ca_file: Path | None
    ) -> TlsFiles | None:
        """The files a service's config names; None when it names no certificate (no TLS)."""
        if cert_file is None and key_file is None:
            if ca_file is not None:
                raise ValueError("tls_ca_file needs tls_cert_file and tls_key_file")
            return None
        if cert_file is None or key_file is None:
            raise ValueError("tls_cert_file and tls_key_file go together")
        return cls(
            cert=cert_file.read_bytes(),
            key=key_file.read_bytes(),
            ca=ca_file.read_bytes() if ca_file is not None else None,
        )

    def server_credentials(self, require_client_certificate: bool) -> grpc.ServerCredentials:
        """Credentials of a server with this certificate; with `require_client_certificate`
        (internal services) every caller must show one signed by the CA."""
        if require_client_certificate and self.ca is None:
            raise ValueError("an internal service over TLS needs tls_ca_file to check callers")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca,
            require_client_auth=require_client_certificate,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel that verifies the server with the CA and shows this
        member's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def client_credentials(ca_file: Path) -> grpc.ChannelCredentials:
    """Credentials of a client of the gateway: the server verified with `ca_file`, no
    certificate of its own (the SDK and CLI's --ca-file)."""
    return grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())


@dataclass(slots=True, frozen=True)
class IssuedFiles:
    """Where one member's certificate and key were written."""

    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=VALID_DAYS)
    )


def _subject_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


@dataclass(slots=True, frozen=True)
class StackAuthority:
    """A stack's own certificate authority, kept in its state folder (the key 0600)."""

    folder: Path
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def open(cls, folder: Path) -> StackAuthority:
        """The CA in `folder`, made there first if there is none."""
        cert_path, key_path = folder / CA_CERT, folder / CA_KEY
        if cert_path.exists() and key_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            return cls(folder, x509.load_pem_x509_certificate(cert_path.read_bytes()), key)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh stack CA")])
        cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        _write_private(key_path, _pem_key(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(folder, cert, key)

    @property
    def ca_file(self) -> Path:
        """The CA certificate every member and client trusts."""
        return self.folder / CA_CERT

    def issue(self, file_name: str, common_name: str, hosts: Sequence[str]) -> IssuedFiles:
        """A certificate for `common_name`, valid for `hosts` (IPs or DNS names), written as
        FILE_NAME.pem and FILE_NAME-key.pem."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(_subject_names(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        files = IssuedFiles(self.folder / f"{file_name}.pem", self.folder / f"{file_name}-key.pem")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(files.key, _pem_key(key))
        return files


def tls_of(config: ServerConfig) -> TlsFiles | None:
    """The TLS files a service's config names (None: plaintext)."""
    return TlsFiles.load(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
