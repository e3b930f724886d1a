"""Buckets of a weight version and SGLang's per-tensor hash.

A version is a list of ``(HF name, tensor)`` in one dtype (the engine's). :func:`plan` cuts it,
in order, into buckets of at most ``bucket_bytes`` (a tensor larger than that gets a bucket of
its own). A bucket travels as one flat ``uint8`` tensor: each tensor's bytes, in order, with no
padding, which is SGLang 0.5.23's ``FlattenedTensorBucket`` (``srt/weight_sync/tensor_bucket.py``;
``load_format: "flattened_bucket"`` of ``/update_weights_from_distributed``, whose receive side
refuses a tensor whose byte offset is not a multiple of its item size — one dtype per version
keeps every offset aligned). :func:`unflatten` is the receive side (views into the buffer).

:func:`tensor_hash` is SGLang's ``tensor_hash`` of a CPU tensor as ``/weights_checker`` prints
it (``srt/managers/mm_utils.py``, ``srt/utils/weight_checker.py``): the first 8 bytes of the
SHA-256 of the tensor's contiguous bytes, as 16 hex digits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch.", as SGLang's request takes it
    shape: tuple[int, ...]
    nbytes: int

    def as_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.nbytes]

    @classmethod
    def from_json(cls, row: list) -> TensorMeta:
        name, dtype, shape, nbytes = row
        return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(nbytes))


@dataclass(frozen=True)
class Bucket:
    metas: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def request(self) -> dict:
        """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
        return {
            "names": [m.name for m in self.metas],
            "dtypes": [m.dtype for m in self.metas],
            "shapes": [list(m.shape) for m in self.metas],
        }


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def meta_of(name: str, t) -> TensorMeta:
    return TensorMeta(name, dtype_name(t), tuple(t.shape), t.numel() * t.element_size())


def plan(named: list[tuple[str, object]], bucket_bytes: int) -> list[Bucket]:
    """Buckets of at most ``bucket_bytes`` (module docstring), in the order of ``named``."""
    return plan_metas([meta_of(name, t) for name, t in named], bucket_bytes)


def plan_metas(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """:func:`plan` of tensors known by their metadata only."""
    import torch

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = [[]]
    size = 0
    for meta in metas:
        if size % getattr(torch, meta.dtype).itemsize:
            raise ValueError(f"{meta.name}: byte offset {size} is not a multiple of its item size")
        if buckets[-1] and size + meta.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += meta.nbytes
    return [Bucket(tuple(b)) for b in buckets if b]


def flatten(tensors: list, device=None):
    """One ``uint8`` tensor holding each tensor's bytes in order (SGLang's flattened bucket)."""
    import torch

    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    return flat if device is None else flat.to(device)


def empty_bucket(bucket: Bucket, device="cpu"):
    import torch

    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)


def offsets(bucket: Bucket):
    """``(TensorMeta, byte offset)`` of each tensor of ``bucket`` in its flat buffer."""
    offset = 0
    for m in bucket.metas:
        yield m, offset
        offset += m.nbytes


def unflatten(flat, bucket: Bucket) -> list[tuple[str, object]]:
    """``(name, tensor)`` views into ``flat`` (the receive side of :func:`flatten`)."""
    import torch

    if bucket.nbytes != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} bytes, its tensors take {bucket.nbytes}")
    return [
        (m.name, flat[off : off + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape))
        for m, off in offsets(bucket)
    ]


def tensor_hash(t) -> str:
    """SGLang's ``/weights_checker`` checksum of one tensor (module docstring)."""
    import torch

    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], 'big'):016x}"
