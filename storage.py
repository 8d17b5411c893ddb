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

A LanceDB Cloud or Enterprise table (`db://NAME`) is reached through lancedb's remote
client instead, with the settings and errors of lancedb_cloud.py.

`connect_table` opens the corpus table (local or remote) and checks it has what training
reads. `configure` is called once by each entrypoint with its `--storage-option` flags.
Requests are bounded (a few retries, request timeouts), so a store that cannot be
reached fails the run with one line instead of hanging it.

The retry budget, in seconds, is lance's own `client_retry_timeout` option (60 here, lance's
default is 180): `--storage-option client_retry_timeout=SECONDS`. Lance retries each request
for at most that long. A read of a table takes many requests one after another, each retried
on its own, so a read could take many budgets to fail: the training loader reads through a
connection where lance does not retry (`unretried`) and retries each whole read itself
(`StoreRetry`), while the store fails as an unreachable store fails, until that many seconds
have passed since the first failure; then the run ends in one line (common.StorageFault), one
request later at most. `read_faults` turns what a damaged or missing table file, or such a
store, makes lance raise into that line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from urllib.parse import urlparse

import lancedb_cloud
from common import TRAIN_COLUMNS, StorageFault, UserError, is_remote

# Bounded by default: lance's own default retry budget is 180 s per request.
RETRY_OPTION = "client_retry_timeout"  # seconds: the retry budget (module docstring)
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
    if not lance_options()[RETRY_OPTION].isdigit():
        raise UserError(f"--storage-option {RETRY_OPTION}={_flags[RETRY_OPTION]}: the retry budget "
                        f"is a whole number of seconds")
    export_for_boto3()


def add_argument(parser) -> None:
    """The one `--storage-option` flag every entrypoint that reaches a store takes."""
    parser.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="LanceDB storage option for s3:// and other object-store URIs, repeatable, e.g. "
        "aws_endpoint=http://host:9000 allow_http=true; the AWS_* environment variables "
        "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) are read too, these win over them. "
        f"{RETRY_OPTION}=SECONDS is the retry budget (default {LANCE_DEFAULTS[RETRY_OPTION]}): "
        "how long a request, and each read of the training loader, is retried while the store "
        "cannot be reached, before the run ends (exit 3). For a db://NAME table: api_key=, "
        "host_override= and region= (or LANCEDB_API_KEY, LANCEDB_HOST_OVERRIDE, LANCEDB_REGION)")


def lance_options() -> dict[str, str]:
    """Storage options for lancedb.connect: bounded retries, then the flags. An http://
    endpoint is allowed plain http, as pyarrow and boto3 allow it."""
    options = {**LANCE_DEFAULTS, **_flags}
    if (endpoint_url() or "").startswith("http://") and setting("allow_http") is None:
        options["allow_http"] = "true"
    return options


def retry_budget_s() -> int:
    """The retry budget in seconds (--storage-option client_retry_timeout)."""
    return int(lance_options()[RETRY_OPTION])


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
    if lancedb_cloud.is_cloud(uri):
        return lancedb_cloud.connect(uri, _flags, int(lance_options()["client_max_retries"]))
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
        schema = tbl.schema
    except Exception as e:
        why = describe(e, db)
        if why is None and not isinstance(e, (ValueError, FileNotFoundError, OSError)):
            raise
        raise UserError(why or (
            f"table {table!r} not found in {db!r} ({first_line(e)}); create it with "
            f"`python prepare_data.py INPUT --db {db} --table {table}`")) from None
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
    if lancedb_cloud.is_cloud(uri):
        return lancedb_cloud.describe(error, uri, _flags)
    text = str(error)
    where = endpoint_url() or "the default AWS endpoint"
    for pattern, message in _KINDS:
        if pattern.search(text):
            return message.format(uri=uri, where=where)
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)


# What a store that cannot be reached (or is overloaded) makes lance and object_store raise:
# worth trying again. Anything else (a missing object, refused credentials) is not.
_UNREACHABLE = re.compile(
    r"error sending request|tcp connect error|ConnectError|kind: Connect|Connection refused|"
    r"connection (reset|closed)|broken pipe|timed out|Timeout was reached|kind: Timeout|TimedOut|"
    r"deadline has elapsed|status code: (429|50[0-4])|Service Unavailable|SlowDown", re.I)
_ENDPOINT = re.compile(r"\b(https?://[^/\s]+)/")
# What a missing or damaged table file makes lance raise (the table, not the store, is at fault).
_MISSING = re.compile(r"Not found|NotFound|NoSuchKey|does not exist", re.I)
_DAMAGED = re.compile(r"LanceError\(IO\)|corrupt|Lance storage version|failed to fill whole buffer|"
                      r"unexpected (eof|end of file)|out of range", re.I)
_DATA_FILE = re.compile(r"\bdata/[\w-]+\.lance\b")
LANCE_MAGIC = b"LANC"  # the last bytes of every complete Lance data file


class StoreGaveUp(Exception):
    """A read that kept failing as an unreachable store fails, for the whole retry budget."""

    def __init__(self, error: BaseException, seconds: float, budget_s: float):
        super().__init__(str(error))
        self.seconds, self.budget_s = seconds, budget_s


