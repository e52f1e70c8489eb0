"""Attention backends behind one interface (docs/design.md §5).

    backend(q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0) -> out

q [b, s, h, d], k/v [b, s, g, d] with h % g == 0 (grouped-query attention: query head i uses
key/value head i // (h/g), handled inside), out [b, s, h, d] in q's dtype. softmax_scale None
means 1/sqrt(d). document_ids [b, s] int64 marks packed documents (a token attends only to earlier
tokens of its own document, see documents.py). dropout_p is applied as given: the caller passes 0
in evaluation.

Backends, in `auto` order: Transformer Engine DotProductAttention (fused), flash-attn
(flash_attn_func / flash_attn_varlen_func), PyTorch scaled_dot_product_attention. Not in `auto`:
`unfused`, Megatron's unfused dot-product attention (two batched matrix products around an fp32
softmax; keeps the s x s probabilities, for short sequences), and `flex`, FlexAttention
(attention/flex.py). The optional packages are imported only when their backend is built.

Without document_ids no backend builds an s x s mask, and with them neither does SDPA unless
attention dropout is on: it runs blockwise attention (attention/blockwise.py: each document's
causal square through the fused block kernels, never a mask; trains everywhere), or under `auto`
on CUDA past MASK_TOKENS FlexAttention's block masks (attention/flex.py). With dropout (the
kernels' segments have none) a [b, 1, s, s] bool mask up to MASK_TOKENS tokens, refused beyond.
TE and flash-attn take cu_seqlens instead.
On CUDA SDPA's kernel is chosen on purpose (attention/kernels.py: cuDNN, flash, memory-efficient;
the math kernel never silently at long context).
"""
from __future__ import annotations

import importlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from megatron_sp.attention import kernels
from megatron_sp.attention.base import (BACKEND_NAMES, MASK_TOKENS, AttentionBackend, DocumentCache,
                                        check_shapes)
from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.blockwise import DEFAULT_BLOCK, blockwise_attention, blockwise_plan
from megatron_sp.errors import ConfigError


_INSTALL_HINTS = {
    "transformer_engine.pytorch": (
        "Transformer Engine", 'pip install --no-build-isolation "transformer_engine[pytorch]" '
                              "(a CUDA build; see NVIDIA's Transformer Engine install guide)"),
    "flash_attn": ("flash-attn", "pip install flash-attn --no-build-isolation (a CUDA build)"),
}


class AttentionBackendUnavailable(ImportError, ConfigError):
    """An explicitly requested attention backend whose package cannot be imported (a user error:
    pretrain_gpt.py says it in one line)."""


