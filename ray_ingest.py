"""prepare_data.py --ray: the same corpus table as one node, prepared on a Ray cluster.

Imported only under --ray (Ray and pylance are the optional `ray` extra). The per-chunk
work is prepare_data's own (`read_chunks` on the driver, `chunk_rows` in the tasks); what
changes is who does the rest:

1. map: a Ray task per chunk runs `chunk_rows` (parse, filter, tokenize, score, hash,
   split). Its rows stay in the object store; the driver gets back only their count, and
   each dedup shard gets that chunk's digests that belong to it.
2. dedup, sharded: SHARDS_PER_NODE actors per node, each holding a `DigestSet` of the
   digests whose first byte is `k` mod the shard count. Every chunk's part goes to its
   shard in input order (the driver submits them in that order, and an actor runs one
   caller's calls in the order they were submitted; each call checks it), so a shard
   marks a digest a duplicate exactly when an earlier row or chunk had it: the first
   occurrence in input order is kept, as on one node, and no machine holds every digest.
   `--mode append` streams the table's `digest` column into the shards first.
3. write: a Ray task per chunk takes the rows, its shards' answers and its first id (the
   driver's running count of rows, in input order) and writes the chunk as a lance
   fragment into the table's `data/` directory, next to the map's output where it can.
4. commit: the driver commits every fragment, in input order, as one lance version
   (Overwrite for a new or replaced table, Append otherwise). Until then no version
   refers to the fragments: a run that fails, is killed or interrupted leaves the table
   as it was; its fragment files are removed by `prepare_data.py --clean-fragments`
   (a create's whole directory goes at once, as on one node).

The driver keeps at most AHEAD_PER_CPU x the cluster's CPUs chunks in flight, so the
object store holds that many chunks and the driver's memory does not grow with the
documents: it keeps only the fragments' metadata for the commit (one per chunk).

Map and write tasks are retried by Ray when their worker process dies (max_retries);
a retried write leaves the dead attempt's fragment file unused (see above). A shard
actor that dies fails the run (its digests are gone), with the table as it was.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import sys
import warnings
from collections import Counter, deque
from typing import Iterable, Iterator

import lance
import numpy as np
import pyarrow as pa
import ray
from tqdm import tqdm

import prepare_data as pd_
import storage
from common import UserError, is_remote, out_of_space
from digest_set import DigestSet

SHARDS_PER_NODE = 1  # dedup actors per node: each holds 16 bytes per distinct document of its shard
AHEAD_PER_CPU = 2  # chunks in flight per cluster CPU: what the object store holds
TASK_RETRIES = 3  # a task whose worker process dies runs again, this many times at most
KILL_ONCE_ENV = "PREPARE_DATA_RAY_KILL_ONCE"  # tests: a map task kills its own process once
LOCAL = "local"
CONNECT_S = 5.0  # how long the cluster's address may take to answer


# ----------------------------------------------------------------------------- tasks

def shard_of(digests: np.ndarray, shards: int) -> np.ndarray:
    """Each (n, 16) digest's shard: its first byte mod the shard count."""
    return digests[:, 0] % shards


def _kill_once(marker: str | None) -> None:
    """The fault test's hook: the first task to create `marker` SIGKILLs its own process."""
    if not marker:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


@ray.remote(max_retries=TASK_RETRIES)
def map_chunk(chunk: pd_.Chunk, opts: pd_.RowOptions, encode: list, shards: int,
              kill_once: str | None):
    """chunk_rows on a worker: (rows, tokens, val, skipped), the ChunkRows, then each
    shard's part of the digests (in row order)."""
    _kill_once(kill_once)
    if pd_._worker.get("opts") != opts:
        pd_.start_worker(opts, ray.get(encode[0]) if encode else None)
    result = pd_.chunk_rows(chunk)
    if result.rows is None:
        return ((0, 0, 0, result.skipped), None, *[np.zeros((0, 16), np.uint8)] * shards)
    digests = pd_.digest_matrix(result.rows.column("digest"))
    shard = shard_of(digests, shards)
    parts = [digests[shard == k] for k in range(shards)]
    return ((result.rows.num_rows, result.tokens, result.val, result.skipped), result, *parts)


