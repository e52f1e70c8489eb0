"""Writing a checkpoint Megatron-LM loads as it is: torch_dist or torch, at a chosen tp x pp.

torch_dist (one process, torch.distributed.checkpoint): every tensor at its global shape under
megatron-core's sharded keys, layers stacked on a leading num_layers axis
(`decoder.layers.self_attention.linear_qkv.weight` [L, (h+2g)d, H]), the norms under Transformer
Engine's fused names, one `<module>._extra_state/shard_{i}_{L}` byte entry per layer and linear
module (torch.save([None]): no FP8 metadata), `common.pt` (args, checkpoint_version 3.0,
iteration, the scheduler) and `metadata.json`. Tensors are tp/pp-independent: any layout loads it.

torch: one `mp_rank_TT[_PPP]/model_optim_rng.pt` per (tp, pp) rank, each stage's layers numbered
from 0, the embedding on the first stage, the final norm and output layer on the last (with tied
embeddings and pp > 1 the last stage holds the output layer's copy), every `_extra_state` None.

The vocabulary is padded with zero rows to make_vocab_size_divisible_by x tp, as Megatron-LM pads
the tokenizer's. Everything is written under `<name>.tmp`, renamed when complete, and the tracker
is replaced last.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import warnings

import torch

from megatron_sp.checkpointing.format import (RELEASE, TRACKER_FILENAME, CheckpointError,
                                              iteration_dirname)
from megatron_sp.checkpointing.megatron_lm import names
from megatron_sp.checkpointing.megatron_lm.arguments import args_for
from megatron_sp.fileutil import write_text_atomic
from megatron_sp.checkpointing.megatron_lm.folder import TORCH, TORCH_DIST

IMPLS = ("transformer_engine", "local")
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
           "mlp.linear_fc2")


def _modules_with_extra_state(impl: str, moe: bool = False) -> tuple[str, ...]:
    """The per-layer modules whose `_extra_state` megatron-core's spec expects (a MoE layer's
    experts have theirs per expert: `_expert_extra_state`)."""
    linears = LINEARS[:2] if moe else LINEARS
    return linears + (("self_attention.core_attention",) if impl == "transformer_engine" else ())


def check_layout(config, tp: int, pp: int) -> None:
    """Refuse (one sentence) a target layout megatron-core cannot build for `config`."""
    c = config
    if c.num_experts is not None:
        _check_moe(c)
    problems = [(c.num_attention_heads, "num_attention_heads"),
                (c.num_query_groups, "num_query_groups"), (c.ffn_hidden_size, "ffn_hidden_size")]
    for value, name in problems:
        if value % tp:
            raise CheckpointError(f"--target-tensor-parallel-size {tp} does not divide {name}="
                                  f"{value}; choose a tp that does.")
    if c.num_layers % pp:
        raise CheckpointError(f"--target-pipeline-parallel-size {pp} does not divide num_layers="
                              f"{c.num_layers} (Megatron-LM's even split); choose a pp that does.")


def _check_moe(c) -> None:
    """The mixture-of-experts models written: experts in every layer (Mixtral / Qwen3-MoE
    shaped), softmax routing over the top-k, no shared expert."""
    if not all(c.is_moe_layer(i) for i in range(c.num_layers)):
        raise CheckpointError(f"this model mixes dense and mixture-of-experts layers "
                              f"(moe_layer_freq={c.moe_layer_freq}), which is not written in "
                              f"Megatron-LM's format yet; export it with --saver hf.")
    if c.moe_shared_expert_intermediate_size or c.moe_router_score_function != "softmax":
        raise CheckpointError("a shared expert or non-softmax routing is not written in "
                              "Megatron-LM's format yet; export it with --saver hf.")
    if c.moe_router_pre_softmax and not c.moe_norm_topk_prob and c.moe_router_topk > 1 \
            and c.moe_router_topk_scaling_factor is not None:
        raise CheckpointError("a router top-k scaling factor with pre-softmax routing is not "
                              "written in Megatron-LM's format yet.")


def moe_args(c) -> dict:
    """Megatron-LM's MoE arguments of GPTConfig `c` (a Qwen3-MoE-style renormalised pre-softmax
    routing is Megatron-LM's default softmax over the top-k logits: the same weights)."""
    if c.num_experts is None:
        return {}
    return dict(num_experts=c.num_experts, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
                moe_router_topk=c.moe_router_topk, moe_layer_freq=c.moe_layer_freq,
                moe_router_pre_softmax=bool(c.moe_router_pre_softmax and not c.moe_norm_topk_prob),
                moe_router_score_function="softmax",
                moe_router_topk_scaling_factor=c.moe_router_topk_scaling_factor,
                moe_router_load_balancing_type=c.moe_router_load_balancing_type,
                moe_aux_loss_coeff=c.moe_aux_loss_coeff, moe_z_loss_coeff=c.moe_z_loss_coeff,
                moe_expert_capacity_factor=c.moe_expert_capacity_factor, moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=None)


