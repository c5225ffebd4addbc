"""A hash over every weight file of a checkpoint folder, recorded in manifests as `weights_sha256`.

The engines' in-memory fingerprint (fingerprint.py) covers only the embeddings, output layer and final norm, so
that engines of different layouts can be compared; two checkpoints of one RL run share most of those bits and
differ in the layers. This hash reads the files themselves: any changed weight changes it. It reads every byte
(about a minute for a 60 GB checkpoint), once per `probe rescore` or `probe generate`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mismatch_probe.rundir.manifests import file_sha256

# What holds weights in the folders transformers and Megatron-converted checkpoints save.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def weight_files(folder: Path) -> list[Path]:
    files = {path for pattern in WEIGHT_PATTERNS for path in Path(folder).glob(pattern) if path.is_file()}
    return sorted(files, key=lambda path: path.name)


def weights_sha256(folder: Path) -> str | None:
    """sha256 over (name, sha256 of the bytes) of each weight file; None when the folder holds none (a hub id,
    or weights that live only in a server's process)."""
    files = weight_files(folder) if Path(folder).is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return digest.hexdigest()
