"""Sources in object storage: a real S3-protocol server (moto's, with IAM auth enforced) on
127.0.0.1, started and stopped by these tests; shards uploaded from the local fixtures are
read back through Ray exactly once, with the same keys and labels as the local copy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from raypipe import Pipeline, PipelineConfig
from raypipe.cli import main
from raypipe.formats.storage import Storage, StorageError
from raypipe.plan.shards import list_shards
from tests.conftest import make_parquet

BUCKET = "raypipe-test"
POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(datasets, tmp_path_factory):
    """moto's S3 server on loopback with credentials enforced: the first three requests
    (creating a user, its policy and its key) are the only unauthenticated ones."""
    import boto3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto server did not start on {url}") from None
                time.sleep(0.2)
        anon = {"endpoint_url": url, "region_name": "us-east-1",
                "aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}  # fmt: skip
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="raypipe")
        iam.put_user_policy(UserName="raypipe", PolicyName="s3", PolicyDocument=POLICY)
        key = iam.create_access_key(UserName="raypipe")["AccessKey"]
        creds = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}  # fmt: skip
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **creds)
        client.create_bucket(Bucket=BUCKET)
        for fmt, root in datasets.items():
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    client.upload_file(str(path), BUCKET, f"{fmt}/{path.relative_to(root)}")
        yield {
            "url": url,
            "options": {"endpoint_url": url, "region": "us-east-1",
                        "access_key": key["AccessKeyId"], "secret_key": key["SecretAccessKey"]},
        }  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def keys_and_labels(config: PipelineConfig) -> dict[int, int]:
    seen: dict[int, int] = {}
    with Pipeline(config, epochs=1, device="cpu", normalize=False) as pipe:
        for _, batches in pipe.epochs():
            for b in batches:
                for k, label in zip(b["key"].tolist(), b["label"].tolist(), strict=True):
                    assert k not in seen, f"key {k} twice"
                    seen[k] = label
    return seen


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset", "parquet"])
def test_s3_source_reads_exactly_once_with_the_local_keys(ray_session, datasets, s3, fmt):
    local = PipelineConfig(source=str(datasets[fmt]), image_size=8, batch_size=4, actors=(1, 1),
                           shuffle_files=False)  # fmt: skip
    remote = local.replace(source=f"s3://{BUCKET}/{fmt}/", storage_options=s3["options"])
    a, b = list_shards(local), list_shards(remote)
    assert b.reader.storage.remote and b.format == fmt
    assert [s.path.split(f"{fmt}/", 1)[1] for s in b.shards] == [
        os.path.relpath(s.path, datasets[fmt]) for s in a.shards
    ]
    assert [(s.first_key, s.num_samples, s.label) for s in b.shards] == [
        (s.first_key, s.num_samples, s.label) for s in a.shards
    ]
    assert b.classes == a.classes
    got, want = keys_and_labels(remote), keys_and_labels(local)
    assert got == want and len(got) == a.num_samples // 4 * 4


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset"])
def test_first_files_are_the_walks_first_without_listing_all(s3, fmt):
    storage = Storage.for_source(f"s3://{BUCKET}/", s3["options"])
    root = f"s3://{BUCKET}/{fmt}"
    walked = list(storage.walk(root))
    for count in (1, 3, len(walked) + 1):
        assert storage.first_files(root, count) == walked[:count]


def test_credentials_from_the_environment(monkeypatch, s3):
    opts = s3["options"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret_key"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["url"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    listing = list_shards(PipelineConfig(source=f"s3://{BUCKET}/parquet/"))
    assert listing.num_samples == 61


@pytest.mark.parametrize(
    "case, options, cause",
    [
        ("wrong secret", {"secret_key": "not-the-secret"}, "ACCESS_DENIED"),
        ("unknown key", {"access_key": "AKIANOTAKEY", "secret_key": "x"}, "ACCESS_DENIED"),
        ("no credentials", {"access_key": None, "secret_key": None}, "NO S3 CREDENTIALS FOUND"),
        ("unreachable endpoint", {"endpoint_url": "CLOSED"}, "NETWORK_CONNECTION"),
    ],
)
def test_bad_storage_fails_before_ray_work_in_one_line(monkeypatch, tmp_path, s3, case, options,
                                                      cause):  # fmt: skip
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask a metadata server
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws of the machine's
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    opts = {**s3["options"], **options}
    opts = {k: v for k, v in opts.items() if v is not None}
    if opts["endpoint_url"] == "CLOSED":
        opts["endpoint_url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    uri = f"s3://{BUCKET}/parquet/"
    config = PipelineConfig(source=uri, storage_options=opts)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        Pipeline(config, epochs=1)  # lists on the driver before it starts any Ray work
    message = str(e.value)
    assert message.startswith(uri.rstrip("/")) and cause in message.upper(), message
    assert "\n" not in message and time.monotonic() - t0 < 30


def test_inspect_an_s3_source(s3, capsys):
    args = [f"--storage-option={k}={v}" for k, v in s3["options"].items()]
    assert main(["inspect", f"s3://{BUCKET}/webdataset/", *args, "--samples", "6"]) == 0
    out = capsys.readouterr().out
    assert "webdataset (inferred)" in out and "s3://" in out and "6 good" in out
    assert main(["inspect", f"s3://{BUCKET}/nothing-here/", *args]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_any_fsspec_uri(datasets):
    """A protocol pyarrow has no file system of its own for goes through fsspec (here its
    in-memory one, in this process): listed and read with the local copy's keys."""
    import fsspec

    from raypipe.plan.shards import Reader

    mem = fsspec.filesystem("memory")
    for path in sorted(datasets["webdataset"].glob("*.tar")):
        mem.pipe(f"/wds/{path.name}", path.read_bytes())
    local = list_shards(PipelineConfig(source=str(datasets["webdataset"])))
    remote = list_shards(PipelineConfig(source="memory://wds"))
    assert isinstance(remote.reader, Reader) and remote.reader.storage.scheme == "memory"
    assert [s.num_samples for s in remote.shards] == [s.num_samples for s in local.shards]
    a = [
        (r.key, r.label, r.data)
        for s in local.shards
        for r in local.reader.read(s.path, s.first_key, -1)
    ]
    b = [
        (r.key, r.label, r.data)
        for s in remote.shards
        for r in remote.reader.read(s.path, s.first_key, -1)
    ]
    assert a == b and len(a) == 61


