"""What a run records for other tools: the --metrics-file JSON Lines (plot_metrics.py
draws them) and the --tensorboard event files. Rank 0 writes both, the same records."""

from __future__ import annotations

import functools
import json
import os
import time

from common import UserError, atomic_replace, out_of_space

# The scalars of each record kind that become TensorBoard curves, and their tags. A value
# that is None (MFU with no known peak, memory off CUDA, an empty validation split) is left out.
TENSORBOARD_TAGS = {
    "train": {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s",
              "mfu": "train/mfu", "data_wait": "train/data_wait", "tokens_seen": "train/tokens_seen",
              "max_mem_gib": "train/max_mem_gib", "epoch": "train/epoch"},
    "eval": {"val_loss": "val/loss"},
}


def append_record(file, record: dict) -> None:
    """One JSON line, written whole to an unbuffered file or cut back off: a write that
    fails (a full disk) leaves the file with whole records only, and raises its OSError."""
    data = (json.dumps(record) + "\n").encode()
    end = os.fstat(file.fileno()).st_size
    try:
        while data:
            data = data[file.write(data):]
    except OSError:
        os.ftruncate(file.fileno(), end)
        raise


def drop_records_after(directory: str, step: int) -> None:
    """Every rank{R}.jsonl of a --trace-samples directory, cut to the records of steps up to
    `step`, the step a run starts from (0 on a fresh start: none). Later records are of an
    attempt that died after its last checkpoint; their steps are trained again, so the trace
    says what the weights trained on. A line a kill cut short goes too. Raises OSError."""
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank") and name.endswith(".jsonl")):
            continue
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        kept = [line + b"\n" for line in lines[:-1] if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines) - 1 or lines[-1]:
            atomic_replace(path, functools.partial(write_lines, lines=kept))


def write_lines(path: str, lines: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.writelines(lines)


def record_fault(flag: str, path: str, error: OSError) -> str:
    """The line of a record file that could not be written: it keeps whole records only."""
    kept = "it keeps the whole records before"
    full = out_of_space(error, os.path.dirname(path) or ".", f"{flag} {path}", kept)
    return str(full) if full else f"cannot write {flag} {path}: {error.strerror or error}; {kept}"


class MetricsLog:
    """--metrics-file: one JSON object per line, flushed as written, so a crash leaves
    whole records (and at worst one torn last line, which plot_metrics.py skips).

    The file is opened, and the run's start record written, with the first record of
    a trained step: a run refused at its first batch leaves no file behind. A write that
    fails leaves whole records and sets `fault`; the run then stops (train.py).
    """

    def __init__(self, path: str, append: bool, **start):
        self.path, self.append, self.start = path, append, start
        self.file = None
        self.fault: str | None = None

    def write(self, kind: str, **fields) -> None:
        if self.fault:
            return
        try:
            if self.file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self.file = open(self.path, "ab" if self.append else "wb", buffering=0)
                self._line("start", self.start)
            self._line(kind, fields)
        except OSError as e:
            self.fault = record_fault("--metrics-file", self.path, e)
            self.close()

    def _line(self, kind: str, fields: dict) -> None:
        append_record(self.file, {"kind": kind, "time": round(time.time(), 3), **fields})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def summary_writer_class():
    """torch's SummaryWriter, imported only when --tensorboard asks for it: the package
    is optional, and its absence is a one-line error before the run starts."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        why = str(e).split("\n")[0]
        raise UserError(f"--tensorboard needs the tensorboard package ({why}): pip install tensorboard") from None
    return SummaryWriter


class TensorBoardLog:
    """--tensorboard: the metrics records' scalars as curves keyed by optimizer step,
    flushed as written, so a killed run loses none of them.

    The writer starts a new event file in the directory with the first record, so a
    run refused before its first step leaves none. Its purge step, one past the step
    the run resumed from (1 for a fresh run), tells TensorBoard to drop what older
    files hold from that step on: the steps a lost attempt trained past its last
    checkpoint are drawn once, by the attempt that trains them again, and a fresh run
    into the same directory replaces the old curves (as a fresh --metrics-file does).
    """

    def __init__(self, directory: str, resumed_step: int):
        self.directory, self.purge_step = directory, resumed_step + 1
        self.writer = None

    def write(self, kind: str, **fields) -> None:
        if self.writer is None:
            self.writer = summary_writer_class()(self.directory, purge_step=self.purge_step)
        for name, tag in TENSORBOARD_TAGS[kind].items():
            if fields.get(name) is not None:
                self.writer.add_scalar(tag, fields[name], global_step=fields["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class RunRecords:
    """Every record sink a run has configured: one write reaches them all."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    @property
    def fault(self) -> str | None:
        """Why a sink stopped taking records (a full disk), if one did."""
        return next((sink.fault for sink in self.sinks if getattr(sink, "fault", None)), None)

    def write(self, kind: str, **fields) -> None:
        for sink in self.sinks:
            sink.write(kind, **fields)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
