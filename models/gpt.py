"""The GPT model (GPT-2 and Llama families): one class for every parallel layout.

Shapes through one layer (docs/design.md §4): b batch, s full sequence, H hidden, h query heads, g key/value
heads, d head dim, tp/sp the tensor- and sequence-parallel sizes.

    x            [b, s/sp, H]       ([b, s/(sp*tp), H] with --sequence-parallel)
    qkv          ColumnParallelLinear -> q [b, s/sp, h/tp, d], k, v [b, s/sp, g/tp, d]
    attention    Ulysses: seq->head all-to-all, causal attention over s, head->seq all-to-all
    out proj     RowParallelLinear (all-reduce, or reduce-scatter with --sequence-parallel)
    mlp          ColumnParallelLinear -> activation -> RowParallelLinear

The model takes the *full* micro-batch ([b, s] token ids, as every rank of a data-parallel replica
loads it) and keeps its own contiguous sequence chunk: sp rank r holds positions [r*s/sp, (r+1)*s/sp),
so positions stay global and document ids for packed attention are available for the whole sequence.
With a one-rank mesh it is a plain nn.Module: `model(input_ids) -> logits`.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_sp.attention import get_attention_backend
from megatron_sp.memory import (MemoryOptions, RecomputedAttention, checkpoint,
                                chunked_output_loss, forward_layers, tiled_mlp)
from megatron_sp.mesh import LayoutError, ParallelMesh
from megatron_sp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                         VocabParallelEmbedding, vocab_parallel_cross_entropy)
from megatron_sp.tensor_parallel import mappings
from megatron_sp.tensor_parallel.layers import sequence_parallel_linear
from megatron_sp.context_parallel import RingLocalAttention, zigzag_split
from megatron_sp.context_parallel.balance import LayoutPlanner
from megatron_sp.context_parallel.te import TEContextParallelAttention
from megatron_sp.context_parallel.te_thd import thd_work
from megatron_sp.ulysses import UlyssesAttention, check_head_chunks

from .config import GPTConfig
from .moe import MoEMLP
from .rope import rope_frequencies


def _mark_sequence_parallel(module: nn.Module) -> None:
    """Flag tp-replicated parameters whose gradients are partial under --sequence-parallel.

    They see only this tp rank's s/(sp*tp) tokens, so their gradients are all-reduced over tp.
    """
    for p in module.parameters():
        p.sequence_parallel = True


def _mark_sequence_parallel_moe(mlp: nn.Module) -> None:
    """A MoE MLP under --sequence-parallel: the router, the shared expert and whole experts that
    are not expert-parallel are replicated over tp but see only this tp rank's tokens, so their
    gradients are summed over tp like the norms'. Expert-parallel experts are summed over their
    edp group instead, which already holds the tp ranks; tp-split experts (etp = tp) compute on
    every tp rank's tokens, so theirs are whole."""
    for name, p in mlp.named_parameters():
        # Experts split over tp (etp = tp) see every tp rank's tokens: their gradients are whole.
        if not getattr(p, "expert_parallel", False) and getattr(p, "tp_partition_dim", None) is None:
            p.sequence_parallel = True


