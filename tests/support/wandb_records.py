"""Reading an offline W&B run back: the records of its ``run-<id>.wandb`` file, decoded with wandb's own protobuf
messages (``wandb.proto.wandb_internal_pb2.Record``), and its ``files/`` folder (the media W&B wrote).

wandb 0.31 ships no Python reader for the file (its ``sdk.internal.datastore`` is gone; ``wandb-core`` writes it):
the framing is LevelDB's log format, which the old datastore read -- a 7-byte file header (``:W&B``, magic 0xBEE1,
version 0), then 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of type + data, length, type: 1 full,
2 first, 3 middle, 4 last) and its data; a block's tail shorter than a header is padding."""

import json
import struct
import zlib
from pathlib import Path

BLOCK, HEADER = 32768, 7


def wandb_records(path: Path) -> list:
    """Every record of a ``.wandb`` file, in order (each chunk's CRC checked)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1 and data[6] == 0, data[:7]
    records, pending, at = [], b"", HEADER
    while at + HEADER <= len(data):
        if BLOCK - at % BLOCK < HEADER:  # the block's padding
            at += BLOCK - at % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[at:at + HEADER])
        chunk = data[at + HEADER:at + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at byte {at}"
        at += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The run's history rows (what ``wandb.log`` / the logger sent), values JSON-decoded, ``_step`` included."""
    [path] = Path(run_dir).glob("run-*.wandb")
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
