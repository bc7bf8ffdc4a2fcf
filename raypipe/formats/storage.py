"""Where shards live: the local disk, or object storage (``s3://``, ``gs://``, any fsspec URI).

```
 driver: Storage.for_source(source, storage_options) → list, size, count (ranged reads)
   ▼ the Storage object is pickled into every preprocessing actor (a pyarrow FileSystem)
 actor: Storage.open(uri) → a buffered, seekable file: tar members and Parquet row groups
        are read with ranged reads, never the whole object at once
```

Credentials and endpoints come from the usual places: the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``; ``GOOGLE_APPLICATION_CREDENTIALS``),
the filesystem's own config files, or ``PipelineConfig.storage_options``. Every remote call
has a timeout and a bounded number of retries, so a wrong endpoint or missing credentials
fail the listing, before any Ray work starts, with one line naming the URI and the cause.
"""

from __future__ import annotations

import glob as globlib
import io
import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any

from raypipe.formats.globs import globbed, hidden_below, local_files

__all__ = ["Storage", "StorageError", "is_remote"]
assert __all__ == sorted(__all__)

READ_BUFFER = 1 << 20  # bytes per ranged read of a remote file
S3_ALIASES = {  # s3fs / boto3 spellings → pyarrow.fs.S3FileSystem's
    "key": "access_key", "secret": "secret_key", "token": "session_token",
    "endpoint_url": "endpoint_override", "region_name": "region",
}  # fmt: skip
S3_DEFAULTS = {"connect_timeout": 10.0, "request_timeout": 60.0}
S3_ATTEMPTS = 3


class StorageError(ValueError):
    """A source that cannot be listed or read: the URI and the cause, on one line."""