class LayerNorm1P(nn.LayerNorm):
    """--apply-layernorm-1p (Megatron's zero-centred gamma): the weight w stores gamma - 1
    (initialised to 0, so weight decay pulls gamma towards 1) and the norm applies 1 + w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(nn.RMSNorm):
    """The RMSNorm variant of LayerNorm1P: x / rms(x) * (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        norm = RMSNorm1P if config.apply_layernorm_1p else nn.RMSNorm
        return norm(config.hidden_size, eps=config.norm_epsilon)
    norm = LayerNorm1P if config.apply_layernorm_1p else nn.LayerNorm
    return norm(config.hidden_size, eps=config.norm_epsilon)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al.) with the half-split (rotate_half) convention of Llama / Megatron.

    config: its Llama-3.1 scaling or YaRN frequencies and cos/sin scaling (models/rope.py).
    """

    def __init__(self, head_dim: int, base: float, config: GPTConfig | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.attention_scaling = 1.0
        if config is not None:
            inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s_l] (global positions) -> cos, sin [b, s_l, 1, d]."""
        angles = position_ids.float()[..., None] * self.inv_freq  # [b, s_l, d/2]
        emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]    # [b, s_l, 1, d]
        if self.attention_scaling != 1.0:                           # YaRN's mscale
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x_i, x_{i+d/2}) of x [b, s_l, heads, d] turned by its angle (cos, sin [b, s_l, 1,
    d/2]): x1 cos - x2 sin | x2 cos + x1 sin (x * cos + rotate_half(x) * sin), written straight
    into the output's halves in x's dtype; the products are taken in fp32 when cos and sin are."""
    x1, x2 = x.chunk(2, dim=-1)                         # each [b, s_l, heads, d/2] (views)
    if torch.compiler.is_compiling():
        # --torch-compile: out= into views of one buffer is mistraced (torch 2.13 AOTAutograd gives
        # the second rotation in a graph wrong values); the compiler fuses the functional form.
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class _Rotary(torch.autograd.Function):
    """RoPE as an autograd function: a rotation's gradient is the rotation by the opposite angle,
    so backward needs only cos and sin (no activation is saved, no fp32 copy of x is made)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, -sin), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s_l, heads, d] rotated by its positions' angles, products in fp32 (cos, sin are).

    cos, sin [b, s_l, 1, r] (both halves equal, the rotate_half layout): with r < d
    (--rotary-percent) only the first r dimensions rotate and the other d - r pass through, as
    Megatron-LM's apply_rotary_pos_emb.
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        x_rot, x_pass = x[..., :r], x[..., r:]          # [b, s_l, heads, r], [..., d - r]
        return torch.cat([apply_rotary(x_rot.contiguous(), cos, sin), x_pass], dim=-1)
    half = r // 2                                       # cos, sin [b, s_l, 1, r] -> [..., r/2]
    return _Rotary.apply(x, cos[..., :half], sin[..., :half])


class HeadRMSNorm(nn.RMSNorm):
    """--qk-layernorm's RMSNorm over head_dim, its weight cast to the input's dtype: under bf16
    autocast q and k come out of the QKV linear in bf16, and one dtype lets PyTorch run its fused
    kernel on CUDA (fp32 accumulation inside) instead of the decomposed ops that save three copies
    (on CPU F.rms_norm is always the decomposition)."""

    zero_centered = False   # --apply-layernorm-1p: the weight stores gamma - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1 if self.zero_centered else self.weight
        return F.rms_norm(x, self.normalized_shape, gamma.to(x.dtype), self.eps)


class HeadLayerNorm(nn.LayerNorm):
    """The LayerNorm variant of HeadRMSNorm (--qk-layernorm with --normalization LayerNorm)."""

    zero_centered = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1 if self.zero_centered else self.weight
        return F.layer_norm(x, self.normalized_shape, gamma.to(x.dtype),
                            self.bias.to(x.dtype), self.eps)


def make_head_norm(config: GPTConfig) -> nn.Module:
    norm = HeadRMSNorm if config.normalization == "RMSNorm" else HeadLayerNorm
    norm = norm(config.kv_channels, eps=config.norm_epsilon)
    norm.zero_centered = config.apply_layernorm_1p
    return norm


def ring_attention_for(backend, mesh: ParallelMesh):
    """The local attention after Ulysses' exchange when a ring splits the context (cp > 1): our
    ring (RingLocalAttention), or with Transformer Engine as the backend TE's own context
    parallelism over the same ring group (its p2p exchange; our Ulysses stays outside, as our
    hybrid layout is TE's p2p layout per ring). Selective recompute (the backend comes wrapped)
    then recomputes the ring itself, its kv blocks sent again in backward (the planner counts
    the ring's bytes twice)."""
    recompute = isinstance(backend, RecomputedAttention)
    inner = backend.backend if recompute else backend
    if getattr(inner, "name", None) == "te":
        ring = TEContextParallelAttention(mesh.cp_group)
    else:
        ring = RingLocalAttention(mesh.cp_group)
    return RecomputedAttention(ring) if recompute else ring


