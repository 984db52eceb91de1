"""Object-store plumbing of the serverless allreduce: opening a store, self-checking objects, atomic writes.

An object is ``MAGIC | header length (8 bytes, little endian) | JSON header | body``. The header names the
launch, round and rank, every tensor (dtype, shape, byte count), the body's length and its SHA-256; it is
validated as a schema, so a half-written, stale, foreign or hostile object is a :class:`CorruptObjectError`
(a missing rank), never read as current. ``create_exclusive`` is the one compare-and-set the protocol needs:
``os.link`` on a local disk, ``If-None-Match: *`` on S3, ``mode="create"`` elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["StoreAccessError", "CorruptObjectError", "open_store"]

MAGIC = b"CRAR2\n"
_LEN = struct.Struct("<Q")
_MAX_HEADER = 1 << 24  # 16 MiB of JSON is far above any model's tensor list
_DTYPES = {name: getattr(torch, name) for name in
           ("float16", "bfloat16", "float32", "float64", "complex64", "complex128")}
_ADAPTERS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko"}
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError",
                      "DefaultCredentialsError", "ClientAuthenticationError", "InvalidAccessKeyId"}
_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an IAM role); on Modal or HF Jobs pass "
          "them as secrets of the executor; check with `python -c \"import s3fs; print(s3fs.S3FileSystem().ls('BUCKET'))\"`",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
    "hf": "set HF_TOKEN with write access to the repository",
    "file": "make the folder writable by this user, or choose another --store",
}


class StoreAccessError(RuntimeError):
    """The store refused access (missing or wrong credentials) at the first allreduce."""


class CorruptObjectError(ValueError):
    """An object that is not (yet) a complete, self-consistent allreduce object of this launch and round."""


def protocol_of(uri: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``"file"`` for bare paths and ``file://``."""
    return uri.split("://", 1)[0].lower() if "://" in uri else "file"


