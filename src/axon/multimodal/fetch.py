"""Fetching image bytes a client names by URL, under the operator's `MediaPolicy`.

`data:` URIs are always accepted. `http(s)` only reaches hosts on the allow-list (vLLM's
`--allowed-media-domains`, exact host names), and never a private, loopback, link-local,
multicast or unspecified address unless the operator allows it: the host is resolved once, every
address checked, and the connection made to the checked address (the Host header and TLS name
keep the host name), so DNS rebinding between the check and the connect is impossible. Redirects
are followed only to the same scheme, host and port. `file://` reads only regular files under
`--allowed-local-media-path`, after resolving symlinks.

The API is blocking (the server runs it in a thread pool); every failure is InvalidImage.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from axon.multimodal.image import (
    DEFAULT_MAX_DECODED_PIXELS,
    DEFAULT_MAX_IMAGE_BYTES,
    DecodedImage,
    InvalidImage,
    decode_image,
    parse_data_uri,
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class MediaPolicy:
    """What image URLs a server may follow. The defaults allow `data:` URIs only."""

    # Host names (or IP literals) http(s) URLs may name, compared exactly and case-insensitively;
    # empty: no http(s) at all; "*": any host (the address checks still apply).
    allowed_domains: tuple[str, ...] = ()
    # A directory `file://` URLs may read under; None: no file:// at all.
    allowed_local_media_path: str | None = None
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = 10.0  # the whole download, redirects included
    allow_private_addresses: bool = False
    max_redirects: int = 3  # same-host redirects only
    _domains: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"media policy: max_bytes must be >= 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"media policy: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"media policy: max_redirects must be >= 0, got {self.max_redirects}")
        path = self.allowed_local_media_path
        if path is not None and not Path(path).is_absolute():
            raise ValueError(f"media policy: allowed_local_media_path must be absolute: {path!r}")
        domains = frozenset(_normal_host(name) for name in self.allowed_domains)
        object.__setattr__(self, "_domains", domains)

    def allows_host(self, host: str) -> bool:
        return "*" in self._domains or _normal_host(host) in self._domains


def fetch_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes `url` names (`data:`, `http(s)://`, `file://`), within `policy`. Raises
    InvalidImage: `forbidden_url` for what the policy refuses, `too_large`, `fetch_failed`."""
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        return parse_data_uri(url, policy.max_bytes)
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    if scheme == "file":
        return _read_local(url, policy)
    raise InvalidImage("forbidden_url", f"URL scheme {scheme!r} is not supported")


def fetch_image(
    url: str, policy: MediaPolicy, max_pixels: int = DEFAULT_MAX_DECODED_PIXELS
) -> DecodedImage:
    """fetch_bytes + decode_image."""
    data = fetch_bytes(url, policy)
    return decode_image(data, max_bytes=policy.max_bytes, max_pixels=max_pixels)


def is_forbidden_address(address: Address) -> bool:
    """True for an address a fetch must not reach by default: private, loopback, link-local,
    multicast, unspecified, reserved or otherwise not global, including such an IPv4 address
    embedded in IPv6 (IPv4-mapped, 6to4, Teredo, NAT64)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # the socket reaches exactly this IPv4 address
            return is_forbidden_address(address.ipv4_mapped)
        embedded = address.sixtofour
        if address.teredo is not None:
            embedded = address.teredo[1]
        if address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and is_forbidden_address(embedded):
            return True
    return (
        not address.is_global
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
    )


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str  # ASCII, lower case, no brackets
    port: int
    path: str  # path and query, as sent

    def url(self) -> str:
        return f"{self.scheme}://{_netloc(self.host, self.port, self.scheme)}{self.path}"


def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    target = _parse_http_url(url, policy)
    addresses = _resolve_once(target, policy)
    deadline = time.monotonic() + policy.timeout_s
    with httpx.Client(trust_env=False, follow_redirects=False, verify=True) as client:
        for _ in range(policy.max_redirects + 1):
            with _Response(client, target, addresses, deadline) as response:
                location = response.headers.get("location")
                if response.status_code in _REDIRECTS and location:
                    target = _same_host_redirect(target, location)
                    continue
                if response.status_code != 200:
                    raise InvalidImage(
                        "fetch_failed", f"{target.host} answered HTTP {response.status_code}"
                    )
                return _read_capped(response, policy.max_bytes, deadline)
    raise InvalidImage("fetch_failed", f"more than {policy.max_redirects} redirects")


def _parse_http_url(url: str, policy: MediaPolicy) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        host = _normal_host(parts.hostname or "")
    except (ValueError, UnicodeError):
        raise InvalidImage("forbidden_url", "the URL is malformed") from None
    if not host:
        raise InvalidImage("forbidden_url", "the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise InvalidImage("forbidden_url", "credentials in image URLs are not accepted")
    if not policy.allows_host(host):
        raise InvalidImage(
            "forbidden_url", f"host {host!r} is not in the server's allowed media domains"
        )
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return _Target(scheme=parts.scheme.lower(), host=host, port=port, path=path)


def _resolve_once(target: _Target, policy: MediaPolicy) -> list[Address]:
    """The addresses the fetch may connect to, in resolver order: the only DNS lookup of a
    fetch. Every one must pass is_forbidden_address (unless private addresses are allowed)."""
    try:
        addresses = [ipaddress.ip_address(target.host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise InvalidImage("fetch_failed", f"cannot resolve host {target.host!r}") from None
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not addresses:
        raise InvalidImage("fetch_failed", f"host {target.host!r} has no address")
    if not policy.allow_private_addresses:
        for address in addresses:
            if is_forbidden_address(address):
                raise InvalidImage(
                    "forbidden_url",
                    f"host {target.host!r} resolves to a non-public address ({address})",
                )
    return addresses


def _request(client: httpx.Client, target: _Target, address: Address, deadline: float):
    """A GET of `target` sent over a connection to `address` (no DNS lookup there)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise InvalidImage("fetch_failed", "the download exceeded its time limit")
    host = str(address) if address.version == 4 else f"[{address}]"
    url = f"{target.scheme}://{host}:{target.port}{target.path}"
    headers = {
        "Host": _netloc(target.host, target.port, target.scheme),
        # Raw bytes only: a compressed body would decompress past the byte cap in one chunk.
        "Accept-Encoding": "identity",
    }
    # TLS verifies the certificate against the host name, not the address we connect to.
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    try:
        return client.build_request(
            "GET", url, headers=headers, timeout=remaining, extensions=extensions
        )
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
        raise InvalidImage("forbidden_url", f"the URL is malformed ({error})") from None