class SelfAttention(nn.Module):
    """Causal self-attention: column-parallel QKV, Ulysses attention, row-parallel output.

    head_chunks = N > 1 (--ulysses-head-chunks; UPipe, Ghadia et al. 2026, "Untied Ulysses"):
    the whole block runs over N groups of heads in turn, GQA groups kept whole. Chunk c projects
    its own heads' rows of the fused QKV weight (a view of it: whole groups; or, with fewer
    key/value groups than chunks, an equal share of one group's query heads with its key and
    value), applies the qk-norm and RoPE, runs Ulysses (its seq->head all-to-all, the local
    attention or the ring, the head->seq all-to-all) and multiplies by its heads' columns of the
    output weight; the chunks' partial products are summed and reduced over tp once (row
    parallel). Each chunk is one activation checkpoint whose only saved input is the block's
    input (one tensor, shared by every chunk): nothing at the head layout, no q, k, v, out or
    logsumexp of the whole layer is kept, and in backward one chunk's are live at a time.
    Exact (attention is per head; the output projection is a sum over heads): the result is
    plain Ulysses', the partial sums added in the output's dtype. Costs: the chunks' recompute
    (QKV projection, exchange, attention) in backward, and under --sequence-parallel the input's
    tp all-gather once per chunk.
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, backend, sequence_parallel: bool,
                 rng_tracker=None, head_chunks: int = 1):
        super().__init__()
        tp = mesh.tp_size
        self.heads_local = config.num_attention_heads // tp
        self.groups_local = config.num_query_groups // tp
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.kv_channels
        self.dropout = config.attention_dropout
        self.rng_tracker = rng_tracker
        # Fused QKV in Megatron's grouped layout: rows are [g groups x (q_per_group q, 1 k, 1 v) x d],
        # so a contiguous tp slice of rows holds g/tp whole groups.
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.qkv = ColumnParallelLinear(config.hidden_size, qkv_out, mesh=mesh,
                                        bias=config.add_qkv_bias, sequence_parallel=sequence_parallel)
        local = ring_attention_for(backend, mesh) if mesh.cp_size > 1 else backend
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise LayoutError(f"head_chunks must be an integer >= 1, got {head_chunks!r}.")
        if head_chunks > 1:   # refused here too when built without pretrain_gpt's start-up check
            check_head_chunks(self.heads_local, self.groups_local, mesh.sp_size, head_chunks)
        self.head_chunks = head_chunks
        self.core = UlyssesAttention(local, mesh.sp_group)
        # --qk-layernorm (Qwen3): one norm over d shared by every head; each tp rank normalises its
        # own heads, so the weights' gradients are partial over tp and summed there (grad_sync).
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = make_head_norm(config), make_head_norm(config)
            for module in (self.q_layernorm, self.k_layernorm):
                _mark_sequence_parallel(module)
        self.proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                      mesh=mesh, bias=config.add_bias_linear,
                                      sequence_parallel=sequence_parallel)

    def _qk_norm_rope(self, qkv, rope):
        """--qk-layernorm then RoPE on the grouped QKV output, recomputed in backward: the only
        tensor kept is that output (one copy of q, k, v), instead of q, k and the norms' own saves.

        qkv [b, s/sp, groups, q_per_group + 2, d] -> q [b, s/sp, groups * q_per_group, d],
        k [b, s/sp, groups, d].
        """
        b, s_l, groups, per = qkv.shape[:4]
        per -= 2

        def run(qkv, *cos_sin):
            q, k, _ = qkv.split([per, 1, 1], dim=3)
            # The norm's output is contiguous: [b, s/sp, groups, per, d] -> [b, s/sp, groups*per, d]
            q = self.q_layernorm(q).reshape(b, s_l, groups * per, self.head_dim)
            k = self.k_layernorm(k.squeeze(3))                    # [b, s/sp, groups, d]
            if cos_sin:
                q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
            return q, k
        if not torch.is_grad_enabled():
            return run(qkv, *(rope or ()))
        return checkpoint(run, qkv, *(rope or ()))

    def _heads(self, qkv, rope, groups=None, per=None):
        """The grouped QKV output qkv [b, s/sp, groups * (per + 2) * d] (per query heads in each
        of its groups; default this rank's g/tp and h/g) -> q [b, s/sp, groups * per, d],
        k, v [b, s/sp, groups, d], qk-normed and rotated."""
        b, s_l = qkv.shape[:2]
        groups = self.groups_local if groups is None else groups
        per = self.q_per_group if per is None else per
        d = self.head_dim
        # [b, s/sp, groups * (per + 2) * d] -> [b, s/sp, groups, per + 2, d]: per group its q, k, v
        qkv = qkv.view(b, s_l, groups, per + 2, d)
        # One split (its backward is one concatenation, not three zero-filled scatters).
        q, k, v = qkv.split([per, 1, 1], dim=3)
        if self.q_layernorm is not None:   # per head, before RoPE and the seq->head exchange
            (q, k), v = self._qk_norm_rope(qkv, rope), v.squeeze(3)
        else:
            q = q.reshape(b, s_l, groups * per, d)                # [b, s/sp, groups * per, d]
            k, v = k.squeeze(3), v.squeeze(3)                     # [b, s/sp, groups, d] each
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k.contiguous(), v.contiguous()

    def _attend(self, q, k, v, document_ids):
        """Ulysses attention (dropout from the tp-aware RNG stream) -> [b, s/sp, heads * d]."""
        dropout = self.dropout if self.training else 0.0
        fork = self.rng_tracker.fork() if (self.rng_tracker and dropout) else contextlib.nullcontext()
        with fork:
            out = self.core(q, k, v, dropout_p=dropout,
                            document_ids=document_ids)   # [b, s/sp, heads, d]
        return out.flatten(2)                           # [b, s/sp, heads, d] -> [b, s/sp, heads * d]

    def forward(self, x, rope=None, document_ids=None):
        if self.head_chunks > 1:
            return self._forward_in_head_chunks(x, rope, document_ids)
        q, k, v = self._heads(self.qkv(x), rope)                  # qkv [b, s/sp, (h+2g)/tp * d]
        return self.proj(self._attend(q, k, v, document_ids))

    def head_chunk_weights(self, c: int):
        """Head chunk c's rows of the fused QKV weight and bias (views when it holds whole groups,
        else a small copy), its heads' columns of the output weight (a view), and its number of
        groups and of query heads per group."""
        n, g, per, d = self.head_chunks, self.groups_local, self.q_per_group, self.head_dim
        if g % n == 0:                        # g/N whole groups, all their query heads
            g0, g1, first, share = c * (g // n), (c + 1) * (g // n), 0, per
        else:                                 # N % g == 0: a share of one group's query heads
            split = n // g
            g0, part = divmod(c, split)
            g1, share = g0 + 1, per // split
            first = part * share

        def rows(t):                          # [g * (per + 2) * d, ...] -> the chunk's rows
            # [g * (per + 2) * d, ...] -> [g, per + 2, d, ...], then the chunk's groups
            t = t.view(g, per + 2, d, *t.shape[1:])[g0:g1]
            if share < per:                   # its query heads, then the group's k and v
                t = torch.cat([t[:, first:first + share], t[:, per:]], dim=1)
            return t.reshape(-1, *t.shape[3:])  # [groups, share + 2, d, ...] -> [rows, ...]
        h0 = g0 * per + first                  # its query heads are contiguous: [h0, h1)
        h1 = h0 + (g1 - g0) * share
        bias = None if self.qkv.bias is None else rows(self.qkv.bias)
        return rows(self.qkv.weight), bias, self.proj.weight[:, h0 * d:h1 * d], g1 - g0, share

    def _forward_in_head_chunks(self, x, rope, document_ids):
        """The block over head chunks in turn (class docstring): [b, s/sp, H] -> [b, s/sp, H]."""
        if self.qkv.sequence_parallel:        # each chunk all-gathers the saved shard again
            def project(x, w, b):
                return sequence_parallel_linear(x, w, b, self.qkv.group)
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.qkv.group)

            def project(x, w, b):
                return F.linear(x, w, b)
        dtype = torch.get_autocast_dtype(x.device.type) \
            if torch.is_autocast_enabled(x.device.type) else None
        if dtype is not None:                 # the chunks' one saved input, in the matmul dtype
            x = x.to(dtype)
        cos_sin = tuple(rope) if rope is not None else ()

        def chunk(x, document_ids, *cos_sin, c):
            w, b, w_out, groups, per = self.head_chunk_weights(c)
            q, k, v = self._heads(project(x, w, b), cos_sin or None, groups, per)
            return F.linear(self._attend(q, k, v, document_ids), w_out)   # [b, s_l, H], partial

        y = None
        for c in range(self.head_chunks):
            run = functools.partial(chunk, c=c)
            part = (checkpoint(run, x, document_ids, *cos_sin, rng_tracker=self.rng_tracker)
                    if torch.is_grad_enabled() else run(x, document_ids, *cos_sin))
            y = part if y is None else y.add_(part)
        return self.proj.reduce_partial(y)


class MLP(nn.Module):
    """Column-parallel fc1 -> activation -> row-parallel fc2 (SwiGLU: fused gate and up).

    tiles > 1 (or "auto"): run over sequence tiles, each recomputed in backward (megatron_sp.memory).
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, sequence_parallel: bool, tiles=1):
        super().__init__()
        self.tiles = tiles
        self.swiglu = config.activation == "swiglu"
        self.activation = config.activation
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.fc1 = ColumnParallelLinear(config.hidden_size, fc1_out, mesh=mesh,
                                        bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
                                        chunks=2 if self.swiglu else 1)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, mesh=mesh,
                                     bias=config.add_bias_linear, sequence_parallel=sequence_parallel)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)      # each [b, s_l, F/tp]
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def _forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

    def forward(self, x):
        if self.tiles == 1:
            return self._forward(x)
        return tiled_mlp(self._forward, x, self.tiles, ffn_width=self.fc1.out_per_rank)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config, mesh, backend, sequence_parallel, rng_tracker=None, mlp_tiles=1,
                 head_chunks=1, layer_number=0, expert_groups=None, expert_tp_group=None):
        super().__init__()
        self.input_norm = make_norm(config)
        self.attention = SelfAttention(config, mesh, backend, sequence_parallel, rng_tracker,
                                       head_chunks=head_chunks)
        self.post_attention_norm = make_norm(config)
        if config.is_moe_layer(layer_number):   # experts (models/moe.py); --mlp-tiles: dense only
            self.mlp = MoEMLP(config.moe_config(), config.hidden_size, expert_groups=expert_groups,
                              expert_tp_group=expert_tp_group)
            if sequence_parallel:   # tp ranks hold different tokens: they count as context too
                self.mlp.context_group = mesh.token_group()
                _mark_sequence_parallel_moe(self.mlp)
            elif mesh.sp_size * mesh.cp_size > 1:   # the router losses over whole sequences
                self.mlp.context_group = mesh.context_group()
        else:
            self.mlp = MLP(config, mesh, sequence_parallel, tiles=mlp_tiles)
        self.hidden_dropout = config.hidden_dropout
        self.rng_tracker = rng_tracker if sequence_parallel else None
        if sequence_parallel:
            for module in (self.input_norm, self.post_attention_norm):
                _mark_sequence_parallel(module)

    def _dropout(self, x):
        if not (self.training and self.hidden_dropout):
            return x
        # With sequence sharding each tp rank holds different tokens: different masks.
        fork = self.rng_tracker.fork() if self.rng_tracker else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.hidden_dropout, training=True)

    def forward(self, x, rope=None, document_ids=None):
        x = x + self._dropout(self.attention(self.input_norm(x), rope, document_ids))
        return x + self._dropout(self.mlp(self.post_attention_norm(x)))