def open_store(uri: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, root path without protocol)`` of ``uri``.

    Raises:
        ImportError: the protocol's fsspec adapter is not installed; the message names the package.
        ValueError: fsspec does not know the protocol.
    """
    import fsspec

    proto = protocol_of(uri)
    try:
        fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
    except ImportError as exc:
        package = _ADAPTERS.get(proto, f"the fsspec adapter for {proto}://")
        raise ImportError(
            f"ObjectStoreAllReduce needs the fsspec adapter for {proto}:// to reach {uri!r}, and it is not installed "
            f"({exc}). Install it beside composer-replication: `pip install {package}`"
            + (" (or `pip install -e .[s3]`)." if package == "s3fs" else ".")) from exc
    except ValueError as exc:
        raise ValueError(f"fsspec does not know the protocol {proto!r} of {uri!r} ({exc}); use file://, memory://, "
                         "s3:// or another protocol listed by fsspec.available_protocols()") from exc
    return fs, root.rstrip("/")


def explain_access_error(exc: BaseException, uri: str) -> StoreAccessError | None:
    """A ``StoreAccessError`` saying where credentials come from, or ``None`` when ``exc`` is no credentials error."""
    chain, e = [], exc
    while e is not None and e not in chain and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(str(e) for e in chain)
    if not ({type(e).__name__ for e in chain} & _CREDENTIAL_ERRORS or isinstance(exc, PermissionError)
            or "credentials" in text.lower() or "AccessDenied" in text):
        return None
    proto = {"gcs": "gs"}.get(protocol_of(uri), protocol_of(uri))
    hint = _HINTS.get(proto, "provide the store's credentials through its usual environment variables")
    return StoreAccessError(f"the store at {uri!r} refused access ({type(exc).__name__}: {exc}); {hint}")



def encode_tensors(tensors: Sequence[torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """Serialise ``tensors`` (any shapes, dtypes of ``_DTYPES``, any device) behind a header holding ``meta``."""
    bodies = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
              for t in tensors]
    specs = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": len(raw)}
             for t, raw in zip(tensors, bodies)]
    body = b"".join(bodies)
    header = dict(meta, tensors=specs, body_nbytes=len(body), sha256=hashlib.sha256(body).hexdigest())
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head + body


def _check_header(header: Any) -> list[tuple[torch.dtype, list[int], int]]:
    """``(dtype, shape, nbytes)`` per tensor of a header, or ``CorruptObjectError`` naming what is wrong."""
    if not isinstance(header, dict):
        raise CorruptObjectError(f"header is a JSON {type(header).__name__}, not an object")
    specs, total = header.get("tensors"), header.get("body_nbytes")
    if not isinstance(specs, list) or not _is_int(total) or not isinstance(header.get("sha256"), str):
        raise CorruptObjectError("header lacks 'tensors' (a list), 'body_nbytes' (an int) or 'sha256' (a string)")
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or spec.get("dtype") not in _DTYPES:
            raise CorruptObjectError(f"tensor {i}: dtype must be one of {sorted(_DTYPES)}")
        shape, nbytes, dtype = spec.get("shape"), spec.get("nbytes"), _DTYPES[spec["dtype"]]
        if (not isinstance(shape, list) or len(shape) > 32 or not all(_is_int(d) and d >= 0 for d in shape)
                or not _is_int(nbytes)):
            raise CorruptObjectError(f"tensor {i}: shape must be a list of at most 32 ints >= 0 and nbytes an int")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise CorruptObjectError(f"tensor {i}: nbytes {nbytes} != numel x itemsize of {spec['dtype']}{shape}")
        out.append((dtype, shape, nbytes))
    if sum(n for *_, n in out) != total:
        raise CorruptObjectError(f"the tensors' nbytes do not add up to body_nbytes {total}")
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def decode_tensors(data: bytes, expect: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Parse an object written by :func:`encode_tensors`: ``(header, tensors)``.

    Raises:
        CorruptObjectError: truncated, bad magic, a header that fails the schema (dict, known dtypes, ``nbytes ==
            numel * itemsize``, shapes of ints >= 0), a body whose length or SHA-256 differs (half-written), or
            ``expect`` keys (launch, round, rank) that differ (stale or foreign).
    """
    start = len(MAGIC) + _LEN.size
    if not data.startswith(MAGIC) or len(data) < start:
        raise CorruptObjectError(f"not an allreduce object ({len(data)} bytes, bad magic or truncated)")
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    if hlen > min(_MAX_HEADER, len(data) - start):
        raise CorruptObjectError(f"header length {hlen} exceeds the object (half-written)")
    try:
        header = json.loads(data[start:start + hlen])
    except (ValueError, RecursionError) as exc:
        raise CorruptObjectError(f"header is truncated or not JSON ({type(exc).__name__})") from None
    specs = _check_header(header)
    body = data[start + hlen:]
    if len(body) != header["body_nbytes"]:
        raise CorruptObjectError(f"body has {len(body)} bytes, header says {header['body_nbytes']} (half-written)")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise CorruptObjectError("body SHA-256 does not match its header (half-written or corrupted)")
    for key, value in expect.items():
        if header.get(key) != value:
            raise CorruptObjectError(f"object belongs to {key}={str(header.get(key))[:40]!r}, expected {value!r} (stale)")
    tensors, offset = [], 0
    for dtype, shape, nbytes in specs:
        chunk = bytearray(body[offset:offset + nbytes])
        offset += nbytes
        flat = torch.frombuffer(chunk, dtype=torch.uint8) if chunk else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(shape))
    return header, tensors



def is_local(fs: Any) -> bool:
    """True for fsspec's local file system (where rename and hard links are atomic)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def _local_tmp(fs: Any, path: str, data: bytes) -> str:
    fs.makedirs(fs._parent(path), exist_ok=True)
    tmp = f"{fs._parent(path)}/.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
    return tmp


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` so that no reader sees a partial object (local: temporary + rename; stores: one PUT)."""
    if is_local(fs):
        os.replace(_local_tmp(fs, path, data), path)
    else:
        fs.pipe_file(path, data)


def create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist yet; True when this call created it.

    Atomic on local disks (hard link), on S3 (``If-None-Match``) and in memory://; other stores fall back to
    fsspec's ``mode="create"`` (check, then write).
    """
    if is_local(fs):
        tmp = _local_tmp(fs, path, data)
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
    """The control object at ``path``; ``None`` when absent, incomplete, deeper than JSON allows, or not an object."""
    fs.invalidate_cache(fs._parent(path))  # a cached listing would hide a key created since
    try:
        data = fs.cat_file(path)
        value = json.loads(data[:_MAX_HEADER])
    except (FileNotFoundError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and value.get("complete") is True else None


def dump_json(value: Mapping[str, Any]) -> bytes:
    """Encode a small control object; :func:`read_json` accepts it only with ``complete: true``."""
    return json.dumps(dict(value, complete=True), sort_keys=True).encode()


def listing(fs: Any, folder: str) -> set[str]:
    """Names in ``folder`` (empty when it does not exist), never from a cached listing."""
    fs.invalidate_cache(folder)
    try:
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)}
    except FileNotFoundError:
        return set()
    finally:  # s3fs answers reads of unlisted keys from a cached listing: never keep one
        fs.invalidate_cache(folder)
