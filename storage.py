"""Object storage (s3:// and the like): where its settings come from, and one-line errors.

Three libraries reach the store, and each is handed the same settings:

- LanceDB (tables), through `connect`: it reads the standard AWS environment variables
  itself (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`/`AWS_DEFAULT_REGION`,
  `AWS_ENDPOINT_URL`/`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`); `--storage-option KEY=VALUE`
  adds LanceDB storage options on top. Loader worker processes reopen the table with
  the options of its connection (lancedb pickles them), so they see the same store.
- pyarrow (manifests, Parquet blocks), through `filesystem`.
- boto3 inside MosaicML streaming, through `export_for_boto3`, which puts the
  resolved endpoint and keys into the environment that boto3 reads.

`connect_table` opens the corpus table (local or remote) and checks it has what training
reads. `configure` is called once by each entrypoint with its `--storage-option` flags.
Requests are bounded (a few retries, request timeouts), so a store that cannot be
reached fails the run with one line instead of hanging it.
"""

from __future__ import annotations

import functools
import os
import re
from urllib.parse import urlparse

from common import TRAIN_COLUMNS, UserError, is_remote

# Bounded by default: lance's own default retry budget is 180 s per request.
LANCE_DEFAULTS = {"client_max_retries": "3", "client_retry_timeout": "60", "connect_timeout": "10s",
                  "timeout": "60s"}
ARROW_CONNECT_TIMEOUT_S, ARROW_REQUEST_TIMEOUT_S, ARROW_MAX_ATTEMPTS = 10.0, 60.0, 3
PROBE_TIMEOUT_S = 10.0  # per attempt of the one request that checks the endpoint and bucket

# Option names -> the settings pyarrow and boto3 need; LanceDB's own names, aliases included.
_ALIASES = {
    "access_key_id": ("aws_access_key_id", "access_key_id"),
    "secret_access_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "session_token", "aws_token", "token"),
    "region": ("aws_region", "region", "aws_default_region"),
    "endpoint": ("aws_endpoint", "endpoint", "aws_endpoint_url", "endpoint_url"),
    "allow_http": ("aws_allow_http", "allow_http"),
}
_ENV = {
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "allow_http": ("AWS_ALLOW_HTTP",),
}

_flags: dict[str, str] = {}


def parse_storage_options(pairs: list[str] | None) -> dict[str, str]:
    """`--storage-option KEY=VALUE` flags -> a dict (a later KEY wins)."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--storage-option takes KEY=VALUE (got {pair!r}), e.g. "
                            f"--storage-option aws_endpoint=http://127.0.0.1:9000")
        options[key.strip().lower()] = value
    return options


def configure(pairs: list[str] | None) -> None:
    """Set this process's `--storage-option` flags (each entrypoint calls it once)."""
    global _flags
    _flags = parse_storage_options(pairs)
    export_for_boto3()


def add_argument(parser) -> None:
    """The one `--storage-option` flag every entrypoint that reaches a store takes."""
    parser.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for s3:// and other object-store URIs, repeatable, e.g. "
        "aws_endpoint=http://host:9000 allow_http=true; the AWS_* environment variables "
        "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) are read too, these win over them")


def lance_options() -> dict[str, str]:
    """Storage options for lancedb.connect: bounded retries, then the flags. An http://
    endpoint is allowed plain http, as pyarrow and boto3 allow it."""
    options = {**LANCE_DEFAULTS, **_flags}
    if (endpoint_url() or "").startswith("http://") and setting("allow_http") is None:
        options["allow_http"] = "true"
    return options


def setting(name: str) -> str | None:
    """One resolved setting ('endpoint', 'region', ...): a flag, else the environment."""
    for key in _ALIASES[name]:
        if key in _flags:
            return _flags[key]
    for var in _ENV[name]:
        if os.environ.get(var):
            return os.environ[var]
    return None


def endpoint_url() -> str | None:
    """The endpoint as a URL with its scheme (AWS_ENDPOINT may be a bare host:port)."""
    endpoint = setting("endpoint")
    if not endpoint or "://" in endpoint:
        return endpoint
    allow_http = (setting("allow_http") or "").lower() in ("1", "true", "yes")
    return f"{'http' if allow_http else 'https'}://{endpoint}"


def export_for_boto3() -> None:
    """Make boto3 (MosaicML's s3 client, in this process and the ones it starts) use the
    same endpoint and keys; MosaicML reads S3_ENDPOINT_URL, plain boto3 AWS_ENDPOINT_URL."""
    for name, var in (("access_key_id", "AWS_ACCESS_KEY_ID"),
                      ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                      ("session_token", "AWS_SESSION_TOKEN"), ("region", "AWS_DEFAULT_REGION")):
        value = setting(name)
        if value:
            os.environ[var] = value
    url = endpoint_url()
    if url:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = url
    os.environ.setdefault("AWS_MAX_ATTEMPTS", str(ARROW_MAX_ATTEMPTS))


