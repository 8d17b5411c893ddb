"""A local stand-in for LanceDB Cloud / Enterprise: the HTTP routes lancedb's remote client
uses to read a table, answered from real local LanceDB tables through Lance's own API.

    python bench/lancedb_server.py --root DB_DIR [--port 0] [--log requests.jsonl] [--api-key KEY]

Then `LANCEDB_API_KEY=KEY LANCEDB_HOST_OVERRIDE=http://127.0.0.1:PORT python train.py --db db://NAME`
reads the tables of DB_DIR (any NAME). It prints `serving DB_DIR on http://127.0.0.1:PORT`
once it listens. No LanceDB server can run where the tests run, so the tests and
bench/remote_table.py start this one; what it answers is only as faithful as these routes:

- POST /v1/table/{t}/describe/     {"version": V?} -> the version and the schema (JSON Arrow)
- POST /v1/table/{t}/count_rows/   {"predicate": SQL?, "version": V?} -> an integer
- POST /v1/table/{t}/query/        columns, filter, k, offset, with_row_id, version -> an Arrow
                                   IPC file (a scan, or a take when the filter is `_rowid IN (...)`)
- POST /v1/table/{t}/version/list/ -> the table's versions
- POST /v1/table/{t}/get_lsm_write_spec/ -> none (tables here have no LSM write path)

Any other route is a 404, and every request is one JSON line in --log: route, body (a take's
row ids counted, not listed), status, the rows and bytes answered. A wrong key is a 401.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import sys
import threading
from datetime import datetime, timezone

import lance
import pyarrow as pa

ROUTE = re.compile(r"/v1/table/([^/]+)/([\w/]+?)/?$")
TAKE = re.compile(r"^\s*_rowid\s+IN\s*\(([^)]*)\)\s*$", re.I)
ARROW_FILE = "application/vnd.apache.arrow.file"
NO_LIMIT = 1 << 62  # a `k` at or above this (lancedb sends i64::MAX) is no limit


def json_type(t: pa.DataType) -> dict:
    """A pyarrow type as the JSON Arrow type lancedb's client reads (its own type names)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"type": "list" if pa.types.is_list(t) else "large_list", "fields": [json_field(t.value_field)]}
    if pa.types.is_fixed_size_list(t):
        return {"type": "fixed_size_list", "fields": [json_field(t.value_field)], "length": t.list_size}
    if pa.types.is_fixed_size_binary(t):
        return {"type": "fixed_size_binary", "length": t.byte_width}
    if pa.types.is_struct(t):
        return {"type": "struct", "fields": [json_field(f) for f in t]}
    return {"type": str(t)}  # int64, string, large_string, float, double, bool, ...


def json_field(field: pa.Field) -> dict:
    out = {"name": field.name, "nullable": field.nullable, "type": json_type(field.type)}
    if field.metadata:
        out["metadata"] = {k.decode(): v.decode() for k, v in field.metadata.items()}
    return out


def arrow_file(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class Tables:
    """The routes, over the LanceDB tables in `root` (TABLE.lance directories)."""

    def __init__(self, root: str, log_path: str | None, api_key: str | None):
        self.root, self.api_key = root, api_key
        self.log = open(log_path, "a", buffering=1) if log_path else None
        self.lock = threading.Lock()

    def dataset(self, name: str, version):
        path = os.path.join(self.root, f"{name}.lance")
        if not os.path.isdir(path):
            raise LookupError(f"Table '{name}' was not found")
        return lance.dataset(path, version=version)

    def answer(self, route: str, name: str, body: dict):
        """(status, JSON-able or pa.Table) for one request."""
        ds = self.dataset(name, body.get("version"))
        if route == "describe":
            return 200, {"version": ds.version, "schema": {"fields": [json_field(f) for f in ds.schema]}}
        if route == "count_rows":
            return 200, ds.count_rows(body.get("predicate") or None)
        if route == "version/list":
            return 200, {"versions": [{"version": v["version"], "timestamp": v["timestamp"].astimezone(
                timezone.utc).isoformat(), "metadata": v.get("metadata", {})} for v in ds.versions()]}
        if route == "get_lsm_write_spec":
            return 200, {"lsm_write_spec": None}
        if route == "query":
            return 200, self.query(ds, body)
        return 404, {"error": f"no route {route!r} here"}

    @staticmethod
    def query(ds, body: dict) -> pa.Table:
        columns = body.get("columns")
        if isinstance(columns, dict):  # {output name: column}: lancedb sends plain projections
            columns = list(columns.values())
        with_row_id = bool(body.get("with_row_id")) or (columns is not None and "_rowid" in columns)
        if columns is not None:
            columns = [c for c in columns if c != "_rowid"]
        k = body.get("k")
        limit = None if not k or k >= NO_LIMIT else k
        return ds.to_table(columns=columns, filter=body.get("filter") or None, limit=limit,
                           offset=body.get("offset") or None, with_row_id=with_row_id)

    def record(self, entry: dict) -> None:
        if self.log is not None:
            with self.lock:
                self.log.write(json.dumps(entry) + "\n")


def summarized(body: dict) -> dict:
    """The body as logged: a take's row-id list becomes its length."""
    found = TAKE.match(body.get("filter") or "")
    if found:
        return {**body, "filter": None, "take_rows": len(found.group(1).split(","))}
    return body


def handler(tables: Tables):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.serve()

        def do_POST(self):
            self.serve()

        def serve(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw.strip().startswith(b"{") else {}
            found = ROUTE.match(self.path.split("?")[0])
            entry = {"t": datetime.now(timezone.utc).timestamp(), "path": self.path, "bytes_in": len(raw)}
            if tables.api_key is not None and self.headers.get("x-api-key") != tables.api_key:
                status, payload = 401, {"error": "Invalid API key"}
            elif not found:
                status, payload = 404, {"error": f"no route for {self.path}"}
            else:
                name, route = found.groups()
                entry.update(table=name, route=route, body=summarized(body))
                try:
                    status, payload = tables.answer(route, name, body)
                except LookupError as e:
                    status, payload = 404, {"error": str(e)}
                except Exception as e:  # a bad filter or version: the client shows the message
                    status, payload = 400, {"error": str(e)}
            if isinstance(payload, pa.Table):
                data, kind = arrow_file(payload), ARROW_FILE
                entry["rows"] = payload.num_rows
            else:
                data, kind = json.dumps(payload).encode(), "application/json"
            entry.update(status=status, bytes_out=len(data))
            tables.record(entry)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="a local LanceDB directory; its tables are served")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    p.add_argument("--log", help="append one JSON line per request here")
    p.add_argument("--api-key", help="answer 401 to any other x-api-key (default: take any)")
    args = p.parse_args(argv)
    tables = Tables(os.path.abspath(args.root), args.log, args.api_key)
    server = http.server.ThreadingHTTPServer((args.host, args.port), handler(tables))
    server.daemon_threads = True
    print(f"serving {args.root} on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
