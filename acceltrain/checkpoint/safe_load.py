"""Loading a checkpoint without running code: every pickle it holds is read with ``weights_only=True`` and an
allow-list of globals, DCP's metadata with an unpickler that knows only DCP's own classes, before Accelerate or
DeepSpeed load anything (they would unpickle whatever the files hold)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from acceltrain.checkpoint.state import CheckpointError
from acceltrain.config.options import first_line, parse_json

PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def _allowed_globals() -> list:
    """The only classes a checkpoint's pickles may name: numpy arrays (RNG states) and, with DeepSpeed, its
    ZeRO stage enum, loss scaler and fragment addresses. Anything else would run code to load."""
    import numpy

    multiarray = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
    allowed = [numpy.dtype, numpy.ndarray, multiarray.multiarray._reconstruct]
    allowed += [
        type(numpy.dtype(name)) for name in ("uint32", "int64", "float64", "bool")
    ]  # numpy >= 1.25 dtype classes
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:
        pass
    enums = allowed_enums()
    return [*allowed, *enums, (enum_member_getter(enums), "builtins.getattr")]


def allowed_enums() -> tuple:
    """The Enum classes a checkpoint may hold members of: DeepSpeed's ZeRO stage, when DeepSpeed is installed."""
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError:
        return ()
    return (ZeroStageEnum,)


def enum_member_getter(enums: tuple):
    """What the GLOBAL ``builtins.getattr`` resolves to in a checkpoint's pickles. Some Pythons (3.11.2)
    pickle an Enum member as ``getattr(EnumClass, name)``; this getattr returns members of ``enums`` only,
    and refuses any other attribute of anything."""
    import pickle

    def member(owner, name):
        if owner in enums and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        raise pickle.UnpicklingError(
            f"getattr({getattr(owner, '__name__', owner)!r}, {name!r}) is not an allowed enum member"
        )

    return member


SHARD_DIGESTS_FILE = "shard_digests.json"  # the sha256 of each item of a checkpoint's DCP folders
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded (FSDP) state (or __<rank>.metadata)


