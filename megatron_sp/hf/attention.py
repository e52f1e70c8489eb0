"""Ulysses (x ring) around the attention function a transformers model was loaded with (§4, §15).

transformers routes every attention layer of llama / mistral / qwen2 / qwen3 / gpt2 through
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask,
dropout=, scaling=, **kwargs)` with query [b, h, s, d], key/value [b, g, s, d], returning
(out [b, s, h, d], weights). `sequence_parallel(model, sp_group)` registers a wrapper under a new
name, "megatron_sp_ulysses_<inner>", and sets the config to it; the wrapper runs, per layer,

    q, k, v [b, heads, s/sp, d] -> [b, s/sp, heads, d]       (this rank's sequence chunk)
    k, v: kv heads replicated when g < sp (our rule, megatron_sp.ulysses.expand_kv_heads)
    seq->head all-to-all (q, k, v in one)  -> [b, s, heads/sp, d]
    the ORIGINAL function (sdpa / flash_attention_2) on the whole sequence for heads/sp heads
    head->seq all-to-all                   -> [b, s/sp, h, d]

so the model's own code (projections, RoPE with the global position_ids shard_batch gives, norms,
MLP) runs unchanged on [b, s/sp, H]. The new name is not a mask implementation, so the model
builds no [s/sp, s/sp] mask (transformers skips mask creation for such names); the wrapper makes
the mask itself from the whole sequence's position_ids (all-gathered once per step):
- no document restarts: causal, no mask (is_causal), sdpa's fused kernels;
- packed documents (position_ids restarting at 0): under sdpa, our SDPA backend
  (megatron_sp.attention.SDPAAttention) with document ids: a block-diagonal causal bool mask up to
  its MASK_TOKENS, blockwise attention (no s x s tensor) beyond on CPU; under flash_attention_2,
  transformers' varlen kwargs cu_seq_lens_q/k and max_length_q/k over the flattened b*s tokens
  (written against transformers' documented kwargs; flash-attn is not installed here, so that
  path has NOT been run).
A padding attention_mask is not used by the attention under sp > 1: shard_batch gives padding
tokens position 0 (each its own document), which makes the same mask.

Past the head count, `sequence_parallel(model, sp_group, cp_group)` adds a ring of cp ranks
(Megatron-LM's a2a+p2p, megatron_sp.context_parallel): shard_batch gives each rank its tokens of
the hybrid zigzag layout (with packed documents: the balanced layout, megatron_sp.hf.layout),
and every layer runs the Megatron side's own composition,

    q, k, v [b, heads, n, d] -> [b, n, heads, d]     (n = s/(sp cp) tokens of this rank)
    UlyssesAttention(RingLocalAttention(cp_group), sp_group):
        seq->head all-to-all over sp                 [b, s/cp, heads/sp, d]
        ring attention over cp (fused block kernels, fp32 lse merge), against the whole sequence
        head->seq all-to-all over sp                 [b, n, h, d]

so an HF model trains one sequence on more ranks than it has heads (cp alone needs no head
rule). Packed documents are the FULL rows' document ids (the positions gathered over sp and cp
once per step, put back in sequence order: the balanced layout shard_batch remembered,
megatron_sp.hf.layout), planned by the ring as segments (attention/segments.py):
no [chunk, chunk] mask. The ring computes its attention itself (not the loaded sdpa /
flash_attention_2 function), refuses attention dropout and sliding windows shorter than the
sequence, as the Megatron side does.

sp_group and cp_group None or of size 1: the model is checked and returned unchanged (its own
attention).
"""
from __future__ import annotations

import copy
import inspect

import torch

from megatron_sp.attention.backends import SDPAAttention
from megatron_sp.attention.documents import cu_seqlens_from_document_ids
from megatron_sp.context_parallel.attention import RingLocalAttention
from megatron_sp.context_parallel.balance import LayoutPlanner
from megatron_sp.hf.batch import SequenceParallelError, document_ids, has_documents
from megatron_sp.hf.comm import gather_context, gather_layout_order, zigzag_order
from megatron_sp.hf.layout import KEEP, recall
from megatron_sp.mesh import group_rank, group_size, head_layout_problem
from megatron_sp.ulysses.attention import UlyssesAttention, expand_kv_heads
from megatron_sp.ulysses.comm import head_to_seq_all_to_all, seq_to_head_qkv_all_to_all

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "qwen3_moe", "qwen2_moe", "mixtral")
INNER = ("sdpa", "flash_attention_2")
PREFIX = "megatron_sp_ulysses_"
_STATE = "_megatron_sp_ulysses"          # the attribute each attention module carries