def padded_rows(config, tp: int) -> int:
    multiple = config.make_vocab_size_divisible_by * tp
    return -(-config.vocab_size // multiple) * multiple


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t[:rows].contiguous()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])   # [rows, H]


def megatron_scheduler(ours: dict | None, global_batch_size: int) -> dict | None:
    """Megatron-LM's opt_param_scheduler state (counted in samples) of our LRScheduler's
    (counted in iterations)."""
    if not ours:
        return None
    g = global_batch_size
    return {"max_lr": ours["max_lr"], "min_lr": ours["min_lr"],
            "lr_warmup_steps": int(ours["warmup_iters"]) * g,
            "num_steps": int(ours["num_steps"]) * g, "lr_decay_style": ours["style"],
            "lr_decay_steps": int(ours["decay_iters"]) * g, "start_wd": None, "end_wd": None,
            "wd_incr_style": "constant", "wd_incr_steps": int(ours["decay_iters"]) * g}


def write_checkpoint(root: str, config, tensors: dict[str, torch.Tensor], *, ckpt_format: str,
                     tp: int = 1, pp: int = 1, iteration: int | str = RELEASE,
                     transformer_impl: str = "transformer_engine", scheduler: dict | None = None,
                     extra_args: dict | None = None) -> str:
    """Write `tensors` (our names, full shapes, vocabulary unpadded) of GPTConfig `config` as a
    Megatron-LM checkpoint under `root` (a save folder); returns the iteration folder.
    `scheduler`: Megatron-LM's opt_param_scheduler state; `extra_args`: stored arguments such as
    consumed_train_samples and global_batch_size."""
    if ckpt_format not in (TORCH_DIST, TORCH):
        raise CheckpointError(f"--ckpt-format {ckpt_format!r} is not torch_dist or torch.")
    if transformer_impl not in IMPLS:
        raise CheckpointError(f"--transformer-impl {transformer_impl!r} is not one of {IMPLS}.")
    check_layout(config, tp, pp)
    missing = [n for n in names.expected_names(vars(config)) if n not in tensors]
    if missing:
        raise CheckpointError(f"the model has no tensor {missing[0]}; it cannot be written.")
    final = os.path.join(root, iteration_dirname(iteration))
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; choose another --save-dir (nothing was "
                              f"written).")
    rows = padded_rows(config, tp)
    full = {k: (_padded(v, rows) if k in ("embedding.word_embeddings.weight",
                                          "output_layer.weight") else v).float().contiguous()
            for k, v in tensors.items()}
    args = args_for(config, tp=tp, pp=pp, padded_vocab_size=rows,
                    iteration=0 if iteration == RELEASE else int(iteration),
                    extra=dict(extra_args or {}, ckpt_format=ckpt_format,
                               transformer_impl=transformer_impl, **moe_args(config)))
    common = {"args": args, "checkpoint_version": 3.0,
              "iteration": 0 if iteration == RELEASE else int(iteration),
              "num_floating_point_operations_so_far": 0}
    if scheduler is not None:
        common["opt_param_scheduler"] = scheduler
    os.makedirs(root, exist_ok=True)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if ckpt_format == TORCH_DIST:
            _write_torch_dist(tmp, config, full, common, transformer_impl)
        else:
            _write_torch(tmp, config, full, common, tp, pp, transformer_impl)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
    _write_tracker(root, iteration)
    return final


def _write_tracker(root: str, iteration) -> None:
    write_text_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))


# torch_dist ---------------------------------------------------------------------------------------

