"""Read DCP's ``.metadata`` index without executing it: a restricted unpickler and the reader that uses it.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain
``pickle.load``, so a crafted checkpoint runs arbitrary code the moment it is opened (a
``__reduce__`` returning ``os.system`` is enough). :class:`SafeFileSystemReader` reads the same file
through :class:`MetadataUnpickler`, which resolves only the classes DCP's own index is made of and
refuses anything else before calling it. Every portatrain code path that loads DCP checkpoints
(resume, ``export``, ``inspect_checkpoint``) goes through :func:`safe_reader`.

The allowed set was taken from real indexes (``pickletools`` over checkpoints of every model
family, one and several ranks): DCP's metadata dataclasses, ``torch.Size``, dtypes, the layout
helper ``torch.serialization._get_layout`` (a name -> ``torch.layout`` lookup) and ``pathlib``
paths (``StorageMeta.checkpoint_id``). Nothing in that set runs code chosen by the file.

The index itself is not the only way in. DCP stores a non-tensor value of a state dict as a *bytes*
entry (``BytesStorageMetadata``) and reads it back with ``torch.load(weights_only=False)``
(``DefaultLoadPlanner.load_bytes`` in torch/distributed/checkpoint/default_planner.py): a crafted
index that declares an optimizer moment as bytes runs its payload the moment it is loaded, with
nothing but allowed classes in the index. portatrain checkpoints hold tensors only (everything
else is JSON beside them), so the reader refuses any bytes entry by name right after reading the
index -- before a byte of any ``.distcp`` file is read -- and refuses byte reads again in
``read_data`` in case a planner asks for one anyway.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """The index names a global outside the allowed set (it was not called), or declares an entry that
    is not a tensor (it was not read)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is resolved, let alone called."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value if name != "Size" else torch.Size
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeMetadataError(
            f"{module}.{name} is not part of a DCP checkpoint index; refusing to load it "
            "(a checkpoint index that names it was crafted or corrupted)"
        )


def load_metadata(data: bytes) -> Any:
    """Unpickle a ``.metadata`` file's bytes with :class:`MetadataUnpickler`."""
    return MetadataUnpickler(io.BytesIO(data)).load()


def non_tensor_entries(metadata: Any) -> list[str]:
    """The keys of a DCP index whose entries are not tensors (DCP would unpickle them on load)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return ["<the index has no state_dict_metadata table>"]
    return sorted(str(k) for k, v in entries.items() if not isinstance(v, TensorStorageMetadata))


def safe_reader(path: str) -> Any:
    """A ``FileSystemReader`` for ``path`` whose ``read_metadata`` uses the restricted unpickler and
    refuses an index with any non-tensor entry; its ``read_data`` refuses byte (pickled) entries."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as stream:
                metadata = load_metadata(stream.read())
            unsafe = non_tensor_entries(metadata)
            if unsafe:
                more = f" and {len(unsafe) - 3} more" if len(unsafe) > 3 else ""
                raise UnsafeMetadataError(
                    f"declares {', '.join(unsafe[:3])}{more} as a pickled (non-tensor) entry, which "
                    "loading would unpickle and could run code; portatrain checkpoints hold tensors only"
                )
            # What FileSystemReader.read_metadata does after unpickling.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            pickled = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
            if pickled:
                raise UnsafeMetadataError(
                    f"refusing to unpickle {', '.join(pickled[:3])}: portatrain checkpoints hold tensors only"
                )
            return super().read_data(plan, planner)

    return SafeFileSystemReader(path)


__all__ = ["MetadataUnpickler", "UnsafeMetadataError", "load_metadata", "non_tensor_entries", "safe_reader"]
