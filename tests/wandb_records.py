"""Read an offline W&B run back (wandb >= 0.2x has no Python reader for its .wandb files).

The file is W&B's LevelDB-style log: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of
chunks `crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last) | data`; the data
of a full (or first..last) chunk run is one protobuf `Record`.
"""

import glob
import os
import struct

from wandb.proto import wandb_internal_pb2


def read_wandb_records(path):
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf += chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _key(item):
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_dir):
    """(config keys, history rows as dicts, summary keys) of an offline run directory."""
    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    config, history, summary = set(), [], set()
    for rec in read_wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config |= {_key(i) for i in rec.run.config.update}
        elif kind == "history":
            history.append({_key(i): i.value_json for i in rec.history.item})
        elif kind == "summary":
            summary |= {_key(i) for i in rec.summary.update}
    return config, history, summary