class _Response:
    """A streamed response from the first of the checked `addresses` that accepts a connection
    (a name may resolve to an IPv6 address nothing listens on); httpx errors -> InvalidImage."""

    def __init__(self, client, target: _Target, addresses: list[Address], deadline: float):
        self._client = client
        self._target = target
        self._addresses = addresses
        self._deadline = deadline
        self._response: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        for index, address in enumerate(self._addresses):
            request = _request(self._client, self._target, address, self._deadline)
            try:
                self._response = self._client.send(request, stream=True)
                return self._response
            except httpx.ConnectError as error:
                if index == len(self._addresses) - 1:
                    raise _fetch_failed(error) from None
            except httpx.HTTPError as error:
                raise _fetch_failed(error) from None
        raise AssertionError("unreachable: _resolve_once returns at least one address")

    def __exit__(self, *exc_info) -> None:
        if self._response is not None:
            self._response.close()


def _read_capped(response: httpx.Response, max_bytes: int, deadline: float) -> bytes:
    """The body, refused as soon as it exceeds `max_bytes` or the deadline passes (checked
    between chunks; a single stalled read is bounded by the per-operation timeout)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise InvalidImage("too_large", f"the image exceeds the limit of {max_bytes} bytes")
    body = bytearray()
    try:
        for chunk in response.iter_raw():  # as received: a chunk_size would buffer
            body += chunk
            if len(body) > max_bytes:
                raise InvalidImage("too_large", f"the image exceeds the limit of {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise InvalidImage("fetch_failed", "the download exceeded its time limit")
    except httpx.HTTPError as error:
        raise _fetch_failed(error) from None
    return bytes(body)


def _same_host_redirect(target: _Target, location: str) -> _Target:
    """The redirect target, which must keep the scheme, host and port (so it reuses the
    checked address); anything else is refused."""
    try:
        parts = urllib.parse.urlsplit(urllib.parse.urljoin(target.url(), location))
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        host = _normal_host(parts.hostname or "")
    except (ValueError, UnicodeError):
        raise InvalidImage("forbidden_url", "the redirect location is malformed") from None
    if (parts.scheme.lower(), host, port) != (target.scheme, target.host, target.port):
        raise InvalidImage(
            "forbidden_url", f"{target.host} redirected to another origin ({parts.scheme}://{host})"
        )
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return _Target(scheme=target.scheme, host=target.host, port=target.port, path=path)


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    root_setting = policy.allowed_local_media_path
    if root_setting is None:
        raise InvalidImage("forbidden_url", "file:// URLs are not allowed on this server")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidImage("forbidden_url", "file:// URLs must name a local path")
    path = Path(urllib.parse.unquote(parts.path))
    root = Path(root_setting)
    # The lexical check comes first so a path outside the root is refused without touching the
    # filesystem (no probing whether /etc/something exists).
    lexical = Path(os.path.normpath(path))
    if not path.is_absolute() or not (
        lexical.is_relative_to(root) or lexical.is_relative_to(root.resolve())
    ):
        raise InvalidImage("forbidden_url", "the file is outside the allowed local media path")
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise InvalidImage("fetch_failed", "no such file under the allowed path") from None
    if not resolved.is_relative_to(root.resolve()):  # a symlink pointing out of the root
        raise InvalidImage("forbidden_url", "the file is outside the allowed local media path")
    return _read_regular_file(resolved, policy.max_bytes)


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    # O_NONBLOCK: opening a FIFO must not hang; O_NOFOLLOW: the checked path must not have
    # become a symlink since.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError:
        raise InvalidImage("fetch_failed", "the file cannot be opened") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise InvalidImage("forbidden_url", "file:// URLs may only name regular files")
    with os.fdopen(descriptor, "rb") as file:
        if info.st_size > max_bytes:
            raise InvalidImage("too_large", f"the file exceeds the limit of {max_bytes} bytes")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidImage("too_large", f"the file exceeds the limit of {max_bytes} bytes")
    return data


def _normal_host(host: str) -> str:
    """Lower case, no trailing dot, IDNA (punycode) for non-ASCII names."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host and not host.isascii():
        host = host.encode("idna").decode("ascii")
    return host


def _netloc(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return shown if port == default else f"{shown}:{port}"


def _fetch_failed(error: httpx.HTTPError) -> InvalidImage:
    kind = "timed out" if isinstance(error, httpx.TimeoutException) else type(error).__name__
    return InvalidImage("fetch_failed", f"the download failed ({kind})")
