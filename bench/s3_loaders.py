"""The lance loader paths reading from S3 against the same data on local disk, side by side.

Usage:
    python bench/s3_loaders.py --blocks OUT --out FILE.json [--bucket NAME] [--local-s3]
        [--modes lance,lance-docs] [--repeats 3] [--min-tokens N] [--batch-size 32]

OUT is what build_packed_datasets.py wrote (with its `lance` format) from a local corpus
(the manifest names it). Both are copied to s3://BUCKET/bench/ and each repeat then times
every mode on local disk and on S3 in turn (bench/loaders.py's `timed_run`: in-process,
train.py's loader settings), so the ratio compares runs made minutes apart on the same
machine. Steady tokens/s counts from each run's first batch; overall tokens/s divides
all tokens by the whole run, so the wait for each epoch's first batch (where object-store
latency shows) is in it. The store is the one the AWS_* environment variables name; `--local-s3` starts
moto's S3 server on 127.0.0.1 instead (a test dependency), which measures the S3 code
path and HTTP, not a network: a real bucket adds latency that --io-queue-depth hides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/loaders.py
import loaders  # noqa: E402
from loaders import Bench, machine_info, run_line, timed_run, write_json  # noqa: E402

import storage  # noqa: E402  (loaders put the project root on sys.path)
from common import UserError  # noqa: E402


def start_local_s3() -> subprocess.Popen:
    """moto's S3 server on a free port; points this process's AWS_* environment at it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ALLOW_HTTP="true")
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise UserError("moto's S3 server did not start (pip install 'moto[server]')") from None
            time.sleep(0.2)


def upload(local_dir: str, uri: str) -> float:
    """Copy a local directory tree to `uri`; returns the seconds it took."""
    import pyarrow.fs as pafs

    start = time.perf_counter()
    fs, path = storage.filesystem(uri)
    pafs.copy_files(os.path.abspath(local_dir), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs, use_threads=True)
    return time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", required=True, help="the local OUT directory build_packed_datasets.py wrote")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--bucket", default="lance-gpt-bench", help="created when missing")
    p.add_argument("--local-s3", action="store_true", help="start moto's S3 server on 127.0.0.1")
    p.add_argument("--modes", default="lance,lance-docs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-tokens", type=int, default=5_000_000)
    p.add_argument("--batch-size", type=int, default=32)
    return p.parse_args(argv)


def bench_opts(blocks: str, db: str, args) -> argparse.Namespace:
    """bench/loaders.py's options for one location: its defaults, this run's modes and sizes."""
    return loaders.parse_args(["--blocks", blocks, "--db", db, "--out", args.out, "--modes", args.modes,
                               "--batch-size", str(args.batch_size), "--min-tokens", str(args.min_tokens),
                               "--repeats", str(args.repeats), "--no-docs-check"])


def main(argv=None) -> None:
    args = parse_args(argv)
    server = start_local_s3() if args.local_s3 else None
    try:
        storage.configure([])
        results = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if server is not None:
            server.terminate()
    print(f"\nwrote {args.out}")
    return results


def run(args) -> dict:
    import boto3

    local = Bench(bench_opts(args.blocks, "", args))
    source_db = local.manifest["source"]["db"]
    root = f"s3://{args.bucket}/bench"
    client = boto3.client("s3", endpoint_url=storage.endpoint_url())
    if args.bucket not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=args.bucket)
    copy_s = {"blocks": upload(os.path.join(args.blocks, "lance"), f"{root}/blocks/lance"),
              "corpus": upload(source_db, f"{root}/db")}
    remote = Bench(bench_opts(f"{root}/blocks", f"{root}/db", args))
    print(f"copied the blocks ({copy_s['blocks']:.1f} s) and the corpus ({copy_s['corpus']:.1f} s) to {root}; "
          f"{local.num_blocks:,} blocks x {local.seq_len}", flush=True)

    places = {"disk": local, "s3": remote}
    runs = {(mode, place): [] for mode in local.opts.modes for place in places}
    for rep in range(args.repeats):
        for mode in local.opts.modes:
            for place, bench in places.items():
                run = timed_run(bench, mode, args.min_tokens)
                runs[mode, place].append(run)
                print(run_line(f"{mode}@{place}", run, f"[{rep + 1}/{args.repeats}]"), flush=True)

    table = []
    print(f"\n{'mode':<12}{'steady tok/s: disk':>20}{'s3':>14}{'s3/disk':>9}"
          f"{'overall tok/s: disk':>21}{'s3':>14}{'s3/disk':>9}{'first batch s: disk':>21}{'s3':>8}")
    for mode in local.opts.modes:
        def median(key, place):
            return statistics.median(key(r) for r in runs[mode, place])

        steady = {place: median(lambda r: r["tokens_per_s"], place) for place in places}
        overall = {place: median(lambda r: r["tokens"] / r["seconds"], place) for place in places}
        first = {place: median(lambda r: r["first_batch_s"], place) for place in places}
        table.append({"mode": mode, "steady_tokens_per_s": steady, "overall_tokens_per_s": overall,
                      "steady_s3_over_disk": steady["s3"] / steady["disk"],
                      "overall_s3_over_disk": overall["s3"] / overall["disk"], "first_batch_s": first,
                      "runs": {place: runs[mode, place] for place in places}})
        print(f"{mode:<12}{steady['disk']:>20,.0f}{steady['s3']:>14,.0f}{steady['s3'] / steady['disk']:>8.2f}x"
              f"{overall['disk']:>21,.0f}{overall['s3']:>14,.0f}{overall['s3'] / overall['disk']:>8.2f}x"
              f"{first['disk']:>21.3f}{first['s3']:>8.3f}")
    print("(steady: after each run's first batch; overall: tokens / seconds of the whole run, "
          "every epoch's start included)")
    store = "moto S3 server on 127.0.0.1" if args.local_s3 else storage.endpoint_url() or "AWS S3"
    data = {"machine": machine_info(), "store": store, "copy_s": copy_s, "batch_size": args.batch_size,
            "min_tokens": args.min_tokens, "repeats": args.repeats, "results": table}
    write_json(args.out, data)
    return data


if __name__ == "__main__":
    main()