def is_remote(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() != "file"


class Storage:
    """The file system of one source: local (``fs`` None) or a ``pyarrow.fs.FileSystem``.

    Paths in and out are what the user wrote: local paths, or full URIs
    (``s3://bucket/key``) so that error reports and skip records name them as such.
    """

    def __init__(self, fs=None, scheme: str = "", options: Mapping[str, Any] | None = None):
        self.fs, self.scheme, self._options = fs, scheme, dict(options or {})

    @property
    def remote(self) -> bool:
        return self.fs is not None

    @classmethod
    def for_source(cls, source: str | tuple[str, ...], options: Mapping[str, Any] | None = None):
        items = [source] if isinstance(source, str) else list(source)
        schemes = {i.partition("://")[0].lower() if is_remote(i) else "" for i in items}
        if len(schemes) > 1:
            raise ValueError(f"PipelineConfig.source mixes storages {sorted(schemes)}: {items!r}")
        scheme = schemes.pop()
        if not scheme:
            if options:
                raise ValueError(f"storage_options (--storage-option on raypipe inspect) are "
                                 f"for remote sources only; {items[0]!r} is local")  # fmt: skip
            return cls()
        try:
            return cls(_filesystem(scheme, dict(options or {})), scheme, options)
        except (TypeError, ValueError, ImportError, OSError) as e:
            raise StorageError(
                f"{items[0]}: cannot set up {scheme}:// storage: {_line(e)}"
            ) from None

    # -- paths ----------------------------------------------------------------------

    def _path(self, uri: str) -> str:
        return uri.split("://", 1)[1] if "://" in uri else uri

    def _uri(self, path: str) -> str:
        return f"{self.scheme}://{path}" if self.remote else path

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    # -- reading ----------------------------------------------------------------------

    def open(self, uri: str):
        """A seekable binary file; remote files are read in ``READ_BUFFER`` ranges."""
        if not self.remote:
            return open(uri, "rb")
        return io.BufferedReader(self.fs.open_input_file(self._path(uri)), READ_BUFFER)

    def open_arrow(self, uri: str):
        """What pyarrow readers take: the local path, or a random-access remote file (and a
        local file whose name is not UTF-8, which pyarrow cannot take as a path: open)."""
        if self.remote:
            return self.fs.open_input_file(self._path(uri))
        if not any("\udc80" <= c <= "\udcff" for c in uri):
            return uri
        from pyarrow import PythonFile  # a name os.fsdecode() escaped (Latin-1 bytes, say)

        return PythonFile(open(uri, "rb"), mode="r")

    def read_bytes(self, uri: str) -> bytes:
        if not self.remote:
            with open(uri, "rb") as f:
                return f.read()
        with self.fs.open_input_stream(self._path(uri)) as f:
            return f.read()

    def size(self, uri: str) -> int:
        if not self.remote:
            return os.path.getsize(uri)
        return self.fs.get_file_info(self._path(uri)).size

    def stat(self, uri: str) -> tuple[int, int | None]:
        """``(size, modification time in ns)``: a file's identity for the decoded cache; the
        time is None where the filesystem keeps none (some fsspec ones: HTTP, memory)."""
        if not self.remote:
            st = os.stat(uri)
            return st.st_size, st.st_mtime_ns
        info = self.fs.get_file_info(self._path(uri))
        if info.size is None:
            raise OSError(f"{uri}: not a file")
        return info.size, info.mtime_ns

    # -- listing (driver side; errors name the URI) ---------------------------------

    def expand(self, source: str | tuple[str, ...]) -> list[str]:
        """Every item of ``source`` that exists (a glob matches at least one path)."""
        items = [source] if isinstance(source, str) else list(source)
        out: list[str] = []
        for item in items:  # fsspec's file:///abs/path is the local /abs/path
            item = item[7:] if not self.remote and item[:7].lower() == "file://" else item
            if globlib.has_magic(item) and self.kind(item) is None:  # "Data [v2]/": a path
                matched = self._glob(item)
                if not matched:
                    raise ValueError(f"PipelineConfig.source: glob {item!r} matches nothing")
                out.extend(matched)
            elif self.kind(item) is not None:
                out.append(item.rstrip("/") if self.remote else item)
            else:
                raise ValueError(f"PipelineConfig.source: path {item!r} does not exist")
        return out

    def kind(self, uri: str) -> str | None:
        """``"file"``, ``"dir"``, or None when nothing is there."""
        if not self.remote:
            return "dir" if os.path.isdir(uri) else "file" if os.path.exists(uri) else None
        import pyarrow.fs as pafs

        info = self._call(uri, self.fs.get_file_info, self._path(uri).rstrip("/"))
        if info.type == pafs.FileType.Directory:
            return "dir"
        return "file" if info.type == pafs.FileType.File else None

    def walk(self, root: str, *, hidden: bool = False) -> Iterator[str]:
        """Every file under ``root``, recursively, sorted as whole paths; those below a name
        with a dot first (``.cache/``, ``._a.tar``) only with ``hidden``, as a glob does."""
        files = sorted(self._files(root)) if self.remote else sorted(local_files(root))
        yield from (f for f in files if hidden or not hidden_below(root, f))

    def _files(self, root: str) -> Iterator[str]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self._path(root).rstrip("/"), recursive=True)
        infos = self._call(root, self.fs.get_file_info, selector)
        return (self._uri(i.path) for i in infos if i.type == pafs.FileType.File)

    def first_files(self, root: str, count: int) -> list[str]:
        """The first ``count`` files of `walk` (``root``), listing one folder at a time: a
        remote source's format is seen without listing all of it (10⁵ objects take a
        minute on a loopback S3 server)."""
        if not self.remote:
            return list(itertools.islice(self.walk(root), count))
        import pyarrow.fs as pafs

        found: list[str] = []

        def visit(path: str) -> None:  # folders in walk's order: "a.tar" < "a/" as paths
            infos = self._call(root, self.fs.get_file_info, pafs.FileSelector(path))
            kind = pafs.FileType.Directory
            shown = [i for i in infos if not i.base_name.startswith(".")]  # as `walk` lists
            for i in sorted(shown, key=lambda i: i.path + ("/" if i.type == kind else "")):
                if len(found) >= count:
                    return
                if i.type == pafs.FileType.File:
                    found.append(self._uri(i.path))
                elif i.type == kind:
                    visit(i.path)

        visit(self._path(root).rstrip("/"))
        return found

    def dirs(self, root: str) -> list[str]:
        """The names of ``root``'s sub-folders, sorted (hidden ones left out)."""
        if not self.remote:
            names = [e.name for e in os.scandir(root) if e.is_dir()]
        else:
            import pyarrow.fs as pafs

            infos = self._call(root, self.fs.get_file_info, pafs.FileSelector(self._path(root)))
            names = [i.base_name for i in infos if i.type == pafs.FileType.Directory]
        return sorted(n for n in names if not n.startswith("."))

    def _glob(self, pattern: str) -> list[str]:
        if not self.remote:
            return sorted(globlib.glob(pattern, recursive=True))
        head = pattern[: min(pattern.index(c) for c in "*?[" if c in pattern)]
        root = head.rsplit("/", 1)[0]
        return globbed(self.walk(root, hidden=True), pattern)

    def _call(self, uri: str, fn, *args):
        try:
            return fn(*args)
        except (OSError, ValueError) as e:
            raise StorageError(f"{uri}: {_line(e)}{self._hint()}") from None

    def _hint(self) -> str:
        if self.scheme != "s3" or self._options.get("anonymous"):
            return ""
        keys = ("access_key", "key", "AWS_ACCESS_KEY_ID", "AWS_PROFILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE")  # fmt: skip
        seen = any(k in self._options or k in os.environ for k in keys)
        if seen or os.path.exists(os.path.expanduser("~/.aws/credentials")):
            return ""
        return (" (no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "storage_options access_key/secret_key, or anonymous: true for a public bucket)")  # fmt: skip

    def __eq__(self, other) -> bool:  # the same scheme and settings: the same storage
        return (
            isinstance(other, Storage)
            and self.scheme == other.scheme
            and (self._options == other._options)
        )

    def __hash__(self) -> int:
        return hash((self.scheme, tuple(sorted(self._options))))

    def __reduce__(self):
        return (Storage, (self.fs, self.scheme, self._options))

    def __repr__(self) -> str:
        return f"Storage({self.scheme or 'local'})"