@ray.remote(num_cpus=0, max_restarts=0)
class DigestShard:
    """The digests of one shard, seen so far (16 bytes each): `add` answers is_dup for one
    chunk's part, chunks in input order."""

    def __init__(self):
        self.seen, self.next_chunk = DigestSet(), 0

    def add_existing(self, digests: np.ndarray) -> int:
        self.seen.add(digests)
        return len(digests)

    def add(self, index: int, digests: np.ndarray) -> np.ndarray:
        if index != self.next_chunk:  # the order the whole dedup rests on
            raise RuntimeError(f"dedup shard got chunk {index} before chunk {self.next_chunk}")
        self.next_chunk += 1
        return self.seen.add(digests)

    def held(self) -> tuple[int, int]:
        """(digests, bytes) held."""
        return len(self.seen), self.seen.nbytes


@ray.remote(max_retries=TASK_RETRIES)
def write_chunk(uri: str, result: pd_.ChunkRows, first_id: int, schema: pa.Schema,
                storage_options: dict, version: str | None, *dup_parts: np.ndarray):
    """The chunk's rows with their ids and is_dup, written as a fragment (not committed):
    (fragments' JSON, dups)."""
    digests = pd_.digest_matrix(result.rows.column("digest"))
    shard = shard_of(digests, len(dup_parts))
    is_dup = np.zeros(result.rows.num_rows, dtype=bool)
    for k, part in enumerate(dup_parts):
        is_dup[shard == k] = part
    batch = pd_.corpus_batch(result, first_id, is_dup, schema)
    fragments = lance.fragment.write_fragments(
        pa.Table.from_batches([batch]), uri, schema=schema, storage_options=storage_options,
        data_storage_version=version)
    return [json.dumps(f.to_json()) for f in fragments], int(is_dup.sum())


# ----------------------------------------------------------------------------- driver

def table_uri(db: str, table: str) -> str:
    """Where lancedb keeps `table` of `db`: the lance dataset the fragments go into."""
    if is_remote(db):
        return f"{db.rstrip('/')}/{table}.lance"
    return os.path.join(os.path.abspath(db), f"{table}.lance")


def worker_storage_options() -> dict:
    """The driver's store settings, spelled out for the workers: they run on other nodes,
    with other environments (lance's own option names)."""
    options = dict(storage.lance_options())
    for name in ("access_key_id", "secret_access_key", "session_token", "region"):
        if value := storage.setting(name):
            options[f"aws_{name}"] = value
    if endpoint := storage.endpoint_url():
        options["aws_endpoint"] = endpoint
    if allow_http := storage.setting("allow_http"):
        options["allow_http"] = allow_http
    return options


def connect(address: str) -> bool:
    """Join the cluster at `address` ('local': start a Ray of this machine's own); return
    whether this command started it (then it is stopped at the end)."""
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # errors are read, in order
    kwargs = dict(logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
                  configure_logging=True)
    try:
        with warnings.catch_warnings():
            # Ray starts its processes with a preexec_fn, so Python runs the fork hooks by which
            # lance and lancedb warn that they are not fork-safe; each child execs a fresh
            # program at once and uses nothing of theirs.
            warnings.filterwarnings("ignore", message=r"lance is not fork-safe")
            warnings.filterwarnings("ignore", message=r"lancedb fork support is experimental")
            if address == LOCAL:
                ray.init(**kwargs)
            else:
                reachable(address)
                ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError, OSError) as e:
        ray.shutdown()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--ray {address}: cannot join the Ray cluster ({first}); start one "
                        f"with `ray start --head`, or use --ray local") from None
    return address == LOCAL