def check_loadable_without_code(path: Path, *, digests_required: bool = False) -> None:
    """Load every pickle of checkpoint ``path`` with ``weights_only=True`` and only the allowed globals: a
    file that would run code (a planted pickle, whatever its sha256 says) or does not load is a one-line
    CheckpointError, before Accelerate sees it (it skips an unloadable RNG file with a log line). FSDP's
    sharded folders included: DCP reads their ``.metadata`` with plain ``pickle``, so it is checked here
    with an unpickler that knows only DCP's own classes, then every item it points to in the ``.distcp``
    files, each checked against its recorded digest (required with ``digests_required``). (The check reads each
    file once more than the resume does.)"""
    import torch

    links = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_symlink())
    if links:  # rglob does not walk into linked folders, the loaders would: a place for files this check never sees
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds symbolic links ({', '.join(links[:3])}); refusing to resume from it"
        )
    digests = read_shard_digests(path)
    if digests is None and digests_required and any(path.glob(f"*/{DCP_METADATA}")):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds DCP shards without {SHARD_DIGESTS_FILE}, which every sharded "
            "checkpoint records; refusing to resume from it"
        )
    with torch.serialization.safe_globals(_allowed_globals()):
        for file in sorted(
            f
            for f in path.rglob("*")
            if (f.suffix in PICKLED_SUFFIXES or f.name.endswith(DCP_METADATA)) and f.is_file()
        ):
            if file.name.endswith(DCP_METADATA):  # DCP falls back to __<rank>.metadata when .metadata is missing
                _check_dcp_folder(file, digests)
                continue
            with _refusing(file):
                torch.load(file, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _refusing(file: Path):
    """Any failure inside is the one-line refusal to resume, naming ``file``."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError: all the same verdict
        raise CheckpointError(
            f"checkpoint file {str(file)!r} cannot be loaded without running code or is unreadable "
            f"({first_line(err, 200)}); refusing to resume from it"
        ) from None


def _check_dcp_folder(metadata_file: Path, digests: dict[str, str] | None) -> None:
    """Every item the metadata points to loads without running code and, when the checkpoint records its digest,
    is the item it was written as: shard files swapped between ranks (under a rewritten manifest) load silently
    into another model, since DCP reads items by file name and offset alone."""
    import io

    import torch

    with _refusing(metadata_file):
        storage = load_dcp_metadata(metadata_file).storage_data
    folder = metadata_file.parent
    for index, info in storage.items():
        file = folder / info.relative_path
        with _refusing(file), open(file, "rb") as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
            item = io.BytesIO(data)
            torch.load(item, map_location="cpu", weights_only=True)
        key = _item_key(folder, index)
        if digests is not None and digests.get(key) != hashlib.sha256(data).hexdigest():
            raise CheckpointError(
                f"checkpoint file {str(file)!r} does not hold what its DCP metadata says at {info.offset} "
                f"({index.fqn}): its bytes differ from those written there ({SHARD_DIGESTS_FILE}); refusing to resume "
                "from it"
            )


def _item_key(folder: Path, index) -> str:
    return f"{folder.name}/{index.fqn}@{','.join(map(str, index.offset or ()))}"


def shard_digests(checkpoint: Path) -> dict[str, str]:
    """The sha256 of every item of every DCP folder in ``checkpoint`` (by folder, name and offset), recorded when
    the checkpoint is published and checked before a resume (:func:`_check_dcp_folder`)."""
    digests = {}
    for metadata_file in sorted(checkpoint.glob(f"*/{DCP_METADATA}")):
        folder = metadata_file.parent
        for index, info in load_dcp_metadata(metadata_file).storage_data.items():
            with open(folder / info.relative_path, "rb") as stream:
                stream.seek(info.offset)
                digests[_item_key(folder, index)] = hashlib.sha256(stream.read(info.length)).hexdigest()
    return digests


def read_shard_digests(path: Path) -> dict[str, str] | None:
    """The checkpoint's recorded item digests, or None when it records none (no DCP shards, or removed)."""
    file = path / SHARD_DIGESTS_FILE
    if not file.is_file():
        return None
    try:
        digests = parse_json(file.read_text())
    except (OSError, ValueError):
        digests = None
    if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
        raise CheckpointError(f"checkpoint file {str(file)!r} is malformed: it must map each shard item to its sha256")
    return digests


def load_dcp_metadata(file: Path):
    """DCP's ``.metadata`` pickle, allowing only the names it holds: DCP's metadata classes, torch sizes,
    dtypes and layouts, and the checkpoint's path. Python's own unpickler, since DCP pickles with protocol 4+
    (framing), which torch's weights-only unpickler does not read; BUILD may only set the state of instances
    of those classes, never of a class or function itself (that would change it for the whole process)."""
    import enum
    import pathlib
    import pickle

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {
        f"torch.distributed.checkpoint.metadata.{name}": getattr(metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(metadata, name)
    }
    allowed |= {
        "torch.distributed.checkpoint.filesystem._StorageInfo": filesystem._StorageInfo,
        "torch.Size": torch.Size,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        "pathlib.PosixPath": pathlib.PosixPath,
    }
    allowed |= {f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    enums = tuple(value for value in allowed.values() if isinstance(value, type) and issubclass(value, enum.Enum))
    allowed["builtins.getattr"] = enum_member_getter(enums)  # _MEM_FORMAT_ENCODING's members on Python 3.11.2

    instances = tuple(
        value for value in allowed.values() if isinstance(value, type) and not issubclass(value, enum.Enum)
    )

    class OnlyMetadata(pickle._Unpickler):  # the Python implementation: its opcodes can be screened one by one
        dispatch = dict(pickle._Unpickler.dispatch)

        def find_class(self, module: str, name: str):
            if f"{module}.{name}" not in allowed:
                raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")
            return allowed[f"{module}.{name}"]

        def load_build(self):
            if type(self.stack[-2]) not in instances:  # [-1] is the state, [-2] what it would be set on
                raise pickle.UnpicklingError(
                    f"BUILD on a {type(self.stack[-2]).__name__} is not allowed in DCP metadata"
                )
            pickle._Unpickler.load_build(self)

        dispatch[pickle.BUILD[0]] = load_build

    with open(file, "rb") as stream:
        return OnlyMetadata(stream).load()


@contextlib.contextmanager
def loading_without_code():
    """Inside: every ``torch.load`` (Accelerate's, DeepSpeed's checkpoint engine, which asks for
    ``weights_only=False``) loads with ``weights_only=True`` and only the allowed globals."""
    import torch

    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(_allowed_globals()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original