def import_optional(module_name: str, backend: str):
    """Import an optional backend package, or raise AttentionBackendUnavailable saying how to get it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        package, hint = _INSTALL_HINTS[module_name]
        flag = {"flash": "flash-attn"}.get(backend, backend)      # the --attention-backend value
        raise AttentionBackendUnavailable(
            f"attention backend '{backend}' (--attention-backend {flag}) needs the {package} "
            f"package ({module_name}), which cannot be imported here ({err}); install it with: "
            f"{hint}, or choose --attention-backend sdpa.") from err


def long_documents_error(s: int) -> ConfigError:
    return ConfigError(
        f"packed documents (--reset-attention-mask) at {s} tokens with attention dropout would "
        f"need an s x s mask (the blockwise and FlexAttention paths have no dropout): pass "
        f"--attention-dropout 0, or --attention-backend te / flash-attn, which take cu_seqlens.")


class SDPAAttention(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention.

    Unpacked: is_causal=True and no mask, so PyTorch picks a fused kernel; on CUDA the kernels
    are chosen on purpose (kernels.sdpa_kernel_plan), with one warning if only math is left at
    long context. GQA uses enable_gqa=True (no copy of the key/value heads) except with a mask on
    CUDA, where the mask-capable kernel needs equal head counts and the key/value heads are
    repeated instead. Packed documents: their segments through the block kernels
    (attention/blockwise.py), or past MASK_TOKENS `long_documents` "flex" (FlexAttention, CUDA;
    what `auto` picks there); with dropout a [b, 1, s, s] mask up to MASK_TOKENS.
    """

    name = "sdpa"

    def __init__(self, long_documents: str = "blockwise"):
        super().__init__()
        if long_documents not in ("blockwise", "flex"):
            raise ValueError(f"long_documents must be 'blockwise' or 'flex', got "
                             f"{long_documents!r}.")
        self.long_documents = long_documents
        self._warned = set()
        self._blockwise = DocumentCache(blockwise_plan)       # its segments, once per step
        if long_documents == "flex":
            from megatron_sp.attention.flex import FlexAttention
            self._flex = FlexAttention()

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0):
        check_shapes(q, k, v, document_ids)
        if document_ids is not None and (not dropout_p or q.shape[1] > MASK_TOKENS):
            return self._documents(q, k, v, causal, softmax_scale, document_ids, dropout_p)
        h, g = q.shape[2], k.shape[2]
        mask = None
        if document_ids is not None:
            mask = document_causal_mask(document_ids, causal=causal)   # [b, 1, s, s] bool
        use_gqa = g != h and not (mask is not None and q.is_cuda)
        if g != h and not use_gqa:
            # [b, s, g, d] -> [b, s, h, d]: key/value head j serves query heads j*h/g .. (j+1)*h/g-1
            k, v = (t.repeat_interleave(h // g, dim=2) for t in (k, v))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, n, s, d] views
        call = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=causal and mask is None,
                    scale=softmax_scale, enable_gqa=use_gqa)
        if q.is_cuda:
            out = self._cuda_sdpa(qt, kt, vt, call)
        else:
            if dropout_p and q.shape[1] >= kernels.LONG_CONTEXT:   # CPU: math is the only choice
                self._warn_once("attention runs SDPA's " + kernels.sdpa_kernel_plan(
                    None, q.dtype, mask is not None, dropout_p, q.shape[1])[1] + ".")
            out = F.scaled_dot_product_attention(qt, kt, vt, **call)
        return out.transpose(1, 2).contiguous()                       # [b, h, s, d] -> [b, s, h, d]

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def _cuda_sdpa(self, qt, kt, vt, call):
        """SDPA on CUDA inside sdpa_kernel(plan): the planned kernels in priority order; if none of
        them takes the call (a head size they decline), math with one warning saying so."""
        s = qt.shape[2]
        plan, reason = kernels.cuda_plan(qt.device.index, qt.dtype, call["attn_mask"] is not None,
                                         bool(call["dropout_p"]))
        if kernels.warns_at(plan, s):
            self._warn_once(f"attention runs SDPA's {reason} at {s} tokens.")
        if torch.compiler.is_compiling():   # no try/except in a traced graph: math ranks last
            with sdpa_kernel(list(plan) + [kernels.MATH], set_priority=True):
                return F.scaled_dot_product_attention(qt, kt, vt, **call)
        try:
            with sdpa_kernel(list(plan), set_priority=True):
                return F.scaled_dot_product_attention(qt, kt, vt, **call)
        except RuntimeError as err:
            if kernels.MATH in plan:
                raise
            self._warn_once(f"SDPA's planned kernels ({reason}) decline this call (head size "
                            f"{qt.shape[-1]}, {qt.dtype}: {str(err).splitlines()[0]}); the math "
                            f"kernel runs instead.")
            with sdpa_kernel([kernels.MATH]):
                return F.scaled_dot_product_attention(qt, kt, vt, **call)

    def _documents(self, q, k, v, causal, scale, document_ids, dropout_p):
        """Packed documents without dropout (or past MASK_TOKENS): their segments through the
        block kernels (blockwise attention), or FlexAttention past MASK_TOKENS on CUDA when
        chosen; never an s x s mask."""
        if dropout_p:
            raise long_documents_error(q.shape[1])
        if self.long_documents == "flex" and q.is_cuda and q.shape[1] > MASK_TOKENS:
            return self._flex(q, k, v, causal=causal, softmax_scale=scale,
                              document_ids=document_ids)
        s = q.shape[1]
        plan = self._blockwise(document_ids, s, min(s, DEFAULT_BLOCK), causal)
        return blockwise_attention(q, k, v, causal=causal, scale=scale, document_ids=document_ids,
                                   plan=plan)


class UnfusedAttention(AttentionBackend):
    """Megatron's unfused dot-product attention (--attention-backend unfused): per key/value head,
    the scores of its query heads as one batched matrix product in the compute dtype, the causal
    (and document) mask, the softmax (fp32 accumulation inside the kernel), dropout on the
    probabilities, then probs @ v.

    It materialises the [b, h, s, s] scores and keeps the probabilities for backward, so it is for
    short sequences. There its four matrix products run at the machine's GEMM rate, which on CPU
    under bf16 makes it ~2x faster than SDPA's flash kernel at s = 512 (bench/train_step.py
    --attention unfused); like Megatron's (and HF's eager attention) the scores and probabilities
    are rounded to the compute dtype, where flash keeps them in fp32.
    """

    name = "unfused"

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0):
        check_shapes(q, k, v, document_ids)
        (b, s, h, d), g = q.shape, k.shape[2]
        r = h // g                                      # query heads per key/value head
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        # [b, s, h, d] -> [b, s, g, r, d] -> [b, g, r, s, d] -> [b*g, r*s, d]: the query rows of
        # one key/value head stacked (head i uses key/value head i // r)
        qg = q.view(b, s, g, r, d).permute(0, 2, 3, 1, 4).reshape(b * g, r * s, d)
        kg, vg = (t.permute(0, 2, 1, 3).reshape(b * g, s, d) for t in (k, v))   # [b*g, s, d]
        scores = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)                 # [b*g, r*s, s]
        hidden = self._hidden(b, s, causal, document_ids, q.device)
        if hidden is not None:
            # [b*g, r*s, s] -> [b, g, r, s, s]; hidden [b or 1, 1, 1, s, s] broadcasts
            scores.view(b, g, r, s, s).masked_fill_(hidden, float("-inf"))
        # The softmax kernel accumulates in fp32 for bf16 / fp16 and rounds its output once.
        probs = torch.softmax(scores, dim=-1)                                   # [b*g, r*s, s]
        if dropout_p:
            probs = F.dropout(probs, p=dropout_p)
        out = torch.bmm(probs, vg)                                              # [b*g, r*s, d]
        # [b*g, r*s, d] -> [b, g, r, s, d] -> [b, s, g, r, d] -> [b, s, h, d]
        return out.view(b, g, r, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h, d)

    @staticmethod
    def _hidden(b, s, causal, document_ids, device):
        """Bool [b or 1, 1, 1, s, s], True where query i must not see key j; None: no mask."""
        if document_ids is not None:
            allowed = document_causal_mask(document_ids, causal=causal)         # [b, 1, s, s]
            return ~allowed[:, :, None]                                         # [b, 1, 1, s, s]
        if not causal:
            return None
        return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None, None]