def connect(uri: str):
    """lancedb.connect with this process's storage options; store failures are one line."""
    import lancedb  # deferred: importing lancedb costs ~1 s and `--help` should not pay it

    if not is_remote(uri):
        return lancedb.connect(uri)
    probe(uri)
    try:
        return lancedb.connect(uri, storage_options=lance_options())
    except Exception as e:
        raise UserError(describe(e, uri) or f"cannot open {uri!r}: {first_line(e)}") from None


def connect_table(db: str, table: str):
    """Open `table` in `db`, checking it has the columns training reads."""
    if not is_remote(db) and not os.path.isdir(db):
        raise UserError(
            f"no LanceDB database at {db!r}; create one with "
            f"`python prepare_data.py INPUT --db {db} --table {table}`"
        )
    conn = connect(db)
    try:
        tbl = conn.open_table(table)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UserError(describe(e, db) or (
            f"table {table!r} not found in {db!r} ({e}); create it with "
            f"`python prepare_data.py INPUT --db {db} --table {table}`")) from None
    schema = tbl.schema
    for name, (what, ok) in TRAIN_COLUMNS.items():
        if name not in schema.names:
            raise UserError(
                f"table {table!r} in {db!r} has no {name!r} column "
                f"(columns: {', '.join(schema.names)}); build it with prepare_data.py"
            )
        if not ok(schema.field(name).type):
            raise UserError(
                f"column {name!r} of table {table!r} is {schema.field(name).type}, "
                f"expected {what}"
            )
    return tbl


def filesystem(uri: str):
    """(pyarrow filesystem, path inside it) for a local path or an object-store URI
    (whose endpoint and bucket are probed first)."""
    import pyarrow.fs as pafs

    if not is_remote(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    parsed = urlparse(uri)
    if parsed.scheme not in ("s3", "s3a"):
        return pafs.FileSystem.from_uri(uri)
    probe(uri)
    return (_s3(ARROW_CONNECT_TIMEOUT_S, ARROW_REQUEST_TIMEOUT_S, ARROW_MAX_ATTEMPTS),
            f"{parsed.netloc}{parsed.path}".rstrip("/"))


def _s3(connect_timeout: float, request_timeout: float, max_attempts: int):
    """pyarrow's S3 filesystem with the resolved settings and bounded requests."""
    import pyarrow.fs as pafs

    kwargs = dict(connect_timeout=connect_timeout, request_timeout=request_timeout,
                  retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts))
    for name, arg in (("access_key_id", "access_key"), ("secret_access_key", "secret_key"),
                      ("session_token", "session_token"), ("region", "region")):
        if setting(name):
            kwargs[arg] = setting(name)
    url = endpoint_url()
    if url:
        endpoint = urlparse(url)
        kwargs.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
    return pafs.S3FileSystem(**kwargs)


@functools.cache
def probe(uri: str) -> None:
    """Ask the store for the URI's bucket once per process, with short timeouts, before
    the libraries' longer retries start: an endpoint that is down, silent or refuses us,
    and a bucket that does not exist, each end the run here in one line."""
    import pyarrow.fs as pafs

    parsed = urlparse(uri)
    if parsed.scheme not in ("s3", "s3a"):
        return
    try:
        found = _s3(PROBE_TIMEOUT_S, PROBE_TIMEOUT_S, 2).get_file_info(parsed.netloc).type \
            != pafs.FileType.NotFound
    except OSError as e:
        raise UserError(describe(e, uri) or f"cannot reach {uri!r}: {first_line(e)}") from None
    if not found:
        raise UserError(f"the bucket of {uri!r} does not exist at "
                        f"{endpoint_url() or 'the default AWS endpoint'}")


_KINDS = (
    (re.compile(r"NoSuchBucket|bucket does not exist", re.I), "the bucket of {uri!r} does not exist at {where}"),
    (re.compile(r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|ACCESS_DENIED|Forbidden|\b403\b", re.I),
     "the object store at {where} refused the credentials for {uri!r}; check AWS_ACCESS_KEY_ID / "
     "AWS_SECRET_ACCESS_KEY or --storage-option aws_access_key_id=..."),
    (re.compile(r"BadScheme"), "the endpoint {where} for {uri!r} is not https; allow plain http with "
     "AWS_ALLOW_HTTP=true or --storage-option allow_http=true"),
    (re.compile(r"timed out|Timeout was reached|Operation too slow|kind: Timeout|TimedOut|"
                r"deadline has elapsed", re.I),
     "the object store at {where} did not answer in time for {uri!r}"),
    (re.compile(r"tcp connect error|ConnectError|kind: Connect|NETWORK_CONNECTION|Could not connect|"
                r"resolve host|dns error|Connection refused|EndpointConnectionError", re.I),
     "cannot reach the object store at {where} for {uri!r}; check AWS_ENDPOINT_URL or "
     "--storage-option aws_endpoint=..."),
)


def describe(error: BaseException, uri: str) -> str | None:
    """A one-line explanation of an object-store failure, None when it is not one."""
    if not is_remote(uri):
        return None
    text = str(error)
    where = endpoint_url() or "the default AWS endpoint"
    for pattern, message in _KINDS:
        if pattern.search(text):
            return message.format(uri=uri, where=where)
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)
