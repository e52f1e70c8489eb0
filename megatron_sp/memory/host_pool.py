"""An exact pinned host pool: one slab of (pinned) host memory handed out by offset, freed as a stack.

torch's caching host allocator rounds every pinned buffer up to the next power of two, so up to half
of the host memory that offloaded activations and offloaded model state pay for is never used. A
HostPool allocates its slab once, with the bytes the plan counts (pinned on CUDA:
torch.empty(n, dtype=uint8, pin_memory=True); plain host memory elsewhere), and hands out tensors of
any dtype, shape and strides that share the slab's storage at offsets aligned to ALIGNMENT bytes:

    slab  [ block 0 | block 1 | block 2 |  ...  free  ... ]
           ^0        ^512k     ^512m     ^top             ^capacity

The rule is a stack with deferred pop. A block is returned when its tensor is freed (or by an explicit
release()); the space comes back only once every block above it is returned too: the top pops down
while the topmost block is free. Activation offload fits it exactly: the forward allocates layer after
layer, the backward frees in reverse (the blocks of one layer in any order among themselves), and
every block is back before the next forward. A block freed below a live one stays in use until the
live one is freed: nothing is ever handed out twice. (1F1B pipelines free micro-batches oldest first,
which a stack does not reclaim: they keep torch's pinned allocator, see pretrain_gpt.)

Blocks are tensors made with Tensor.set_ on the slab's storage, not views of the slab: a view derived
from a block keeps the block alive (its _base), so a block returns to the pool only when nothing uses
its bytes any more (weakref.finalize on the block). On CUDA, device copies into and out of the blocks
run on the current stream, so a block reused by a later copy is written after the earlier copy read
it (stream order).

Errors are user errors (one sentence, megatron_sp.errors.ConfigError): the host cannot allocate or
pin the slab, or the pool is exhausted (what was asked, what is left, what to raise).
"""
from __future__ import annotations

import math
import threading
import weakref

import torch

from megatron_sp.errors import ConfigError

ALIGNMENT = 512          # bytes: every block starts at a multiple of this (cudaMemcpy-friendly)
GiB = 2 ** 30


def align_up(nbytes: float, alignment: int = ALIGNMENT) -> int:
    """nbytes rounded up to a multiple of alignment (what one block of the pool takes)."""
    return int(math.ceil(nbytes / alignment) * alignment) if nbytes > 0 else 0


def pool_bytes(sizes, alignment: int = ALIGNMENT) -> int:
    """The slab a pool needs to hold blocks of these byte sizes at once: each aligned, no rounding
    to powers of two."""
    return sum(align_up(s, alignment) for s in sizes)


class HostPoolError(ConfigError):
    """The host cannot allocate (pin) the pool's slab, or the pool is exhausted."""


def _extent(size, stride) -> int:
    """Elements a strided tensor spans in its storage (0 when it has no elements)."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _gb(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"


class HostPool:
    """A slab of `nbytes` host bytes (pinned when `pin`; default: when CUDA is available) handing out
    tensors by offset (empty), freed as a stack (module docstring).

    what: what the pool holds, for the error sentences ("offloaded activations"); remedy: what the
    user can do, ending both errors ("lower --seq-length or raise --offload-pool-gb").
    """

    def __init__(self, nbytes: float, *, pin: bool | None = None, alignment: int = ALIGNMENT,
                 what: str = "offloaded tensors", remedy: str = "lower what is offloaded or the "
                 "sequence length per rank"):
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}.")
        self.alignment, self.what, self.remedy = alignment, what, remedy
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.capacity = align_up(nbytes, alignment)
        try:
            self.slab = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            verb = "pin" if self.pinned else "allocate"
            raise HostPoolError(f"the host cannot {verb} {_gb(self.capacity)} that the plan needs "
                                f"for {what} ({reason}); {remedy}.") from None
        self._storage = self.slab.untyped_storage()
        self._base = self.slab.data_ptr()
        self._stack: list[tuple[int, int]] = []      # (offset, bytes) of each block, bottom to top
        self._live: dict[int, weakref.finalize] = {}  # offset -> the finalizer of its live tensor
        self._freed: set[int] = set()                  # offsets returned but not yet popped
        self.top = 0                                   # bytes from the slab's start to the free space
        self.peak = 0
        self._lock = threading.Lock()                  # autograd may free blocks on its own threads

    # Allocation -------------------------------------------------------------------------------------
    def empty(self, size, dtype: torch.dtype, stride=None) -> torch.Tensor:
        """An uninitialised tensor of `size` (and `stride`, default contiguous) in the slab; its block
        returns to the pool when the tensor (and every view of it) is freed, or on release()."""
        size = tuple(size)
        if stride is None:
            stride = torch.empty(size, dtype=dtype, device="meta").stride()
        stride = tuple(stride)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        nbytes = _extent(size, stride) * itemsize
        t = torch.empty((0,), dtype=dtype)
        if nbytes == 0:
            return t.as_strided(size, stride) if any(s == 0 for s in size) else t
        with self._lock:
            offset = self.top
            end = offset + align_up(nbytes, self.alignment)
            if end > self.capacity:
                raise HostPoolError(
                    f"the pinned host pool for {self.what} is exhausted: a tensor of {_gb(nbytes)} "
                    f"{tuple(size)} {str(dtype).replace('torch.', '')} does not fit in the "
                    f"{_gb(self.capacity - offset)} left of {_gb(self.capacity)} "
                    f"({_gb(self.used)} in use); {self.remedy}.")
            self._stack.append((offset, end - offset))
            self.top = end
            self.peak = max(self.peak, end)
        t.set_(self._storage, offset // itemsize, size, stride)
        self._live[offset] = weakref.finalize(t, self._return, offset)
        return t

    def release(self, t: torch.Tensor) -> None:
        """Return t's block now (t must not be used afterwards). Releasing a tensor that is not a live
        block of this pool (another pool's, a view into a block, one released already) is a bug."""
        offset = self.offset(t)
        fin = self._live.get(offset)
        if fin is None or not fin.alive:
            raise ValueError(f"release of a tensor that is not a live block of this pool "
                             f"(offset {offset}): released twice, or not allocated by empty().")
        fin.detach()
        self._return(offset)

    def offset(self, t: torch.Tensor) -> int:
        """t's byte offset in the slab (ValueError when t lives elsewhere)."""
        offset = t.data_ptr() - self._base
        if t.device.type != "cpu" or not 0 <= offset < self.capacity:
            raise ValueError("the tensor does not live in this pool's slab.")
        return offset

    def block(self, t: torch.Tensor) -> tuple[tuple, int]:
        """(key, bytes) of t's block: what the saved-tensor accountant counts for it (the tensor's own
        bytes, not the slab's)."""
        return ("host-pool", id(self), self.offset(t)), t.numel() * t.element_size()

    def _return(self, offset: int) -> None:
        with self._lock:
            self._live.pop(offset, None)
            self._freed.add(offset)
            while self._stack and self._stack[-1][0] in self._freed:
                off, _ = self._stack.pop()
                self._freed.discard(off)
                self.top = off

    # Figures ----------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes from the slab's start to the top (blocks freed below a live block included)."""
        return self.top

    @property
    def free(self) -> int:
        return self.capacity - self.top

    def __len__(self) -> int:
        """Blocks on the stack (live, or returned below a live one)."""
        return len(self._stack)

    def __repr__(self) -> str:
        return (f"HostPool({_gb(self.capacity)}, {'pinned' if self.pinned else 'unpinned'}, "
                f"{_gb(self.used)} used, peak {_gb(self.peak)}, {len(self)} blocks)")