class _Documents:
    """The whole sequence's document ids, from the local position_ids every layer passes:
    all-gathered over sp (and cp, put back in sequence order) once per step (the same tensor
    object reaches every layer; keyed on it and its version, like megatron_sp.attention.backends'
    cu_seqlens cache)."""

    def __init__(self, sp_group, cp_group=None):
        self.sp_group, self.cp_group = sp_group, cp_group
        self._key = None
        self._value = None

    def __call__(self, position_ids, batch: int):
        """(global position_ids [b, s], document ids [b, s] or None when no row restarts)."""
        if position_ids is None:
            return None, None
        key = (position_ids, position_ids._version)
        if self._key is None or self._key[0] is not key[0] or self._key[1] != key[1]:
            local = position_ids.expand(batch, -1)                               # [b, n]
            full = self._full(local)                                             # [b, s]
            self._key = key
            self._value = (full, document_ids(full) if has_documents(full) else None)
        return self._value

    def _full(self, local):
        """The full rows' positions [b, s] in sequence order: the zigzag merged back, or under
        a ring with packed documents the balanced layout shard_batch remembered."""
        if group_size(self.cp_group) == 1:
            return gather_context(local, self.sp_group, self.cp_group)
        gathered = gather_layout_order(local, self.sp_group, self.cp_group)     # [b, s]
        full = recall(gathered)
        if full is None and not has_documents(gathered):                         # the zigzag
            return zigzag_order(gathered, group_size(self.cp_group))
        if full is None:
            raise SequenceParallelError(
                "megatron_sp.hf: these packed-document position_ids under the ring were not cut "
                "by megatron_sp.hf.shard_batch in this process (or were cut more than "
                f"{KEEP} batches ago), so the attention cannot tell where each token sits in "
                "its row; shard each micro-batch with shard_batch before its forward.")
        return full


class _State:
    def __init__(self, group, inner: str, cp_group=None):
        self.group = group
        self.sp = group_size(group)
        self.cp_group = cp_group
        self.cp = group_size(cp_group)
        self.inner = inner
        self.inner_fn = _original(inner)       # the function the model was loaded with
        self.documents = _Documents(group, cp_group)
        self.sdpa = SDPAAttention()
        # under a ring: the Megatron side's composition (context_parallel/hybrid.py)
        self.ring = (UlyssesAttention(RingLocalAttention(cp_group, LayoutPlanner(
            "balanced", self.cp, group_rank(cp_group))), group) if self.cp > 1 else None)

    def describe(self) -> str:
        """What each attention layer runs, for the trainers' start-up line."""
        if self.ring is not None:
            ulysses = f"Ulysses over sp {self.sp} around " if self.sp > 1 else ""
            return (f"{ulysses}ring attention over cp {self.cp} (megatron_sp's block kernels; "
                    f"the model's {self.inner} is not called)")
        return f"Ulysses over sp {self.sp} around the model's {self.inner}"


class _InnerView:
    """The attention module as the inner function must see it: config._attn_implementation the
    original name (flash_attention_2 looks its kernels up by it) and num_key_value_groups the
    query/key-value head ratio of THIS rank's heads after the all-to-all."""

    def __init__(self, module, inner: str, kv_groups: int):
        self._module = module
        self.config = _ConfigView(module.config, inner)
        self.num_key_value_groups = kv_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


class _ConfigView:
    def __init__(self, config, inner: str):
        self._config = config
        self._attn_implementation = inner

    def __getattr__(self, name):
        return getattr(self._config, name)


def _original(name: str):
    from transformers import AttentionInterface
    return AttentionInterface._global_mapping[name]