class StoreRetry:
    """Runs reads of one loader again while the store cannot be reached, until `budget_s`
    seconds have passed since the first failure that no success followed; then raises
    StoreGaveUp. The clock is shared by the loader's reads, so they give up together rather
    than one after another. Picklable, so loader worker processes get it with the dataset."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.failing_since: float | None = None

    def __call__(self, read):
        pause = 0.2
        while True:
            try:
                result = read()
            except Exception as e:
                if not unreachable(e):
                    raise
                now = time.monotonic()
                if self.failing_since is None:
                    self.failing_since = now
                left = self.failing_since + self.budget_s - now
                if left <= 0:
                    raise StoreGaveUp(e, now - self.failing_since, self.budget_s) from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, 5.0)
                continue
            self.failing_since = None
            return result


def unreachable(error: BaseException) -> bool:
    """Whether a read failed as an unreachable store (or LanceDB server) fails: worth trying again."""
    return bool(_UNREACHABLE.search(str(error))) or lancedb_cloud.unreachable(error)


def database(table) -> str:
    """The database URI `table` (a lancedb table) was opened from: a directory, s3://..., db://NAME."""
    db_name = getattr(table, "db_name", None)  # a remote table has no storage URI of its own
    return f"db://{db_name}" if db_name is not None else str(table.uri).rstrip("/").rpartition("/")[0]


def unretried(table):
    """`table` (a lancedb table, at its version) through a connection where lance makes each
    request once: StoreRetry retries the reads; a local table as it is."""
    db = database(table)
    if not is_remote(db):
        return table
    import lancedb

    if lancedb_cloud.is_cloud(db):
        conn = lancedb_cloud.connect(db, _flags, retries=0)
    else:
        conn = lancedb.connect(db, storage_options={**lance_options(), "client_max_retries": "0"})
    reopened = conn.open_table(table.name)
    reopened.checkout(table.version)
    return reopened


@contextlib.contextmanager
def read_faults(table):
    """Reads of `table` inside: a missing or damaged file, or a store that stays unreachable,
    ends the run in one line (StorageFault) instead of lance's traceback."""
    try:
        yield
    except Exception as e:
        fault = read_fault(e, table)
        if fault is None:
            raise
        raise fault from None


def read_fault(error: BaseException, table) -> StorageFault | None:
    """The StorageFault for an error lance raised reading `table` (a lancedb table), naming
    the table, its version and the file; None when the error is not a storage fault."""
    if isinstance(error, UserError):
        return None
    text, db = str(error), database(table)
    uri = f"{db}/{table.name}" if lancedb_cloud.is_cloud(db) else str(table.uri).rstrip("/")
    try:
        version = f"version {table.version} of "
    except Exception:  # the table may be as unreadable as its data
        version = ""
    what = f"cannot read {version}the table {table.name!r} in {db!r}"
    restore = ("restore the table's files from a backup or copy, or train a new run on an older "
               "version that does not use it (--data-version N)")
    if isinstance(error, StoreGaveUp) or (is_remote(uri) and unreachable(error)):
        found = _ENDPOINT.search(text)
        if lancedb_cloud.is_cloud(db):
            where = f"the LanceDB server at {lancedb_cloud.where(_flags)}"
        else:
            where = f"the object store at {found.group(1) if found else endpoint_url() or 'the default AWS endpoint'}"
        if isinstance(error, StoreGaveUp):
            waited, budget = f"for {error.seconds:.0f} s of retries", f"the retry budget is {error.budget_s:g} s"
        else:
            waited, budget = "after lance's retries", f"lance's retry budget per request is {retry_budget_s()} s"
        return StorageFault(f"{what}: {where} could not be reached {waited} ({budget}: "
                            f"--storage-option {RETRY_OPTION}=SECONDS); once it is back, continue "
                            f"with --resume auto")
    if is_remote(uri) and (why := describe(error, db)):
        return StorageFault(f"{what}: {why}")
    if lancedb_cloud.is_cloud(db):
        return None  # the server's files are its own: its errors stay lancedb's
    named = _DATA_FILE.search(text)
    if named and _MISSING.search(text):
        return StorageFault(f"{what}: its data file {named.group(0)} is missing; {restore}")
    if not _DAMAGED.search(text):
        return None
    if named:
        return StorageFault(f"{what}: its data file {named.group(0)} is damaged ({lance_reason(text)}); {restore}")
    cut = truncated_data_files(uri)
    if cut:
        name, size = cut[0]
        more = f" (and {len(cut) - 1} more)" if len(cut) > 1 else ""
        return StorageFault(f"{what}: its data file data/{name} is truncated ({size} bytes, without the "
                            f"Lance footer){more}; {restore}")
    return StorageFault(f"{what}: a data file is damaged ({lance_reason(text)}); {restore}")


def truncated_data_files(uri: str) -> list[tuple[str, int]]:
    """(name, size) of each file in the table's data/ that does not end as a complete Lance
    file does: lance's error for a cut-off file names none."""
    import pyarrow.fs as pafs

    try:
        fs, root = filesystem(uri)
        cut = []
        for info in fs.get_file_info(pafs.FileSelector(f"{root}/data", allow_not_found=True)):
            if info.type != pafs.FileType.File or not info.base_name.endswith(".lance"):
                continue
            with fs.open_input_file(info.path) as f:
                tail = f.read_at(len(LANCE_MAGIC), info.size - len(LANCE_MAGIC)) \
                    if info.size >= len(LANCE_MAGIC) else b""
            if tail != LANCE_MAGIC:
                cut.append((info.base_name, info.size))
        return sorted(cut)
    except (OSError, UserError):
        return []


def lance_reason(text: str) -> str:
    """Lance's error, without its prefix and its Rust source locations."""
    text = re.sub(r",\s*/\S+\.rs:\d+:\d+", "", first_line(text))
    return re.sub(r"^(lance error:\s*)?(LanceError\(IO\):\s*)?", "", text)
