"""Which kernel scaled_dot_product_attention runs, chosen on purpose and said at start-up
(docs/design.md §5).

PyTorch's SDPA dispatches among fused kernels and a math fallback (the s x s scores in memory,
several times slower). Left to itself it falls back to math silently whenever the fused kernels
decline a call. Here the choice is made up front by `sdpa_kernel_plan` (a pure function of the
device, dtype, mask and dropout, unit-tested without a GPU) and applied with
torch.nn.attention.sdpa_kernel, in priority order:

    CUDA   cuDNN attention      sm90+ (Hopper) where torch enables it; fp16/bf16, no mask or dropout
           flash (FA2)          sm80+, fp16/bf16, no mask (dropout fine)
           memory-efficient     fp16/bf16/fp32, masks, dropout
           math                 only when none of the above can take the call (fp64; an old GPU)
    CPU    flash (CPU kernel)   any float dtype, masks; no dropout
           math                 with dropout

The math kernel is never chosen silently at long context (LONG_CONTEXT tokens and up): the caller
warns once, naming why (dropout, a mask, a dtype).

The kernel a plan assumes, for the memory planner and its printed plans (`attention_kernel_name`,
`attention_kernel`): SDPA's choice without a ring or packed documents, else the fused block kernel
of attention/block_kernels.py that runs the ring's blocks and the documents' segments.
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend

from megatron_sp.attention.base import MASK_TOKENS
from megatron_sp.attention.block_kernels import KERNEL_DESCRIPTIONS, block_kernel

LONG_CONTEXT = 2048          # tokens from which falling back to the math kernel is warned about

CUDNN, FLASH, EFFICIENT, MATH = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
KERNEL_NAMES = {CUDNN: "cuDNN attention", FLASH: "flash", EFFICIENT: "memory-efficient",
                MATH: "math"}
_HALF = (torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("float32", "fp32").replace("float64", "fp64")


def sdpa_kernel_plan(device_capability, dtype: torch.dtype, has_mask: bool, dropout: float,
                     seq_len: int, *, cudnn: bool = True) -> tuple[tuple[SDPBackend, ...], str]:
    """(kernels in priority order, reason) for one SDPA call.

    device_capability: None on CPU, else the CUDA (major, minor); cudnn: torch enables cuDNN
    attention (torch.backends.cuda.cudnn_sdp_enabled()). The reason says what runs and, where a
    faster kernel is declined, why (dropout, a mask, a dtype); when only math is left at
    seq_len >= LONG_CONTEXT the reason starts with "math kernel" and the caller warns with it.
    """
    name = _dtype_name(dtype)
    at = f" at {seq_len} tokens" if seq_len >= LONG_CONTEXT else ""
    if device_capability is None:
        if dropout:
            return (MATH,), (f"math kernel (s x s scores in memory{at}): dropout, which the CPU "
                             f"flash kernel does not have")
        return (FLASH,), f"flash kernel ({name}{', with a mask' if has_mask else ''})"
    major = device_capability[0]
    kernels, declined = [], []
    if dtype == torch.float32:
        declined.append("fp32: flash and cuDNN attention take fp16/bf16 only")
    elif dtype not in _HALF:
        declined.append(f"{name}: the fused kernels take fp16, bf16 or fp32 only")
    if has_mask:
        declined.append("a mask: flash and cuDNN attention take none")
    if dropout and dtype in _HALF and not has_mask:
        declined.append("dropout: cuDNN attention skipped")
    if major < 8 and dtype in _HALF and not has_mask:
        declined.append(f"sm{major}{device_capability[1]}: flash needs sm80+")
    if cudnn and major >= 9 and dtype in _HALF and not has_mask and not dropout:
        kernels.append(CUDNN)
    if major >= 8 and dtype in _HALF and not has_mask:
        kernels.append(FLASH)
    if major >= 5 and dtype in _HALF + (torch.float32,):
        kernels.append(EFFICIENT)
    if not kernels:
        why = "; ".join(declined) or f"sm{major}{device_capability[1]} has no fused kernel"
        return (MATH,), f"math kernel (s x s scores in memory{at}): {why}"
    chosen = ", else ".join(KERNEL_NAMES[k] for k in kernels)
    return tuple(kernels), chosen + (f" ({'; '.join(declined)})" if declined else "")


def warns_at(kernels, seq_len: int) -> bool:
    """The math kernel alone at long context: say so (once)."""
    return tuple(kernels) == (MATH,) and seq_len >= LONG_CONTEXT


@functools.lru_cache(maxsize=64)
def cuda_plan(device_index, dtype, has_mask: bool, dropout: bool):
    """sdpa_kernel_plan for this CUDA device (its capability and torch's cuDNN switch), once per
    (device, dtype, mask, dropout): the plan does not depend on the length."""
    return sdpa_kernel_plan(torch.cuda.get_device_capability(device_index), dtype, has_mask,
                            float(dropout), 0, cudnn=torch.backends.cuda.cudnn_sdp_enabled())


def describe_attention(backend: str, *, requested: str, device: torch.device, dtype,
                       seq_len: int | None, packed: bool, dropout: float) -> str:
    """What attention runs, for the start-up log: the backend, the SDPA kernel and how packed
    documents are attended. backend: the model's backend name; requested: --attention-backend."""
    s = seq_len or 0
    cuda = device.type == "cuda"
    if backend == "sdpa":
        capability = torch.cuda.get_device_capability(device) if cuda else None
        cudnn = torch.backends.cuda.cudnn_sdp_enabled() if cuda else False
        _, reason = sdpa_kernel_plan(capability, dtype, False, dropout, s, cudnn=cudnn)
        text = f"SDPA {'on ' + torch.cuda.get_device_name(device) if cuda else 'on CPU'}: {reason}"
        if packed:
            from megatron_sp.attention.flex import flex_available
            kernel = KERNEL_DESCRIPTIONS[block_kernel(device, dtype, 128)]
            flex = cuda and requested == "auto" and flex_available()
            text += (f"; packed documents: each document's causal square through {kernel} "
                     f"(blockwise attention, no mask)"
                     + (f", FlexAttention block masks past {MASK_TOKENS} tokens" if flex else "")
                     + (f"; with attention dropout a [b, 1, s, s] mask up to {MASK_TOKENS} "
                        f"tokens" if dropout else ""))
        return text
    if backend == "flex":
        return ("FlexAttention: " + ("compiled (Triton), block masks built once per step"
                                     if cuda else "eager, forward only on CPU"))
    if backend in ("te", "flash"):
        return (("Transformer Engine" if backend == "te" else "flash-attn")
                + " fused attention" + ("; packed documents through cu_seqlens" if packed else ""))
    if backend == "unfused":
        return "Megatron's unfused attention ([b, h, s, s] scores kept: short sequences)"
    if backend.startswith("ring"):   # GPTModel's name under --context-parallel-size (cp > 1)
        return ("key/value blocks travel the ring, the next hop sent while this block is "
                "computed; blocks merged in fp32 by their log-sum-exp; block kernel: "
                + KERNEL_DESCRIPTIONS[block_kernel(device, dtype, 128)]
                + ("; packed documents as segments planned once per step (one dense rectangle "
                   "or nothing per chunk pair, causal squares on the diagonal; no mask)"
                   if packed else ""))
    return backend


# The kernel a plan assumes (the memory planner's naming: megatron_sp/memory/planner) -------------

DEVICES = ("cuda", "cpu")    # the devices whose kernels are named (and the planner's memory counts)


def check_device(device: str) -> None:
    """ValueError unless `device` is one of DEVICES."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}.")


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                "float": "float32"}


_SDPA_CAPABILITY = (9, 0)   # the GPU the planner's defaults describe (H100/H200: 989 TFLOP/s)


def _torch_dtype(dtype):
    """A torch dtype from one (returned as is), a name ("bf16", "bfloat16", "fp32", ...) or the
    planner's element size (2: bf16, its --bf16; 4: fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (2, 4):
            raise ValueError(f"an element size of 2 (bf16) or 4 (fp32) bytes, got {dtype}.")
        return torch.bfloat16 if dtype == 2 else torch.float32
    name = _DTYPE_NAMES.get(str(dtype), str(dtype).replace("torch.", ""))
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a dtype: {dtype!r}.")
    return found


@functools.lru_cache(maxsize=None)
def attention_kernel_name(device: str = "cuda", dtype=2, head_dim: int = 128, cp: int = 1,
                          documents: bool = False) -> str:
    """The attention kernel one layer runs (memory/planner/peak.py's docstring): "sdpa" (SDPA's
    own choice, cp = 1 without documents), else the block kernel of the ring's blocks and the
    documents' segments, attention/block_kernels.block_kernel's "flash" (FlashAttention-2 varlen),
    "efficient" or "cpu" ("math" for a dtype no fused kernel takes). dtype: a torch dtype, a name
    or the element size (2: bf16, 4: fp32)."""
    check_device(device)
    if cp == 1 and not documents:
        return "sdpa"
    return block_kernel(torch.device(device), _torch_dtype(dtype), head_dim)


@functools.lru_cache(maxsize=None)
def attention_kernel(device: str = "cuda", dtype=2, head_dim: int = 128, cp: int = 1,
                     documents: bool = False) -> str:
    """A short description of the attention kernel the plan assumes on `device` (pure: the same
    choice as attention_kernel_name, in block_kernels.KERNEL_DESCRIPTIONS' words), e.g. on CUDA
    in bf16 with a ring "FlashAttention-2 varlen (aten._flash_attention_forward/_backward), ring
    blocks as segments"."""
    kernel = attention_kernel_name(device, dtype, head_dim, cp, documents)
    if kernel == "sdpa":
        capability = _SDPA_CAPABILITY if device == "cuda" else None
        reason = sdpa_kernel_plan(capability, _torch_dtype(dtype), False, 0.0, 0)[1]
        return f"SDPA without a ring or documents: {reason}"
    name = KERNEL_DESCRIPTIONS[kernel].split(", one call")[0]
    what = ("ring blocks and packed documents" if cp > 1 and documents
            else "ring blocks" if cp > 1 else "packed documents")
    return f"{name}, {what} as segments"