def _check_window(kwargs, s: int, what: str = "the Ulysses wrapper"):
    window = kwargs.get("sliding_window")
    if window is not None and window < s:
        raise SequenceParallelError(
            f"megatron_sp.hf: this model's sliding-window attention (window {window}) is shorter "
            f"than the sequence ({s} tokens), which {what} does not mask; use a "
            f"sequence of at most {window} tokens or a config without sliding windows.")


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling=None, **kwargs):
    """The registered attention function (signature of transformers' attention interface):
    query [b, h, s/sp, d], key/value [b, g, s/sp, d] -> (out [b, s/sp, h, d], None)."""
    state: _State = getattr(module, _STATE)
    if state.ring is not None:
        return _ring_attention(state, query, key, value, dropout, scaling, kwargs)
    sp, group = state.sp, state.group
    b = query.shape[0]
    # [b, heads, s/sp, d] -> [b, s/sp, heads, d] views
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    k, v = expand_kv_heads(k, sp), expand_kv_heads(v, sp)        # [b, s/sp, max(g, sp), d]
    q, k, v = seq_to_head_qkv_all_to_all(q, k, v, group)         # [b, s, h/sp | max(g,sp)/sp, d]
    s = q.shape[1]
    _check_window(kwargs, s)
    positions, documents = state.documents(kwargs.pop("position_ids", None), b)
    if documents is not None and state.inner == "sdpa":
        out = state.sdpa(q, k, v, causal=True, softmax_scale=scaling, document_ids=documents,
                         dropout_p=dropout)                       # [b, s, h/sp, d]
    else:
        if positions is not None:
            kwargs["position_ids"] = positions                    # global, [b, s]
        if documents is not None:                                # flash_attention_2 varlen
            cu_seqlens, max_seqlen = cu_seqlens_from_document_ids(documents)
            kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                          max_length_q=max_seqlen, max_length_k=max_seqlen)
        view = _InnerView(module, state.inner, q.shape[2] // k.shape[2])
        out, _ = state.inner_fn(
            view, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),   # [b, heads, s, d]
            None, dropout=dropout, scaling=scaling, **kwargs)    # -> [b, s, h/sp, d]
    return head_to_seq_all_to_all(out.contiguous(), group), None  # [b, s/sp, h, d]


def _ring_attention(state: "_State", query, key, value, dropout, scaling, kwargs):
    """Under a ring: query [b, h, n, d], key/value [b, g, n, d] of this rank's n hybrid-layout
    tokens -> (out [b, n, h, d], None), attended against the whole sequence."""
    if dropout:
        raise SequenceParallelError(
            f"megatron_sp.hf: attention dropout ({dropout}) is not implemented under ring context "
            f"parallelism; set the config's attention_dropout to 0 or use cp_size 1.")
    b, n = query.shape[0], query.shape[2]
    _check_window(kwargs, n * state.sp * state.cp, "ring attention")
    _, documents = state.documents(kwargs.get("position_ids"), b)     # full rows [b, s] or None
    # [b, heads, n, d] -> [b, n, heads, d] views
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = state.ring(q, k, v, softmax_scale=scaling, document_ids=documents)   # [b, n, h, d]
    return out, None


def _heads(config) -> tuple[int, int]:
    h = config.num_attention_heads
    return h, getattr(config, "num_key_value_heads", None) or h


def _refusal(config, sp: int) -> str | None:
    """Why `config` cannot run under Ulysses sp, or None."""
    family = getattr(config, "model_type", None)
    impl = config._attn_implementation
    if family not in FAMILIES:
        return (f"megatron_sp.hf.sequence_parallel knows the model families "
                f"{', '.join(FAMILIES)}, not '{family}'; convert the checkpoint to one of them "
                f"or train it with pretrain_gpt.py.")
    if getattr(config, "output_router_logits", False):
        return ("megatron_sp.hf.sequence_parallel: output_router_logits=True would add a router "
                "loss over each rank's own tokens only, and the sequence-parallel loss does not "
                "include it; set config.output_router_logits = False (the experts run on each "
                "rank's tokens unchanged).")
    if impl is not None and impl.startswith(PREFIX):
        return "megatron_sp.hf.sequence_parallel: this model is already sequence-parallel."
    if impl == "eager":
        return ("megatron_sp.hf.sequence_parallel: eager attention needs the model's [s, s] mask, "
                "which a sequence-parallel model does not build; load the model with "
                "attn_implementation='sdpa' (or 'flash_attention_2').")
    if impl not in INNER:
        return (f"megatron_sp.hf.sequence_parallel wraps the attention implementations "
                f"{' and '.join(INNER)}, not '{impl}'; load the model with "
                f"attn_implementation='sdpa'.")
    h, g = _heads(config)
    problem = head_layout_problem(h, g, tp=1, sp=sp)
    if problem:
        return (f"megatron_sp.hf.sequence_parallel ({family}, sp = {sp}): {problem.rstrip('.')}; "
                f"use an sp group size that fits the model's {h} query and {g} key/value heads.")
    return None


