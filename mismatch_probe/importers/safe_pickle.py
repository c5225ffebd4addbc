"""Unpickling a dump without running its code: only the globals the frameworks' writers emit are loaded.

A pickle names globals (`module.name`) that unpickling imports and calls, so a crafted dump that names
`posix.system` runs a command. Every pickle probe reads (verl's DataProto file, the torch.save batch inside it,
slime's and miles' torch.save dumps) goes through `DumpUnpickler`, whose `find_class` hands out only the
objects listed below, never imports a module, and refuses every other name: one line, exit 2, naming the file
and the global. `--trust-pickle` (`trust=True`) is the opt-in to an ordinary unpickle of the rest.

The list is what the writers' pickles hold:
- torch.save (slime: slime/observability/train_data_utils.py `save_debug_train_data`; miles:
  miles/utils/train_dump_utils.py `save_debug_train_data_for_rank`; verl: verl/protocol.py
  `DataProto.__getstate__`, which torch.saves the batch) pickles a tensor as torch/_tensor.py
  `Tensor._reduce_ex_internal` does: `torch._utils._rebuild_tensor_v2` (`_v3` for the dtypes it lists), its
  storage by persistent id as a `torch.*Storage` class, its backward hooks as a `collections.OrderedDict`; dtypes,
  shapes and devices pickle as `torch.<dtype>`, `torch.Size`, `torch.device`. torch.save's protocol 2 writes
  bytes as `_codecs.encode` and sets as `builtins.set`/`frozenset`.
- A tensor pickled without torch.save (an entry of verl's non_tensor_batch) pickles its storage as
  torch/storage.py `_load_from_bytes`: a torch.load of the storage's bytes, done here with this same list.
- numpy arrays (verl's non_tensor_batch: object arrays, verl/protocol.py `DataProto.__getstate__`; numpy
  arrays in a slime or miles sample) pickle as numpy's `ndarray.__reduce__`: `numpy._core.multiarray
  ._reconstruct` (`numpy.core` before numpy 2), `numpy.ndarray`, `numpy.dtype`, and scalars as
  `numpy._core.multiarray.scalar`; the objects an object array holds are unpickled through the same list.
- The stand-ins an importer gives (`extra(module, name)`): verl's `verl.protocol.DataProto` and tensordict's
  `_rebuild_tensordict_files_consolidated` (importers/verl.py).
torch's own `weights_only=True` loader allows a similar list; this one also reads verl's outer pickle (not a
torch.save file) and its numpy object arrays, and names the refused global in one line.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import codecs
import collections
import functools
import io
import pickle
import types
import zipfile
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ProbeError

TRUST = "pass --trust-pickle if you trust this file"


def _numpy_globals() -> dict[tuple[str, str], object]:
    reconstruct, scalar = np.ndarray(0).__reduce__()[0], np.float64(0).__reduce__()[0]
    found = {}
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2 and numpy 1 names
        found[module, "_reconstruct"], found[module, "scalar"] = reconstruct, scalar
    found["numpy", "ndarray"], found["numpy", "dtype"] = np.ndarray, np.dtype
    for name in dir(getattr(np, "dtypes", None)):  # numpy >= 1.25: the dtype classes (numpy.dtypes.Int64DType)
        if name.endswith("DType"):
            found["numpy.dtypes", name] = getattr(np.dtypes, name)
    return found


BUILTINS = ("dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int", "float", "bool", "complex")
ALLOWED: dict[tuple[str, str], object] = {
    **{("builtins", name): getattr(builtins, name) for name in BUILTINS},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("_codecs", "encode"): codecs.encode,
    **_numpy_globals(),
}
TORCH_REBUILDS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3")  # torch/_utils.py


@functools.cache
def _torch_globals() -> dict[tuple[str, str], object]:
    """torch's tensor rebuild functions, storage classes, dtypes, Size and device, looked up once in torch's own
    namespace (never through a module's lazy attribute lookup)."""
    import torch
    import torch._utils

    found = {("torch._utils", name): vars(torch._utils)[name] for name in TORCH_REBUILDS if name in vars(torch._utils)}
    found |= {("torch", "Size"): torch.Size, ("torch", "device"): torch.device}
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype) or isinstance(value, type) and name.endswith("Storage"):
            found["torch", name] = value
            if isinstance(value, type):
                found["torch.storage", name] = value
    return found


class DumpUnpickler(pickle.Unpickler):
    """An Unpickler that loads only ALLOWED globals (and the importer's `extra` stand-ins): anything else is a
    ProbeError naming `where` and the global, unless `trust`."""

    def __init__(self, file, *, where, trust: bool = False, extra=None, **kwargs):
        super().__init__(file, **kwargs)
        self.where, self.trust, self.extra = where, trust, extra

    def find_class(self, module, name):
        # a protocol-2 pickle (torch.save's) names builtins in Python 2's spelling (__builtin__.set)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[module, name]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = (module, name)
        stand_in = self.extra(module, name) if self.extra else None
        if stand_in is not None:
            return stand_in
        if key == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch_load_bytes(data, self.where, self.trust, self.extra)
        found = ALLOWED.get(key) or (_torch_globals().get(key) if module.startswith("torch") else None)
        if found is not None:
            return found
        if self.trust:
            return super().find_class(module, name)
        raise ProbeError(f"{self.where}: refuses to load `{module}.{name}` from a pickle (pickles run code); {TRUST}")


def pickle_module(where, trust: bool = False, extra=None) -> types.ModuleType:
    """A stand-in for the `pickle` module, for torch.load(pickle_module=...): torch unpickles through it
    (its own wrapper maps storages first), so the restricted find_class sees every other global."""

    class Unpickler(DumpUnpickler):
        def __init__(self, file, **kwargs):
            super().__init__(file, where=where, trust=trust, extra=extra, **kwargs)

    module = types.ModuleType("pickle")
    module.Unpickler = Unpickler
    module.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()  # the legacy format's header pickles
    module.__version__ = getattr(pickle, "__version__", "")
    return module


def refuse_torchscript(source, where) -> None:
    """torch.load hands a TorchScript archive (a zip with constants.pkl) to torch.jit.load, which runs its code."""
    try:
        with zipfile.ZipFile(source) as archive:
            scripted = any(name.rsplit("/", 1)[-1] == "constants.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return
    finally:
        if hasattr(source, "seek"):
            source.seek(0)
    if scripted:
        raise ProbeError(f"{where}: a TorchScript archive, which runs code when loaded; {TRUST}")


def torch_load_bytes(data: bytes, where, trust: bool = False, extra=None):
    """torch.load of in-memory torch.save bytes (a pickled storage, verl's batch) through the allowlist."""
    import torch

    source = io.BytesIO(data)
    if not trust:
        refuse_torchscript(source, where)
    return torch.load(source, map_location="cpu", weights_only=False, pickle_module=pickle_module(where, trust, extra))


def torch_load_file(path: Path, trust: bool = False, extra=None):
    """torch.load of a torch.save file through the allowlist, memory-mapped where its format allows."""
    import torch

    if not trust:
        refuse_torchscript(path, path)
    module = pickle_module(path, trust, extra)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=module)
    except RuntimeError as exc:  # old (non-zip) serialization cannot be memory-mapped
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=module)