RESETS = {"left": 0, "path": ""}  # the flaky store's connection resets still to come


def _flaky_store():
    """fsspec's in-memory store whose opens of ``RESETS["path"]`` reset the connection
    ``RESETS["left"]`` times first, as a store does when its own retries are spent."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Flaky(MemoryFileSystem):
        protocol = ("flaky",)
        store, pseudo_dirs = MemoryFileSystem.store, MemoryFileSystem.pseudo_dirs

        def _open(self, path, *args, **kwargs):
            if RESETS["left"] > 0 and path.endswith(RESETS["path"]):
                RESETS["left"] -= 1
                raise ConnectionResetError(104, "Connection reset by peer")
            return super()._open(path, *args, **kwargs)

    fsspec.register_implementation("flaky", Flaky, clobber=True)
    return fsspec.filesystem("memory")


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord", "parquet"])
def test_a_reset_connection_while_counting_a_shard_is_tried_again_or_fails_the_listing(
    datasets, fmt, monkeypatch, tmp_path
):
    """A connection reset while the driver counted a shard made it one unreadable sample:
    the rest of a shard that read fine later was dropped, unsaid, and every later key
    moved. It is tried again; a store that keeps failing fails the listing, naming it."""
    from raypipe.formats import pieces
    from raypipe.formats.tfexample import encode_example, frame

    monkeypatch.setattr(pieces, "LIST_RETRY_S", 0.0, raising=False)
    if fmt == "tfrecord":
        for name, n in (("a.tfrecord", 5), ("b.tfrecord", 3)):
            records = (frame(encode_example({"image": b"x" * k, "label": k})) for k in range(n))
            (tmp_path / name).write_bytes(b"".join(records))
    source = tmp_path if fmt == "tfrecord" else datasets[fmt]
    files = sorted(p for p in source.iterdir() if not p.name.endswith(".json"))
    mem = _flaky_store()
    for path in files:
        mem.pipe(f"/flaky-{fmt}/{path.name}", path.read_bytes())
    config = PipelineConfig(source=f"flaky:///flaky-{fmt}", format=fmt)
    RESETS.update(left=99, path=files[0].name)
    with pytest.raises(
        StorageError, match=rf"{files[0].name}: ConnectionResetError.*cannot be listed"
    ):
        list_shards(config)
    RESETS.update(left=1, path=files[0].name)
    local = list_shards(PipelineConfig(source=str(source), format=fmt))
    assert [s.num_samples for s in list_shards(config).shards] == [
        s.num_samples for s in local.shards
    ]
    assert RESETS["left"] == 0  # the reset met, and tried again
    mem.rm(f"/flaky-{fmt}", recursive=True)


@pytest.mark.parametrize(
    "pattern",
    ["*.tar", "**/*.tar", "s-[0-1].tar", "?-1.tar", "*/*.tar", "o*", "*", "s-[!0].tar", "**",
     ".*.tar", ".cache/*.tar", "[.s]*", "old/**", "s**", "o**", "**.tar", "old/**.tar", "*/",
     "old/*/"],
)  # fmt: skip
def test_a_glob_on_object_storage_matches_what_it_matches_locally(tmp_path, pattern):
    """``*`` stays within a folder, ``**`` crosses them (as a whole part of the path; inside
    a name it is one ``*``), a matched folder gives its files, a pattern ending in ``/``
    matches folders only, and a hidden name (macOS's ``._`` files, a ``.cache`` folder) only
    where the pattern names it: the same shards, so the same keys, as in a local copy."""
    import fsspec

    mem = fsspec.filesystem("memory")
    for name in ("s-0.tar", "s-1.tar", "s-2.tar", "old/s-1.tar", "old/deep/x.tar", "._s-0.tar",
                 ".cache/s-9.tar", "old/._x.tar", "old/.deep/y.tar"):  # fmt: skip
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(b"x")
        mem.pipe(f"/globs/{name}", b"x")

    def shards(root: str) -> list[str]:
        listing = list_shards(PipelineConfig(source=f"{root}/{pattern}", format="webdataset"))
        return [s.path.removeprefix(f"{root}/") for s in listing.shards]

    assert shards(str(tmp_path / "local")) == shards("memory:///globs")


def test_a_file_uri_lists_the_local_folder(datasets):
    """``file:///abs/path``, fsspec's spelling of a local path, was refused as a path that
    does not exist."""
    local = list_shards(PipelineConfig(source=str(datasets["webdataset"])))
    uri = list_shards(PipelineConfig(source=f"file://{datasets['webdataset']}"))
    assert [(s.path, s.num_samples) for s in uri.shards] == [
        (s.path, s.num_samples) for s in local.shards
    ]


def test_a_folders_hidden_files_are_not_shards_locally_or_remotely(tmp_path):
    """A directory source lists what a glob of it would: no macOS ``._`` file, nothing
    under a download's ``.cache/`` (which, sorted first, also hid the format from the
    files it is inferred from), here and on object storage alike."""
    import fsspec

    from raypipe.formats import infer_format

    mem = fsspec.filesystem("memory")
    src = make_parquet(tmp_path / "src", [3, 4])
    names = {f"data/{p.name}": p.read_bytes() for p in sorted(src.glob("*.parquet"))}
    for i in range(70):  # what a --local-dir download keeps beside every file
        names[f".cache/huggingface/download/data/f{i}.parquet.metadata"] = b"x"
    names["data/._" + sorted(names)[-1].split("/")[-1]] = b"\0\5\26\7"  # AppleDouble
    for name, data in names.items():
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(data)
        mem.pipe(f"/hidden/{name}", data)
    for root in (str(tmp_path / "local"), "memory:///hidden"):
        config = PipelineConfig(source=root)
        listing = list_shards(config)
        got = [s.path.removeprefix(f"{root}/") for s in listing.shards]
        assert got == ["data/" + p.name for p in sorted(src.glob("*.parquet"))], root
        assert listing.num_samples == 7
        assert infer_format([root], Storage.for_source(root)) == "parquet"


def test_a_folder_whose_name_looks_like_a_glob_is_the_folder(tmp_path):
    """``Dataset [v2]/`` exists: it is the source, not a glob of ``Dataset v/`` or
    ``Dataset 2/`` (which, present too, would have been read instead)."""
    src = make_parquet(tmp_path / "Dataset [v2]", [3, 4])
    make_parquet(tmp_path / "Dataset v", [5])
    assert list_shards(PipelineConfig(source=str(src))).num_samples == 7
    assert list_shards(PipelineConfig(source=str(src / "part-00001.parquet"))).num_samples == 4
    # a glob is still a glob where no path has its name
    assert list_shards(PipelineConfig(source=str(tmp_path / "Dataset [v]"))).num_samples == 5


def test_a_storage_options_value_is_json_or_the_string_as_written(tmp_path, capsys):
    """``--storage-option`` values were read as YAML: a secret ``0777`` reached the file
    system as 511, ``NO`` as False, ``a #b`` as 'a', and ``[b`` ended in a traceback."""
    import fsspec

    from raypipe.cli.app import _key_value

    got = dict(map(_key_value, ["a=true", "b=30", "c=0777", "d=NO", "e=ab #cd", "f=[b", "g=",
                                "h=2024-01-02", 'i="12"', "j=x=y"]))  # fmt: skip
    assert got == {"a": True, "b": 30, "c": "0777", "d": "NO", "e": "ab #cd", "f": "[b", "g": "",
                   "h": "2024-01-02", "i": "12", "j": "x=y"}  # fmt: skip
    src = make_parquet(tmp_path / "src", [3])
    fsspec.filesystem("memory").pipe("/kv/a.parquet", (src / "part-00000.parquet").read_bytes())
    assert main(["inspect", "memory:///kv/", "--storage-option", "secret=[b"]) == 0
    assert "3 good" in capsys.readouterr().out
