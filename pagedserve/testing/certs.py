"""Certificates for a control plane started per test run (pagedserve/testing/controlplane.py).

One CA signs the API server's serving certificate (valid for 127.0.0.1 and the in-cluster names) and
the client certificates of the admin and the controller manager; a separate RSA key signs service
account tokens. Everything lives in one folder and lasts as long as the run.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=1)
SERVING_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterCerts:
    ca: KeyPair
    serving: KeyPair
    admin: KeyPair
    controller_manager: KeyPair
    service_account_key: Path  # signs tokens (private), verifies them (the API server reads it too)


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write(folder: Path, name: str, cert: x509.Certificate, key: rsa.RSAPrivateKey) -> KeyPair:
    pair = KeyPair(folder / f"{name}.crt", folder / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    pair.key.chmod(0o600)
    return pair


def _builder(subject: x509.Name, issuer: x509.Name, key: rsa.RSAPrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _signed(
    ca_cert: x509.Certificate,
    ca_key: rsa.RSAPrivateKey,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    san: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
    key = _key()
    builder = _builder(subject, ca_cert.subject, key).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def generate(folder: Path, service_ip: str) -> ClusterCerts:
    """A new CA and the certificates signed by it, in ``folder``; ``service_ip`` is the ``kubernetes``
    Service's cluster IP (the first of the service range), which clients in pods may dial."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("pagedserve-e2e-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVING_NAMES]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
    serving = _signed(ca_cert, ca_key, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, san)
    # system:masters: the admin bypasses RBAC, as kubeadm's admin.conf does; everything the product runs
    # (operator, router) authenticates as its own ServiceAccount instead.
    admin = _signed(ca_cert, ca_key, _name("e2e-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    manager = _signed(
        ca_cert, ca_key, _name("system:kube-controller-manager"), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    sa_key = folder / "service-account.key"
    sa_key.write_bytes(
        _key().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    return ClusterCerts(
        ca=_write(folder, "ca", ca_cert, ca_key),
        serving=_write(folder, "apiserver", *serving),
        admin=_write(folder, "admin", *admin),
        controller_manager=_write(folder, "controller-manager", *manager),
        service_account_key=sa_key,
    )
