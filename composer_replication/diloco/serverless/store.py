"""Object-store plumbing for the serverless allreduce: opening a store, self-checking objects, atomic writes.

An object is ``MAGIC | header length (8 bytes, little endian) | JSON header | body``. The header names the
run, round, rank and every tensor (dtype, shape, byte count) and carries the body's length and SHA-256,
so a reader can tell a complete object from a half-written one, or from one that belongs to another run
or round, without trusting the store's write semantics.

Writes are atomic where the store allows it: on a local file system the object is written to a hidden
temporary name and renamed into place; object stores (S3, GCS, Azure) make a PUT visible only once it
is complete. ``create_exclusive`` is the one compare-and-set primitive the commit protocol needs:
``os.link`` on a local disk, ``If-None-Match: *`` on S3, ``mode="create"`` elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "StoreAccessError",
    "CorruptObjectError",
    "open_store",
    "encode_tensors",
    "decode_tensors",
    "write_atomic",
    "create_exclusive",
    "read_json",
]

log = logging.getLogger(__name__)

MAGIC = b"CRAR1\n"
_LEN = struct.Struct("<Q")

# Adapters whose package name differs from what fsspec's registry message says.
_ADAPTERS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
    "sftp": "paramiko",
    "ssh": "paramiko",
}
_CREDENTIAL_ERRORS = (
    "NoCredentialsError",
    "PartialCredentialsError",
    "NoAuthTokenError",
    "DefaultCredentialsError",
    "ClientAuthenticationError",
    "InvalidAccessKeyId",
)


class StoreAccessError(RuntimeError):
    """The store refused access (missing or wrong credentials) at the first allreduce."""


class CorruptObjectError(ValueError):
    """An object that is not (yet) a complete, self-consistent allreduce object."""


def protocol_of(uri: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``"file"`` for bare paths and ``file://``."""
    return uri.split("://", 1)[0].lower() if "://" in uri else "file"


def open_store(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """Resolve ``uri`` to ``(fsspec filesystem, root path without protocol)``.

    Raises:
        ImportError: the protocol's fsspec adapter is not installed; the message names the package.
        ValueError: fsspec does not know the protocol at all.
    """
    import fsspec

    proto = protocol_of(uri)
    try:
        fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
    except ImportError as exc:
        package = _ADAPTERS.get(proto, f"the fsspec adapter for {proto}://")
        raise ImportError(
            f"ObjectStoreAllReduce needs the fsspec adapter for {proto}:// to reach {uri!r}, and it is not "
            f"installed ({exc}). Install it beside composer-replication: `pip install {package}`"
            + (" (or `pip install -e .[s3]`)" if package == "s3fs" else "")
            + "."
        ) from exc
    except ValueError as exc:
        raise ValueError(
            f"fsspec does not know the protocol {proto!r} of {uri!r} ({exc}); use file://, memory://, s3:// "
            "or another protocol listed by fsspec.available_protocols()"
        ) from exc
    return fs, root.rstrip("/")


def explain_access_error(exc: BaseException, uri: str) -> BaseException | None:
    """A ``StoreAccessError`` explaining a credentials failure, or ``None`` when ``exc`` is not one."""
    names = {type(e).__name__ for e in _chain(exc)}
    text = " ".join(str(e) for e in _chain(exc))
    if not (
        names & set(_CREDENTIAL_ERRORS)
        or isinstance(exc, PermissionError)
        or "credentials" in text.lower()
        or "AccessDenied" in text
    ):
        return None
    proto = protocol_of(uri)
    hint = {
        "s3": "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an IAM role); on Modal or HF "
        'Jobs pass them as secrets of the executor; check with `python -c "import s3fs; '
        "print(s3fs.S3FileSystem().ls('BUCKET'))\"`",
        "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
        "gcs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
        "hf": "set HF_TOKEN with write access to the repository",
        "file": "make the folder writable by this user, or choose another --store",
    }.get(proto, "provide the store's credentials through its usual environment variables")
    return StoreAccessError(f"the store at {uri!r} refused access ({type(exc).__name__}: {exc}); {hint}")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


# ---------------------------------------------------------------------------- codec


def encode_tensors(tensors: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """Serialise ``tensors`` (any shapes, any dtypes, any device) with a self-checking header.

    ``meta`` (run, round, rank, name) is stored in the header and checked by :func:`decode_tensors`.
    """
    bodies, specs = [], []
    for t in tensors:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        bodies.append(raw)
        specs.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": len(raw)}
        )
    body = b"".join(bodies)
    header = dict(meta, tensors=specs, body_nbytes=len(body), sha256=hashlib.sha256(body).hexdigest())
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head + body


def decode_tensors(data: bytes, expect: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Parse an object written by :func:`encode_tensors`; returns ``(header, tensors)``.

    Raises:
        CorruptObjectError: truncated, wrong magic, body length or hash mismatch, or a header whose
            ``expect`` keys (run, round, rank) differ: a half-written object or a stale one.
    """
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise CorruptObjectError(f"not an allreduce object ({len(data)} bytes, bad magic or truncated)")
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(data[start : start + hlen])
    except ValueError as exc:
        raise CorruptObjectError(f"header is truncated or not JSON ({exc})") from exc
    body = data[start + hlen :]
    if len(body) != header.get("body_nbytes"):
        raise CorruptObjectError(
            f"body has {len(body)} bytes, header says {header.get('body_nbytes')} (half-written)"
        )
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorruptObjectError("body SHA-256 does not match its header (half-written or corrupted)")
    for key, value in expect.items():
        if header.get(key) != value:
            raise CorruptObjectError(
                f"object belongs to {key}={header.get(key)!r}, expected {value!r} (stale)"
            )
    tensors, offset = [], 0
    for spec in header["tensors"]:
        dtype = getattr(torch, spec["dtype"])
        chunk = body[offset : offset + spec["nbytes"]]
        offset += spec["nbytes"]
        flat = (
            torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
            if chunk
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(dtype).reshape(spec["shape"]))
    return header, tensors


# ---------------------------------------------------------------------------- writes


def is_local(fs: Any) -> bool:
    """True for fsspec's local file system (where rename and hard links are atomic)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` so that no reader ever sees a partial object.

    Local disk: temporary sibling, then rename. Object stores: a single PUT (visible only when complete).
    """
    if is_local(fs):
        fs.makedirs(fs._parent(path), exist_ok=True)
        tmp = f"{fs._parent(path)}/.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist yet; True when this call created it.

    Atomic on local disks (hard link of a complete temporary file), on S3 (``If-None-Match``) and in
    memory://; other stores fall back to fsspec's ``mode="create"`` (check, then write).
    """
    if is_local(fs):
        fs.makedirs(fs._parent(path), exist_ok=True)
        tmp = f"{fs._parent(path)}/.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    try:
        fs.pipe_file(path, data, mode="create")
        return True
    except FileExistsError:
        return False
    except Exception as exc:  # S3 reports a lost race as 412 PreconditionFailed
        if "PreconditionFailed" in f"{type(exc).__name__} {exc}" or "412" in str(exc):
            return False
        raise


def read_json(fs: Any, path: str) -> dict[str, Any] | None:
    """The JSON object at ``path``, or ``None`` when it is absent or not complete yet."""
    fs.invalidate_cache(fs._parent(path))  # a cached listing would hide a key created since
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) and value.get("complete") is True else None


def dump_json(value: Mapping[str, Any]) -> bytes:
    """Encode a small control object; :func:`read_json` accepts it only with ``complete: true``."""
    return json.dumps(dict(value, complete=True), sort_keys=True).encode()
