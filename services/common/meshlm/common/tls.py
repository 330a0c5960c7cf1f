"""TLS and mutual TLS on meshlm's gRPC links, configured by three PEM files (the same flags in
every component):

    --tls-cert-file, --tls-key-file   this service's certificate (chain) and private key: what it
                                      presents as a server and, with a CA, as a client
    --tls-ca-file                     the CA of the system: servers require client certificates
                                      signed by it (mTLS), clients verify servers against it

Invariants of a TlsConfig:
* no file given: TLS is off and every link is plaintext (insecure ports and channels);
* a certificate and its key come together, and a CA needs them (every meshlm service presents
  its own certificate, to its clients and, under mTLS, to its servers);
* every given file is readable PEM when the config is built; the bytes read then are what the
  service uses until it restarts (no reload while running).

Kubernetes' native gRPC probes cannot speak TLS, so a TLS service may also serve grpc.health.v1,
and nothing else, in plaintext on `--health-port` (see GrpcServer).

A client dialing one resolved endpoint of a DNS name (a pod IP behind a headless service) checks
the server's certificate against that name, not the IP: pass it as `server_name`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc

from meshlm.common.flags import Flag, add_config_flags, config_values, env_values

FLAGS = {  # field -> flag
    "cert_file": "--tls-cert-file",
    "key_file": "--tls-key-file",
    "ca_file": "--tls-ca-file",
}
HEALTH_PORT_FLAG = "--health-port"
ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TlsConfig:
    """The PEM files of one service; all None = plaintext. Built once at start-up."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in FLAGS:
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        cert, key, ca = self.cert_file, self.key_file, self.ca_file
        if cert is not None and key is None:
            raise ValueError(f"{FLAGS['cert_file']} needs {FLAGS['key_file']} (the certificate's private key)")
        if key is not None and cert is None:
            raise ValueError(f"{FLAGS['key_file']} needs {FLAGS['cert_file']} (the key's certificate)")
        if ca is not None and cert is None:
            raise ValueError(
                f"{FLAGS['ca_file']} needs {FLAGS['cert_file']} and {FLAGS['key_file']}: with a CA "
                "every service presents its own certificate (mutual TLS)"
            )
        pem = {name: _read_pem(FLAGS[name], getattr(self, name)) for name in FLAGS}
        object.__setattr__(self, "_pem", pem)

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @property
    def mutual(self) -> bool:
        """Servers require client certificates signed by the CA."""
        return self.ca_file is not None

    def _bytes(self, name: str) -> bytes | None:
        pem: dict[str, bytes | None] = self.__dict__["_pem"]
        return pem[name]

    def server_credentials(self) -> grpc.ServerCredentials:
        """The server side: this certificate; with a CA, client certificates are required."""
        if not self.enabled:
            raise ValueError("TLS is off: no server credentials without --tls-cert-file")
        return grpc.ssl_server_credentials(
            [(self._bytes("key_file"), self._bytes("cert_file"))],
            root_certificates=self._bytes("ca_file"),
            require_client_auth=self.mutual,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The client side: verify servers against the CA (system roots without one) and
        present this certificate."""
        if not self.enabled:
            raise ValueError("TLS is off: no channel credentials without --tls-cert-file")
        return grpc.ssl_channel_credentials(
            root_certificates=self._bytes("ca_file"),
            private_key=self._bytes("key_file"),
            certificate_chain=self._bytes("cert_file"),
        )

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> TlsConfig:
        """From the flags add_tls_cli_args added (environment fallbacks already applied)."""
        return TlsConfig(**config_values(_CLI_FLAGS, ns, dest_prefix=DEST_PREFIX))

    @staticmethod
    def from_env(env_prefix: str, environ: Mapping[str, str] | None = None) -> TlsConfig:
        """From <env_prefix>TLS_CERT_FILE, ..._TLS_KEY_FILE, ..._TLS_CA_FILE."""
        return TlsConfig(**env_values(TlsConfig, _CLI_FLAGS, env_prefix, environ, dest_prefix=DEST_PREFIX))


def _read_pem(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


PLAINTEXT = TlsConfig()


# ---- channels ------------------------------------------------------------------------------
def _channel_options(tls: TlsConfig, options: ChannelOptions, server_name: str | None) -> list[tuple[str, Any]]:
    out = list(options)
    if tls.enabled and server_name:
        out.append(("grpc.ssl_target_name_override", server_name))
    return out


def aio_channel(
    address: str,
    tls: TlsConfig | None = None,
    options: ChannelOptions = (),
    server_name: str | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to address: TLS (mTLS with a CA) when tls is enabled, else plaintext.
    server_name: the DNS name the server's certificate must carry when address is one of its
    resolved IPs (ignored without TLS). interceptors: run on every call (e.g. the bearer token
    of meshlm.common.auth_interceptors)."""
    tls = tls or PLAINTEXT
    opts = _channel_options(tls, options, server_name)
    icpt = list(interceptors) or None
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=icpt)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts, interceptors=icpt)


def sync_channel(
    address: str,
    tls: TlsConfig | None = None,
    options: ChannelOptions = (),
    server_name: str | None = None,
) -> grpc.Channel:
    """The synchronous twin of aio_channel."""
    tls = tls or PLAINTEXT
    opts = _channel_options(tls, options, server_name)
    if not tls.enabled:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


# ---- command line --------------------------------------------------------------------------
DEST_PREFIX = "tls_"  # argparse dests tls_cert_file, ...; env <prefix>TLS_CERT_FILE, ...
_CLI_FLAGS: Mapping[str, Flag] = MappingProxyType(
    {
        "cert_file": Flag(
            "PEM certificate (chain) of this service: its gRPC server's certificate and the "
            "client certificate it presents to the services it calls. Setting it turns TLS on "
            "for every gRPC link of the service",
            metavar="PATH",
        ),
        "key_file": Flag("PEM private key of --tls-cert-file", metavar="PATH"),
        "ca_file": Flag(
            "PEM CA bundle. With it, servers require client certificates signed by it (mTLS) "
            "and clients verify servers against it and present their own certificate; without "
            "it, servers ask for no client certificate and clients verify against the system "
            "roots",
            metavar="PATH",
        ),
    }
)


def add_tls_cli_args(
    parser: argparse.ArgumentParser,
    env_prefix: str | None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """--tls-cert-file, --tls-key-file, --tls-ca-file (dests tls_*), each defaulting to
    <env_prefix>TLS_<NAME> from the environment (env_prefix None: no environment), the
    meshlm.common.flags way; read them back with TlsConfig.from_cli_args."""
    group = parser.add_argument_group(
        "TLS",
        "TLS / mutual TLS on the gRPC links (all unset: plaintext). Every meshlm service "
        "takes the same three flags; give them all one CA for mTLS.",
    )
    add_config_flags(
        group,
        TlsConfig,
        _CLI_FLAGS,
        env_prefix=env_prefix,
        environ=environ,
        dest_prefix=DEST_PREFIX,
    )


def validate_health_port(health_port: int | None, port: int) -> None:
    """None (off) or a fixed port in [1, 65535] other than the service's own port."""
    if health_port is None:
        return
    if not 1 <= health_port <= 65535:
        raise ValueError(f"{HEALTH_PORT_FLAG} must be in [1, 65535], got {health_port}")
    if health_port == port:
        raise ValueError(f"{HEALTH_PORT_FLAG} must differ from --port ({port})")