# Input dtypes the fused kernels (flash-attn, TE) accept; other dtypes fall back to SDPA per call.
FUSED_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttention(AttentionBackend):
    """flash-attn 2: flash_attn_func on [b, s, h, d]; with documents flash_attn_varlen_func on the
    flattened [b*s, h, d] tokens with int32 cu_seqlens. GQA is native (h % g == 0). fp16/bf16 on
    CUDA only, as flash-attn itself requires."""

    name = "flash"

    def __init__(self):
        super().__init__()
        self._flash_attn = import_optional("flash_attn", self.name)
        self._documents = DocumentCache()
        self._sdpa = SDPAAttention()

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0):
        check_shapes(q, k, v, document_ids)
        if q.dtype not in FUSED_DTYPES:   # flash-attn has fp16/bf16 kernels only: fp32 runs use SDPA
            return self._sdpa(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              document_ids=document_ids, dropout_p=dropout_p)
        fa = self._flash_attn
        if document_ids is None:
            return fa.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                                      causal=causal)
        (b, s, h, d), g = q.shape, k.shape[2]
        cu_seqlens, max_seqlen = self._documents(document_ids)
        out = fa.flash_attn_varlen_func(
            q.reshape(b * s, h, d), k.reshape(b * s, g, d), v.reshape(b * s, g, d),  # [t, heads, d]
            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal)
        return out.view(b, s, h, d)                                   # [t, h, d] -> [b, s, h, d]