def _ring_refusal(config, cp: int) -> str | None:
    dropout = getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0)
    if dropout:
        return (f"megatron_sp.hf.sequence_parallel (cp = {cp}): ring attention has no attention "
                f"dropout, but the config's is {dropout}; set attention_dropout=0 (or attn_pdrop "
                f"for gpt2) or use cp_size 1.")
    return None


def layout_of(model) -> "_State | None":
    """The sequence-parallel state sequence_parallel gave `model` (None if it was not wrapped)."""
    for module in model.modules():
        state = getattr(module, _STATE, None)
        if state is not None:
            return state
    return None


def _register(name: str) -> None:
    from transformers import AttentionInterface
    if AttentionInterface._global_mapping.get(name) is not ulysses_attention:
        AttentionInterface.register(name, ulysses_attention)


def sequence_parallel(model, sp_group, cp_group=None):
    """Make a transformers causal LM sequence-parallel (DeepSpeed-Ulysses) over `sp_group`, and
    over a ring of `cp_group` ranks past it (context parallelism; module docstring).

    The model's attention layers (config._attn_implementation sdpa or flash_attention_2) then
    expect this rank's sequence chunk from megatron_sp.hf.shard_batch (input_ids, global
    position_ids) and run the all-to-alls around the original attention function (module
    docstring). Query heads must be divisible by sp; key/value heads g either divisible by sp or
    dividing it (then each is replicated sp/g times, its gradient summed back). Refuses
    (SequenceParallelError, one sentence) an unknown model family, eager or another attention
    implementation, heads sp cannot split, and attention dropout under a ring. Returns the model
    (changed in place). With both groups None or of size 1 the checks run and the model is
    returned unchanged.
    """
    config = model.config
    sp, cp = group_size(sp_group), group_size(cp_group)
    problem = _refusal(config, sp) or (_ring_refusal(config, cp) if cp > 1 else None)
    if problem:
        raise SequenceParallelError(problem)
    if sp * cp == 1:
        return model
    inner = config._attn_implementation
    name = PREFIX + inner
    _register(name)
    state = _State(sp_group, inner, cp_group)
    # This model's own config: from_config(config) keeps the object it is given, so two models
    # built from one config would otherwise share _attn_implementation, and building the second
    # (from_config(attn_implementation=...)) silently turns this one's wrapper off.
    own = copy.copy(config)
    own._attn_implementation = name
    for module in model.modules():               # the attention layers (their config is shared)
        if getattr(module, "config", None) is config:
            if hasattr(module, "is_causal"):
                object.__setattr__(module, _STATE, state)
            module.config = own
    _require_position_ids(model, name)
    return model


def _require_position_ids(model, name: str) -> None:
    """Refuse a forward without position_ids: the model would make local positions 0..s/sp-1 on
    every rank (wrong RoPE / learned positions, and restarts the wrapper would take for document
    starts). Hooked on the model and its base model (which tiled_loss users call)."""
    modules = [model]
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        modules.append(base)
    for module in modules:
        signature = inspect.signature(module.forward)

        def check(mod, args, kwargs, signature=signature):
            if mod.config._attn_implementation != name:
                raise SequenceParallelError(
                    f"megatron_sp.hf: the sequence-parallel {type(mod).__name__}'s config now "
                    f"says attn_implementation '{mod.config._attn_implementation}', not '{name}' "
                    f"(set after sequence_parallel), so its attention would run unsharded; "
                    f"call sequence_parallel last, after anything that sets the attention "
                    f"implementation.")
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:         # a call the model itself will refuse
                return
            if bound.get("position_ids") is None and bound.get("kwargs", {}).get(
                    "position_ids") is None:
                raise SequenceParallelError(
                    f"megatron_sp.hf: the sequence-parallel {type(mod).__name__} was called "
                    f"without position_ids; pass the position_ids of megatron_sp.hf.shard_batch "
                    f"(global positions of this rank's chunk).")

        module.register_forward_pre_hook(check, with_kwargs=True)