def _write_torch_dist(folder: str, config, full: dict, common: dict, impl: str) -> None:
    import torch.distributed.checkpoint as dcp
    L, moe = config.num_layers, config.num_experts is not None
    state: dict = {}
    for name, t in full.items():
        if not name.startswith("layers."):
            if name == "output_layer.weight" and config.tie_embeddings:
                continue
            state[names.megatron_name(name)] = t
            continue
        i, ours = name.split(".", 2)[1:]
        if i != "0":
            continue
        key = names.megatron_name(name, te_names=True).replace("decoder.layers.0.",
                                                               "decoder.layers.")
        if moe and impl == "transformer_engine" and ours.startswith("post_attention_norm."):
            key = "decoder.layers.pre_mlp_layernorm." + ours.split(".")[-1]   # not fused: experts
        state[key] = torch.stack([full[f"layers.{j}.{ours}"] for j in range(L)])   # [L, ...]
    empty = io.BytesIO()
    torch.save([None], empty)
    for module in _modules_with_extra_state(impl, moe):
        for i in range(L):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{L}"] = io.BytesIO(
                empty.getvalue())
    E = config.num_experts if moe else 0
    for fc in (1, 2) if moe else ():       # one entry per layer and expert: shard_{i}.{j}_{L}.{E}
        for i in range(L):
            for j in range(E):
                state[f"decoder.layers.mlp.experts.experts.linear_fc{fc}._extra_state/"
                      f"shard_{i}.{j}_{L}.{E}"] = io.BytesIO(empty.getvalue())
    with warnings.catch_warnings():       # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=True),
                 planner=_planner(), no_dist=True)
    torch.save(common, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)


def _planner():
    """DCP's save planner writing a BytesIO's bytes as they are (megatron-core's byte entries
    hold torch.save([object]); the default planner would pickle the BytesIO itself)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            return object if isinstance(object, io.BytesIO) else \
                super().transform_object(write_item, object)
    return Planner()


# torch -------------------------------------------------------------------------------------------

def _write_torch(folder: str, config, full: dict, common: dict, tp: int, pp: int,
                 impl: str) -> None:
    per_stage = config.num_layers // pp
    swiglu = config.activation == "swiglu"
    te = impl == "transformer_engine"
    moe = config.num_experts is not None
    for p in range(pp):
        first, last = p == 0, p == pp - 1
        for r in range(tp):
            model = {}
            for name, t in full.items():
                local = _local_name(name, p, per_stage, first, last, pp, config.tie_embeddings)
                if local is None:
                    continue
                if moe and local.endswith((".mlp.experts.w1", ".mlp.experts.w2")):
                    model.update(_local_experts(local, t, tp, r))
                    continue
                key = names.megatron_name(local, te_names=te)
                if moe and ".post_attention_norm." in local:   # not fused into the experts
                    key = names.megatron_name(local)
                model[key] = names.split_tp(name, t, tp, r, swiglu).clone()
            if last and pp > 1 and config.tie_embeddings:   # the output layer's copy
                model["output_layer.weight"] = names.split_tp(
                    "output_layer.weight", full["embedding.word_embeddings.weight"], tp, r,
                    swiglu).clone()
            for i in range(per_stage):
                for module in _modules_with_extra_state(impl, moe):
                    model[f"decoder.layers.{i}.{module}._extra_state"] = None
            if last:
                model["output_layer._extra_state"] = None
            name = f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(folder, name))
            torch.save(dict(common, model=model), os.path.join(folder, name, "model_optim_rng.pt"))


def _local_experts(local: str, stack: torch.Tensor, tp: int, rank: int) -> dict:
    """Stage-local layer's experts in the torch format: local_experts.{j}.linear_fc{1,2} (each
    cut over tp like the dense SwiGLU MLP: expert tensor parallelism = tp), and their
    `_extra_state`."""
    prefix = "decoder." + local.rsplit(".mlp.experts.", 1)[0] + ".mlp.experts.local_experts"
    fc = 1 if local.endswith("w1") else 2
    out = {}
    for j in range(stack.shape[0]):                     # [E, 2F, H] or [E, H, F]
        out[f"{prefix}.{j}.linear_fc{fc}.weight"] = names.split_tp(
            f"layers.0.mlp.fc{fc}.weight", stack[j], tp, rank, swiglu=True).clone()
        out[f"{prefix}.{j}.linear_fc{fc}._extra_state"] = None
    return out


def _local_name(name: str, stage: int, per_stage: int, first: bool, last: bool, pp: int,
                tied: bool) -> str | None:
    """Our name as stage `stage` holds it (layers renumbered from 0), None when elsewhere."""
    if name.startswith("layers."):
        i, rest = name.split(".", 2)[1:]
        i = int(i) - stage * per_stage
        return f"layers.{i}.{rest}" if 0 <= i < per_stage else None
    if name.startswith("embedding."):
        return name if first else None
    if name == "output_layer.weight":
        return name if last and not tied else None
    return name if last else None      # the final norm