def reachable(address: str) -> None:
    """Refuse an address nothing listens at within seconds (Ray itself would retry for a
    minute); 'auto' is Ray's to find."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    with socket.create_connection((host.removeprefix("ray://"), int(port)), timeout=CONNECT_S):
        pass


def cause(e: BaseException) -> BaseException:
    """A task's own exception out of Ray's wrapper; a dead worker or actor as one line."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, BaseException):
        return e.cause
    if isinstance(e, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)):
        return UserError(f"a Ray worker died {TASK_RETRIES + 1} times on the same chunk "
                         f"({type(e).__name__}); the table is as it was")
    if isinstance(e, ray.exceptions.ActorDiedError):
        return UserError("a dedup shard of the Ray job died (its digests with it); the table "
                         "is as it was: run again")
    if isinstance(e, ray.exceptions.OutOfMemoryError):
        return UserError(f"Ray killed a task for memory ({str(e).splitlines()[0]}); use a "
                         f"smaller --batch-size or more nodes")
    return e


def get(ref):
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        raise cause(e) from None


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, which exec resets (ru_maxrss keeps the RSS of the
    parent this process was forked from, a bench's or a test's, before its exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # macOS: bytes


def read_existing_digests(existing, shards: list) -> None:
    """Stream the table's `digest` column (only it) into the shards, a batch at a time."""
    pending = deque()
    for batch in existing.search().select(["digest"]).to_batches(pd_.READ_ROWS):
        digests = pd_.digest_matrix(batch.column("digest"))
        shard = shard_of(digests, len(shards))
        for k, actor in enumerate(shards):
            pending.append(actor.add_existing.remote(digests[shard == k]))
        while len(pending) > 4 * len(shards):
            get(pending.popleft())
    for ref in pending:
        get(ref)


def write_corpus(chunks: Iterable[pd_.Chunk], db: str, table: str, existing, mode: str,
                 schema: pa.Schema, opts: pd_.RowOptions, encode, first_id: int, stats: Counter,
                 skipped: Counter, address: str) -> dict:
    """prepare_data.write_corpus's work on the cluster at `address` (see the module's
    docstring); updates `stats` and `skipped`; returns what the summary says of the cluster."""
    uri, created = table_uri(db, table), pd_.created_by_write(db, table)
    cpu_start = pd_.cpu_seconds()
    if existing is None and not is_remote(db):
        pd_.remove_uncommitted(uri)  # what a killed create left: no version refers to it
    started_here = connect(address)
    committed = False
    try:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        shards = [DigestShard.options(scheduling_strategy="SPREAD").remote()
                  for _ in range(SHARDS_PER_NODE * nodes)]
        if existing is not None and mode == "append":
            read_existing_digests(existing, shards)
        version = None
        if existing is not None and mode == "append":
            version = lance.dataset(uri, storage_options=worker_storage_options()).data_storage_version
        fragments = run(chunks, uri, schema, opts, encode, first_id, stats, skipped, shards, cpus,
                        version)
        if not fragments:
            raise pd_.no_documents(opts.min_chars, skipped)
        held = [get(actor.held.remote()) for actor in shards]
        commit(uri, existing, mode, schema, fragments)
        committed = True
    except BaseException as e:
        ray.shutdown()  # the job's tasks stop before what they wrote is removed
        if not committed:
            pd_.remove_uncommitted(created)
        if isinstance(e, OSError) and not isinstance(e, UserError):
            kept = ("no table was created" if existing is None else
                    f"the table is as it was (version {existing.version})")
            if fault := out_of_space(e, db, f"table {table!r} in {db!r}",
                                     f"free space there or use another --db, then run again; {kept}"):
                raise fault from None
            raise UserError(storage.describe(e, db) or f"cannot write table {table!r} in {db!r}: "
                            f"{e}") from None
        raise
    finally:
        if started_here or ray.is_initialized():
            ray.shutdown()
    return {"nodes": nodes, "cpus": cpus, "shards": len(shards), "fragments": len(fragments),
            "shard_digests": [h[0] for h in held], "shard_bytes": [h[1] for h in held],
            "driver_peak_rss_mib": round(peak_rss_mib(), 1),
            "driver_cpu_s": round(pd_.cpu_seconds() - cpu_start, 2)}


def run(chunks: Iterable[pd_.Chunk], uri: str, schema: pa.Schema, opts: pd_.RowOptions, encode,
        first_id: int, stats: Counter, skipped: Counter, shards: list, cpus: int,
        version: str | None) -> list:
    """Map, dedup and write every chunk, in input order, at most AHEAD_PER_CPU x cpus in
    flight; return the fragments' metadata in input order."""
    encode_ref = [ray.put(encode)] if encode is not None else []
    options, kill_once = worker_storage_options(), os.environ.get(KILL_ONCE_ENV)
    ahead = AHEAD_PER_CPU * max(cpus, 1)
    mapped, written, fragments = deque(), deque(), []
    next_id = first_id
    bar = tqdm(desc=os.path.basename(uri), unit="doc", file=sys.stderr, delay=0.5,
               mininterval=0.5, disable=None)

    def write_next() -> None:  # the oldest mapped chunk: its count gives the next one's ids
        nonlocal next_id
        meta_ref, rows_ref, dup_refs = mapped.popleft()
        n, tokens, val, chunk_skipped = get(meta_ref)
        skipped.update(chunk_skipped)
        if n:
            written.append(write_chunk.remote(uri, rows_ref, next_id, schema, options, version,
                                              *dup_refs))
            stats.update(docs=n, tokens=tokens, val=val, batches=1)
            next_id += n

    def collect_next() -> None:
        frags, dups = get(written.popleft())
        fragments.extend(lance.FragmentMetadata.from_json(f) for f in frags)
        stats.update(dups=dups)
        bar.update(stats["docs"] - bar.n)

    try:
        input_error = None
        for index, chunk in enumerate(_guarded(chunks)):
            if isinstance(chunk, BaseException):
                input_error = chunk  # raised after the chunks before it, as on one node
                break
            refs = map_chunk.options(num_returns=len(shards) + 2).remote(
                chunk, opts, encode_ref, len(shards), kill_once)
            dup_refs = [actor.add.remote(index, part) for actor, part in zip(shards, refs[2:])]
            mapped.append((refs[0], refs[1], dup_refs))
            while len(mapped) >= ahead:
                write_next()
            while len(written) >= ahead:
                collect_next()
        while mapped:
            write_next()
        while written:
            collect_next()
        if input_error is not None:
            raise input_error
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()
    return fragments


def _guarded(chunks: Iterable) -> Iterator:
    """The chunks, then the input's error (if any) as a last item instead of raised."""
    try:
        yield from chunks
    except (UserError, OSError) as e:
        yield e


def commit(uri: str, existing, mode: str, schema: pa.Schema, fragments: list) -> None:
    """One lance version with every fragment, in input order."""
    if existing is not None and mode == "append":
        operation = lance.LanceOperation.Append(fragments)
        read_version = existing.version
    else:
        operation = lance.LanceOperation.Overwrite(schema, fragments)
        read_version = existing.version if existing is not None else None
    lance.LanceDataset.commit(uri, operation, read_version=read_version,
                              storage_options=worker_storage_options())


# ----------------------------------------------------------------------------- cleanup

def unused_files(uri: str) -> list[str]:
    """The table's data files that no version refers to (paths relative to the table)."""
    options = worker_storage_options()
    try:
        dataset = lance.dataset(uri, storage_options=options)
    except (ValueError, OSError) as e:
        raise UserError(f"no table at {uri} ({str(e).splitlines()[0]})") from None
    used = set()
    for v in dataset.versions():
        for fragment in lance.dataset(uri, version=v["version"], storage_options=options).get_fragments():
            used.update(f.path for f in fragment.data_files())
    fs, root = storage.filesystem(uri)
    import pyarrow.fs as pafs

    listed = fs.get_file_info(pafs.FileSelector(f"{root}/data", allow_not_found=True))
    return sorted(f"data/{info.base_name}" for info in listed  # a write killed midway leaves a .tmp file
                  if info.type == pafs.FileType.File and info.base_name not in used)


def clean_fragments(db: str, table: str) -> None:
    """List and remove the data files of `table` that no version refers to."""
    uri = table_uri(db, table)
    files = unused_files(uri)
    fs, root = storage.filesystem(uri)
    for name in files:
        print(f"removing {uri}/{name}")
        fs.delete_file(f"{root}/{name}")
    print(f"{len(files)} unused data file{'s' * (len(files) != 1)} removed from {uri}")