class TEAttention(AttentionBackend):
    """Transformer Engine DotProductAttention, one module per (h, g, d, format, mask, dropout, scale)
    built on first use and cached (it holds no parameters). Unpacked: qkv_format "bshd",
    attn_mask_type "causal". With documents: qkv_format "thd" on the flattened [b*s, h, d] tokens,
    attn_mask_type "padding_causal", cu_seqlens_q/kv and max_seqlen_q/kv. TE returns the heads
    merged ([b, s, h*d] or [t, h*d]); we return [b, s, h, d]."""

    name = "te"

    def __init__(self):
        super().__init__()
        self._te = import_optional("transformer_engine.pytorch", self.name)
        self._documents = DocumentCache()
        self._cache = {}
        self._sdpa = SDPAAttention()

    def _module(self, h, g, d, qkv_format, mask_type, dropout_p, softmax_scale):
        key = (h, g, d, qkv_format, mask_type, float(dropout_p), float(softmax_scale))
        module = self._cache.get(key)
        if module is None:
            module = self._te.DotProductAttention(
                h, d, num_gqa_groups=g, attention_dropout=dropout_p, qkv_format=qkv_format,
                attn_mask_type=mask_type, softmax_scale=softmax_scale)
            self._cache[key] = module
        module.train(dropout_p > 0)  # TE applies attention_dropout only in training mode
        return module

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0):
        check_shapes(q, k, v, document_ids)
        if q.dtype not in FUSED_DTYPES:   # TE's fused kernels are fp16/bf16: fp32 runs use SDPA
            return self._sdpa(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              document_ids=document_ids, dropout_p=dropout_p)
        (b, s, h, d), g = q.shape, k.shape[2]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        if document_ids is None:
            mask_type = "causal" if causal else "no_mask"
            te_attention = self._module(h, g, d, "bshd", mask_type, dropout_p, scale)
            out = te_attention(q, k, v, qkv_format="bshd", attn_mask_type=mask_type)
            return out.view(b, s, h, d)                               # [b, s, h*d] -> [b, s, h, d]
        mask_type = "padding_causal" if causal else "padding"
        cu_seqlens, max_seqlen = self._documents(document_ids)
        te_attention = self._module(h, g, d, "thd", mask_type, dropout_p, scale)
        out = te_attention(
            q.reshape(b * s, h, d), k.reshape(b * s, g, d), v.reshape(b * s, g, d),  # [t, heads, d]
            qkv_format="thd", attn_mask_type=mask_type,
            cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return out.view(b, s, h, d)                                   # [t, h*d] -> [b, s, h, d]


_BACKENDS = {"te": TEAttention, "flash": FlashAttention, "sdpa": SDPAAttention,
             "unfused": UnfusedAttention}


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """Build the attention backend `name` ("auto" | "te" | "flash" | "sdpa" | "unfused" | "flex").

    auto: Transformer Engine, then flash-attn, then SDPA; the first two only when CUDA is
    available (they have no CPU kernels). Under auto, SDPA on CUDA attends packed documents past
    MASK_TOKENS through FlexAttention (blockwise elsewhere). An explicit "te" or "flash" whose
    package is missing raises AttentionBackendUnavailable naming the package and how to install it.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}: choose one of "
                         f"{', '.join(BACKEND_NAMES)}.")
    if name == "flex":
        from megatron_sp.attention.flex import FlexAttention
        return FlexAttention()
    if name != "auto":
        return _BACKENDS[name]()
    if torch.cuda.is_available():
        for candidate in ("te", "flash"):
            try:
                return _BACKENDS[candidate]()
            except AttentionBackendUnavailable:
                continue
        from megatron_sp.attention.flex import flex_available
        return SDPAAttention(long_documents="flex" if flex_available() else "blockwise")
    return SDPAAttention()