class Embedding(nn.Module):
    """Vocabulary-parallel word embeddings (+ learned positions for GPT-2).

    with_positions=False builds the word embeddings only: the last pipeline stage's copy of tied
    embeddings serves the output layer and never embeds (as in Megatron-LM).
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, sequence_parallel: bool,
                 with_positions: bool = True):
        super().__init__()
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(mesh.tp_size),
                                                      config.hidden_size, mesh=mesh)
        # Padding rows beyond the real vocabulary start at zero in every layout.
        self.word_embeddings.weight.real_rows = config.vocab_size
        self.word_embeddings.weight.is_embedding_or_output_parameter = True   # --decoupled-lr
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute" and with_positions:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = config.hidden_dropout

    def forward(self, input_ids, position_ids, rng_tracker=None):
        x = self.word_embeddings(input_ids)                       # [b, s/sp, H], replicated over tp
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        # Split after the sum: the backward all-gather hands every tp rank the full gradient of both
        # embeddings, so neither needs a tp all-reduce.
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.mesh.tp_group)  # [b, s/(sp*tp), H]
        if self.training and self.dropout:
            fork = rng_tracker.fork() if (rng_tracker and self.sequence_parallel) else contextlib.nullcontext()
            with fork:
                x = F.dropout(x, self.dropout, training=True)
        return x


class GPTModel(nn.Module):
    """A GPT decoder (or one pipeline stage of it) for any (tp, sp, pp, dp) layout.

    Args:
        config: the model shapes.
        mesh: the parallel mesh (None: one rank, no torch.distributed needed).
        layer_ids: the global layer indices this stage holds (default: all layers).
        pre_process / post_process: whether this stage holds the embedding / the final norm, output
            layer and loss (default: first / last pipeline stage).
        attention_backend: "auto" | "te" | "flash" | "sdpa", or a backend object.
        sequence_parallel: Megatron's --sequence-parallel (tp sequence sharding).
        rng_tracker: megatron_sp.tensor_parallel.RNGTracker for dropout inside tp regions.
        memory: megatron_sp.memory.MemoryOptions (recompute, tiled MLP, chunked loss, offload).
        expert_parallel_size: --expert-model-parallel-size: the MoE layers hold E/ep experts each,
            their tokens dispatched by all-to-all over the ep group (mesh.expert_groups: ep
            consecutive ranks of the stage's (dp, cp, sp, tp) order; tp > 1 needs --sequence-parallel).
        context_parallel_layout: --context-parallel-layout, which tokens each ring rank holds
            with packed documents (context_parallel/balance.py): "balanced" (each rank the same
            causal work) or "zigzag" (chunks r and 2cp-1-r of the row); without documents both
            are the zigzag.
        expert_tensor_parallel_size: --expert-tensor-parallel-size: 1, whole experts (each tp
            rank routes its own tokens, ep folded over tp too); tp (None: the default, as in
            Megatron-LM), the experts split over tp like the dense SwiGLU MLP, the tokens
            all-gathered over tp around them, ep over dp x cp x sp.

    host_pool (attribute, default None): a megatron_sp.memory.host_pool.HostPool that holds the
    activations offloaded under memory.offload_activations (None: torch's pinned buffers).
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh | None = None, *, layer_ids=None,
                 pre_process: bool | None = None, post_process: bool | None = None,
                 attention_backend="sdpa", sequence_parallel: bool = False, rng_tracker=None,
                 memory: MemoryOptions | None = None, expert_parallel_size: int = 1,
                 expert_tensor_parallel_size: int | None = None,
                 context_parallel_layout: str = "balanced"):
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        config.check_parallel(mesh.tp_size, mesh.sp_size, mesh.pp_size,
                              sequence_parallel=sequence_parallel)
        # Expert parallelism (--expert-model-parallel-size): the groups are built once on the
        # mesh (collective: every rank asks here, whatever layers its stage holds).
        expert_groups = None
        if expert_parallel_size != 1:
            if not getattr(config, "num_experts", None):
                raise LayoutError(f"--expert-model-parallel-size {expert_parallel_size} needs a "
                                  f"mixture-of-experts model (--num-experts).")
            if config.num_experts % expert_parallel_size:
                raise LayoutError(f"--num-experts {config.num_experts} is not divisible by "
                                  f"--expert-model-parallel-size {expert_parallel_size}: each "
                                  f"expert-parallel rank must hold the same number of whole experts.")
        etp = self._expert_tensor_parallel_size(config, mesh, expert_parallel_size,
                                                expert_tensor_parallel_size)
        if expert_parallel_size != 1:
            expert_groups = mesh.expert_groups(expert_parallel_size, etp)
        expert_tp_group = mesh.tp_group if etp > 1 else None
        self.expert_parallel_size, self.expert_tensor_parallel_size = expert_parallel_size, etp
        self.config, self.mesh = config, mesh
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        self.rng_tracker = rng_tracker
        self.pre_process = mesh.is_first_stage if pre_process is None else pre_process
        self.post_process = mesh.is_last_stage if post_process is None else post_process
        self.layer_ids = list(range(config.num_layers)) if layer_ids is None else list(layer_ids)
        backend = get_attention_backend(attention_backend) if isinstance(attention_backend, str) \
            else attention_backend
        self.attention_backend_name = getattr(backend, "name", type(backend).__name__)
        if mesh.cp_size > 1:   # the ring replaces the backend (its block kernels: attention/lse.py)
            self.attention_backend_name = (f"ring over cp={mesh.cp_size} "
                                           f"(segments, attention/block_kernels.py)")
        self.memory = memory or MemoryOptions()
        self.host_pool = None
        if self.memory.selective_recompute:
            backend = RecomputedAttention(backend)

        # Tied embeddings: the last stage keeps its own copy of the word embeddings under the same
        # global name; the embedding group sums their gradients so both copies stay identical.
        needs_embedding = self.pre_process or (self.post_process and config.tie_embeddings)
        self.embedding = (Embedding(config, mesh, self.sequence_parallel,
                                    with_positions=self.pre_process) if needs_embedding else None)
        if needs_embedding and config.tie_embeddings and mesh.pp_size > 1:
            weight = self.embedding.word_embeddings.weight
            weight.embedding_tied = True                 # gradient summed over the embedding group
            weight.embedding_copy = not self.pre_process  # counted once in the gradient norm
        self.rope = (RotaryEmbedding(config.kv_channels, config.rotary_base, config)
                     if config.uses_rope else None)
        # Keys are global layer indices, so parameter names are layout-independent.
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, mesh, backend, self.sequence_parallel, rng_tracker,
                                     mlp_tiles=self.memory.mlp_tiles,
                                     head_chunks=self.memory.ulysses_head_chunks, layer_number=i,
                                     expert_groups=expert_groups,
                                     expert_tp_group=expert_tp_group)
            for i in self.layer_ids})
        self._share_cp_planner(context_parallel_layout)
        self.final_norm = self.output_layer = None
        if self.post_process:
            self.final_norm = make_norm(config)
            if self.sequence_parallel:
                _mark_sequence_parallel(self.final_norm)
            if not config.tie_embeddings:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size(mesh.tp_size), mesh=mesh, bias=False,
                    sequence_parallel=self.sequence_parallel)
                self.output_layer.weight.real_rows = config.vocab_size
                self.output_layer.weight.is_embedding_or_output_parameter = True

    @staticmethod
    def _expert_tensor_parallel_size(config, mesh, ep: int, etp: int | None) -> int:
        """--expert-tensor-parallel-size resolved: None -> tp for a mixture-of-experts model
        (Megatron-LM's default: the experts split over tp, ep over dp x cp x sp), 1 for a dense
        one; else 1 (whole experts, ep folded over tp too: Megatron's "parallel folding") or tp."""
        if etp is None:
            etp = mesh.tp_size if getattr(config, "num_experts", None) else 1
        if etp == 1:
            return 1
        if not getattr(config, "num_experts", None):
            raise LayoutError(f"--expert-tensor-parallel-size {etp} needs a mixture-of-experts "
                              f"model (--num-experts).")
        if etp != mesh.tp_size:
            raise LayoutError(f"--expert-tensor-parallel-size {etp} must be 1 or "
                              f"--tensor-model-parallel-size {mesh.tp_size}: other expert "
                              f"tensor-parallel sizes are not implemented yet.")
        mesh.dims.check_expert_parallel(ep, etp)       # ep x etp must divide the stage's ranks
        return etp

    # Sequence sharding over cp and sp ---------------------------------------------------------
    def _share_cp_planner(self, kind: str) -> None:
        """One LayoutPlanner for this model's rings (cp > 1): the step's layout is computed once
        from the document ids, and the tokens this model gathers are the ones every ring plans."""
        self.cp_planner, self._cp_positions, self._cp_work = None, None, None
        self._te_ring = False
        if self.mesh.cp_size == 1:
            return
        self.cp_planner = LayoutPlanner(kind, self.mesh.cp_size, self.mesh.cp_rank)
        for module in self.modules():
            if isinstance(module, RingLocalAttention):
                module.planner = self.cp_planner
        self._te_ring = any(isinstance(m, TEContextParallelAttention) for m in self.modules())

    def _set_cp_layout(self, document_ids) -> None:
        """This step's ring layout: the balanced one's positions [b, s/cp] when the planner uses
        it for these documents, else None (the whole-row zigzag)."""
        planner, self._cp_positions = self.cp_planner, None
        if planner is None or document_ids is None:
            return
        layout = planner.layout(document_ids, *document_ids.shape)
        # every ring rank's causal pairs, this micro-batch: in TE's thd layout where TE attends
        work = thd_work(layout) if self._tes_thd(document_ids.device) else layout.work()
        self._cp_work = work if self._cp_work is None else [a + b for a, b in
                                                            zip(self._cp_work, work)]
        if planner.uses_layout(document_ids):
            self._cp_positions = layout.positions(self.mesh.cp_rank, document_ids.device)

    def _tes_thd(self, device) -> bool:
        """Whether TE's context parallelism attends this forward's packed documents (its thd
        layout; 16-bit only: fp32 runs our ring)."""
        if not self._te_ring:
            return False
        dtype = (torch.get_autocast_dtype(device.type)
                 if torch.is_autocast_enabled(device.type) else next(self.parameters()).dtype)
        return dtype in (torch.float16, torch.bfloat16)

    def take_cp_work(self) -> list[int] | None:
        """Every ring rank's causal (query, key) pairs summed over the forwards since the last
        call (packed documents under a ring; None otherwise), and start counting anew."""
        work, self._cp_work = self._cp_work, None
        return work

    def shard_sequence(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's tokens of a full-sequence tensor [b, s, ...] -> [b, s/(sp*cp), ...]: with a
        ring (cp > 1) its ring rank's tokens (zigzag chunks r and 2cp-1-r, docs/design.md §14, or
        the balanced layout of the last forward's packed documents), then this sp rank's
        contiguous part of them. Positions, labels and the loss mask all go through here, so
        RoPE and the loss follow the same layout."""
        mesh = self.mesh
        if t is None or mesh.sp_size * mesh.cp_size == 1:
            return t
        mesh.check_sequence(t.shape[1], what="sequence length")   # LayoutError, a ValueError
        if mesh.cp_size > 1 and self._cp_positions is not None:
            index = self._cp_positions                               # [b, s/cp]
            t = t.expand(index.shape[0], *t.shape[1:])
            index = index.view(*index.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:])
            t = t.gather(1, index)                                   # [b, s, ...] -> [b, s/cp, ...]
        elif mesh.cp_size > 1:
            t = zigzag_split(t, mesh.cp_size, mesh.cp_rank, dim=1)  # [b, s/cp, ...]
        chunk = t.shape[1] // mesh.sp_size
        return t[:, mesh.sp_rank * chunk:(mesh.sp_rank + 1) * chunk]

    # Forward -----------------------------------------------------------------------------------
    def forward(self, input_ids=None, position_ids=None, labels=None, document_ids=None,
                hidden_states=None):
        """Run this stage.

        input_ids, position_ids, labels, document_ids: full-sequence [b, s] tensors (labels already
        shifted). hidden_states: the previous stage's output [b, s/sp, H] when not pre_process.
        Returns hidden states [b, s/sp, H] when not post_process; otherwise the per-token loss of this
        rank's chunk [b, s/sp] (fp32, unreduced) when labels are given, else the logits of this rank's
        chunk [b, s/sp, V/tp] (with one tp rank: the real vocabulary only).
        """
        ref = input_ids if input_ids is not None else labels
        if position_ids is None:
            s = (ref.shape[1] if ref is not None
                 else hidden_states.shape[1] * self.mesh.sp_size * self.mesh.cp_size)
            position_ids = torch.arange(s, device=(ref if ref is not None else hidden_states).device)
            position_ids = position_ids.unsqueeze(0).expand(
                (ref if ref is not None else hidden_states).shape[0], -1)
        window = self.config.sliding_window
        if window and position_ids.shape[1] > window:
            raise ValueError(f"sequence length {position_ids.shape[1]} exceeds the model's sliding "
                             f"window {window}: sliding-window attention is not implemented, so "
                             f"train with --seq-length <= {window}.")
        self._set_cp_layout(document_ids)
        positions = self.shard_sequence(position_ids)             # [b, s/sp] global positions
        if self.pre_process:
            x = self.embedding(self.shard_sequence(input_ids), positions, self.rng_tracker)
        else:
            x = hidden_states
        rope = self.rope(positions) if self.rope is not None else None
        x = forward_layers(self.layers.items(), x, rope, document_ids,
                           self.memory, self.rng_tracker, self.host_pool)
        if not self.post_process:
            return x
        return self.output(x, self.shard_sequence(labels))

    # Mixture of experts -------------------------------------------------------------------------
    def moe_layers(self) -> list:
        """This stage's MoE MLPs (models/moe.py MoEMLP), in layer order."""
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, MoEMLP)]

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """The gradient the router losses get in backward (the training loop: 1 / (micro-batches x
        data-parallel replicas), Megatron's averaging; 1 by default)."""
        for mlp in self.moe_layers():
            mlp.aux_loss_scale = scale

    def moe_router_losses(self) -> dict:
        """The last forward's router losses, the mean over this stage's MoE layers (detached)."""
        seen = [mlp.last_aux for mlp in self.moe_layers() if hasattr(mlp, "last_aux")]
        return {name: sum(float(aux[name]) for aux in seen) / len(seen)
                for name in ("load_balancing_loss", "z_loss")} if seen else {}

    def output_weight(self) -> torch.Tensor:
        return (self.embedding.word_embeddings.weight if self.config.tie_embeddings
                else self.output_layer.weight)

    def output(self, x, labels=None):
        """Final norm, output layer and (vocab-parallel) cross entropy; never gathers the vocab."""
        x = self.final_norm(x)
        if labels is not None and self.memory.loss_chunks != 1:
            return chunked_output_loss(x, labels, self.output_weight(), mesh=self.mesh,
                                       sequence_parallel=self.sequence_parallel,
                                       vocab_size=self.config.vocab_size,
                                       chunks=self.memory.loss_chunks)
        if self.output_layer is not None:
            logits = self.output_layer(x)                          # [b, s/sp, V/tp]
        else:
            if self.sequence_parallel:   # gathers [b, s/(sp*tp), H]; keeps the shard for backward
                logits = sequence_parallel_linear(x, self.output_weight(), None, self.mesh.tp_group)
            else:
                x = mappings.copy_to_tensor_parallel_region(x, self.mesh.tp_group)
                logits = F.linear(x, self.output_weight())         # [b, s/sp, V/tp]
        if labels is None:
            if self.mesh.tp_size == 1:
                logits = logits[..., :self.config.vocab_size]
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.mesh.tp_group,
                                            vocab_size=self.config.vocab_size)
