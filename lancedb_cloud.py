"""LanceDB Cloud and Enterprise tables (`--db db://NAME`): the connection and one-line errors.

lancedb reads one setting from the environment itself, `LANCEDB_API_KEY`. The host of an
Enterprise deployment (or of a local stand-in, bench/lancedb_server.py) and the Cloud
region come from `LANCEDB_HOST_OVERRIDE` and `LANCEDB_REGION`, this project's names for
lancedb's `host_override` and `region`; `--storage-option api_key=... host_override=...
region=...` wins over all three.

Requests are bounded as the object store's are (storage.py): connect and read timeouts and
`client_max_retries` retries in lancedb's own client; the training loader's reads go
through a connection without retries (`unretried`) and storage.StoreRetry retries each
whole read until the retry budget is spent.
"""

from __future__ import annotations

import os
import re

from common import UserError

ENV = {"api_key": "LANCEDB_API_KEY", "host_override": "LANCEDB_HOST_OVERRIDE", "region": "LANCEDB_REGION"}
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 60
# prepare_data.py commits a whole ingest once, through Lance's fragment and transaction API,
# and dedups against the digests it reads from the table's files: a server offers neither.
NO_INGEST = ("prepare_data.py cannot write to {db}: it commits an ingest once through Lance's own "
             "files, which a LanceDB Cloud or Enterprise server does not expose; prepare the table on "
             "local disk or s3:// and load it into LanceDB Enterprise from there")


def is_cloud(uri: str) -> bool:
    return str(uri).startswith("db://")


def settings(flags: dict[str, str]) -> dict[str, str]:
    """api_key, host_override, region: a --storage-option flag, else the environment."""
    found = {name: flags.get(name) or os.environ.get(var) for name, var in ENV.items()}
    return {name: value for name, value in found.items() if value}


def where(flags: dict[str, str]) -> str:
    """The server a db:// URI reaches, for messages."""
    found = settings(flags)
    return found.get("host_override") or f"LanceDB Cloud ({found.get('region', 'us-east-1')})"


def connect(uri: str, flags: dict[str, str], retries: int):
    """lancedb.connect for a db:// URI, with bounded timeouts and `retries` retries."""
    import lancedb

    found = settings(flags)
    if "api_key" not in found:
        raise UserError(f"{uri} needs an API key: set LANCEDB_API_KEY (or --storage-option api_key=...)")
    retry = {"retries": retries, "connect_retries": retries, "read_retries": retries}
    config = {"retry_config": retry,
              "timeout_config": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    return lancedb.connect(uri, api_key=found["api_key"], region=found.get("region", "us-east-1"),
                           host_override=found.get("host_override"), client_config=config)


# What lancedb's remote client raises, by cause.
_REFUSED = re.compile(r"\b(401|403)\b.*(Unauthorized|Forbidden)|Invalid API key", re.I)
_UNREACHABLE = re.compile(r"Hit retry limit|connect_failures=[1-9]|read_failures=[1-9]|"
                          r"\b(429|50[0-4])\b (Too Many|Internal|Bad Gateway|Service|Gateway)", re.I)


def describe(error: BaseException, uri: str, flags: dict[str, str]) -> str | None:
    """One line for a failure to reach or be let into the server; None for any other error."""
    text = str(error)
    if _REFUSED.search(text):
        return (f"the LanceDB server at {where(flags)} refused the API key for {uri}; check LANCEDB_API_KEY "
                f"(or --storage-option api_key=...)")
    if _UNREACHABLE.search(text):
        return (f"cannot reach the LanceDB server at {where(flags)} for {uri}; check LANCEDB_HOST_OVERRIDE "
                f"or LANCEDB_REGION (or --storage-option host_override=...)")
    return None


def unreachable(error: BaseException) -> bool:
    """Whether a read failed because the server could not be reached (worth trying again)."""
    return bool(_UNREACHABLE.search(str(error)))