def _filesystem(scheme: str, options: dict[str, Any]):
    import pyarrow.fs as pafs

    if scheme == "s3":
        opts = {S3_ALIASES.get(k, k): v for k, v in options.items()}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_override" not in opts:
            opts["endpoint_override"] = endpoint
        url = opts.get("endpoint_override") or ""
        if "://" in url:  # pyarrow wants the scheme apart from the host
            opts.setdefault("scheme", url.split("://", 1)[0])
            opts["endpoint_override"] = url.split("://", 1)[1].rstrip("/")
        if (
            "access_key" not in opts
            and not opts.get("anonymous")
            and os.environ.get("AWS_ACCESS_KEY_ID")
        ):
            # resolved here, on the driver, so that actors on other nodes use the same keys
            opts["access_key"] = os.environ["AWS_ACCESS_KEY_ID"]
            opts["secret_key"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
            if os.environ.get("AWS_SESSION_TOKEN"):
                opts["session_token"] = os.environ["AWS_SESSION_TOKEN"]
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region and "region" not in opts:
            opts["region"] = region
        for k, v in S3_DEFAULTS.items():
            opts.setdefault(k, v)
        attempts = opts.pop("max_attempts", S3_ATTEMPTS)
        opts.setdefault("retry_strategy", pafs.AwsStandardS3RetryStrategy(max_attempts=attempts))
        return pafs.S3FileSystem(**opts)
    if scheme in ("gs", "gcs"):
        import datetime

        opts = dict(options)
        opts.setdefault("retry_time_limit", datetime.timedelta(seconds=30))
        return pafs.GcsFileSystem(**opts)
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return PyFileSystem(FSSpecHandler(fsspec.filesystem(scheme, **options)))


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + " ..."
