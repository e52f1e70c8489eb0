"""Real Megatron-LM checkpoints made by megatron-core on CPU (gloo), for the checkpoint tests.

megatron-core 0.16.1 runs on CPU with a few patches (the issue's list): torch.cuda.current_device
returns the CPU device (RoPE asks for it), torch.cuda.synchronize does nothing (the torch_dist
writer calls it), Tensor.cuda() returns the tensor (pp > 1 with tied embeddings calls it), MoE's
te_general_gemm is None (no Transformer Engine), the models use the local spec with
use_cpu_initialization and the allgather dispatcher (no CUDA streams), the causal mask is
passed as a bool tensor, and psutil is installed (the torch_dist writer's forked process needs it).

The files are written as Megatron-LM's training/checkpointing.py writes them (its
generate_state_dict): torch_dist through megatron.core.dist_checkpointing.save of
{args, checkpoint_version 3.0, iteration, model: sharded_state_dict(), opt_param_scheduler,
num_floating_point_operations_so_far}; torch as mp_rank_TT[_PPP]/model_optim_rng.pt holding
the same with the model's state_dict_for_save_checkpoint() and an RNG state with NumPy's.
"""
from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist

SEQ, BATCH = 8, 2

# Model specs (our test names): sizes as Megatron-LM's arguments.
GQA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
           num_query_groups=2, ffn_hidden_size=48, kv_channels=8, normalization="RMSNorm",
           norm_epsilon=1e-6, swiglu=True, position_embedding_type="rope", rotary_base=10000,
           add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
           vocab_size=90, make_vocab_size_divisible_by=16, max_position_embeddings=16)
MOE = dict(GQA, qk_layernorm=False, num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
           moe_layer_freq=1, moe_router_pre_softmax=False,
           moe_router_load_balancing_type="aux_loss",
           moe_aux_loss_coeff=0.01, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
           expert_model_parallel_size=2)
GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=False,
           num_query_groups=None, ffn_hidden_size=64, kv_channels=8, normalization="LayerNorm",
           norm_epsilon=1e-5, swiglu=False, position_embedding_type="learned_absolute",
           add_bias_linear=True, untie_embeddings_and_output_weights=False, qk_layernorm=False,
           vocab_size=90, make_vocab_size_divisible_by=16, max_position_embeddings=16)


def patch_cpu():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self   # the tied embedding's copy on the last stage
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None                  # MoE without Transformer Engine


def init_parallel(tp: int, pp: int, seed: int, ep: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    patch_cpu()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def padded_vocab(spec: dict, tp: int) -> int:
    multiple = spec["make_vocab_size_divisible_by"] * tp
    return -(-spec["vocab_size"] // multiple) * multiple


def build(spec: dict, tp: int, pp: int):
    """A megatron-core GPTModel of `spec` for this rank's (tp, pp) stage (fp32, no dropout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    s = spec
    config = TransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"] if s["group_query_attention"] else None,
        ffn_hidden_size=s["ffn_hidden_size"], kv_channels=s["kv_channels"],
        normalization=s["normalization"], layernorm_epsilon=s["norm_epsilon"],
        gated_linear_unit=s["swiglu"],
        activation_func=torch.nn.functional.silu if s["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=s["add_bias_linear"], qk_layernorm=s["qk_layernorm"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=s.get("expert_model_parallel_size", 1),
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        init_method_std=0.2,   # a larger std than 0.02: logits far from zero
        **_moe_config(s))
    layer_spec = get_gpt_layer_local_spec(num_experts=s.get("num_experts"),
                                          normalization=s["normalization"],
                                          qk_layernorm=s["qk_layernorm"])
    return GPTModel(config, layer_spec, vocab_size=padded_vocab(s, tp),
                    max_sequence_length=s["max_position_embeddings"],
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=not s[
                        "untie_embeddings_and_output_weights"],
                    position_embedding_type=s["position_embedding_type"],
                    rotary_base=s.get("rotary_base", 10000), parallel_output=False).eval()


def _moe_config(spec: dict) -> dict:
    """TransformerConfig's MoE fields (the allgather dispatcher: no CUDA streams)."""
    if not spec.get("num_experts"):
        return {}
    return dict(num_moe_experts=spec["num_experts"],
                moe_ffn_hidden_size=spec["moe_ffn_hidden_size"],
                moe_router_topk=spec["moe_router_topk"],
                moe_router_pre_softmax=spec["moe_router_pre_softmax"],
                moe_router_load_balancing_type=spec["moe_router_load_balancing_type"],
                moe_aux_loss_coeff=spec["moe_aux_loss_coeff"],
                moe_token_dispatcher_type=spec["moe_token_dispatcher_type"])


def tokens(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def forward(model, ids: torch.Tensor):
    """The full logits [b, s, V] (on the last stage's ranks; None elsewhere): the stages run in
    turn, the hidden states sent to the next stage's rank with send/recv."""
    from megatron.core import parallel_state as ps
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(SEQ, BATCH, model.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return out.float()


def megatron_args(spec: dict, tp: int, pp: int, iteration: int, consumed: int, gbs: int):
    """The argparse.Namespace a Megatron-LM run stores (its model arguments, sizes, enums)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    ns = dict(spec, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              expert_model_parallel_size=spec.get("expert_model_parallel_size", 1),
              padded_vocab_size=padded_vocab(spec, tp),
              seq_length=SEQ, global_batch_size=gbs, micro_batch_size=1, iteration=iteration,
              consumed_train_samples=consumed, consumed_valid_samples=0,
              model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
              params_dtype=torch.float32, transformer_impl="local", hidden_dropout=0.0,
              attention_dropout=0.0, openai_gelu=False, apply_layernorm_1p=False,
              rotary_percent=1.0, init_method_std=0.2, lr=3e-3, min_lr=3e-4,
              lr_decay_style="cosine", lr_warmup_iters=2, lr_decay_iters=20, train_iters=20,
              ckpt_format=None, use_legacy_models=False)
    return argparse.Namespace(**ns)


def scheduler_state(args) -> dict:
    """Megatron-LM's OptimizerParamScheduler.state_dict() at args.iteration (counted in samples)."""
    g = args.global_batch_size
    return {"max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * g,
            "num_steps": args.iteration * g, "lr_decay_style": args.lr_decay_style,
            "lr_decay_steps": args.lr_decay_iters * g, "min_lr": args.min_lr, "start_wd": 0.01,
            "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": args.train_iters * g}


def _rng_state():
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {}}]


def save(model, root: str, ckpt_format: str, args):
    """Write the checkpoint of iteration args.iteration under `root` as Megatron-LM does
    (collective), then the tracker (rank 0)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    folder = os.path.join(root, f"iter_{args.iteration:07d}")
    common = {"args": args, "checkpoint_version": 3.0, "iteration": args.iteration,
              "opt_param_scheduler": scheduler_state(args),
              "num_floating_point_operations_so_far": 1.0e9}
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    if ckpt_format == "torch_dist":
        dist_checkpointing.save(dict(common, model=model.sharded_state_dict()), folder)
    elif ps.get_expert_data_parallel_rank() == 0:   # one writer per (tp, pp, ep) rank
        name = _rank_dir()
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        torch.save(dict(common, model=model.state_dict_for_save_checkpoint(),
                        rng_state=_rng_state()),
                   os.path.join(folder, name, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(args.iteration))
    dist.barrier()


def _rank_dir() -> str:
    """This rank's torch-format folder: mp_rank_TT[_PPP with pipeline stages][_EEE with expert
    parallelism] (Megatron-LM's get_checkpoint_name)."""
    from megatron.core import parallel_state as ps
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    staged = ps.get_pipeline_model_parallel_world_size() > 1
    ep = ps.get_expert_model_parallel_world_size()
    return (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if staged else "")
            + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""))


def load_strict(model, folder: str, ckpt_format: str, te_extra_state: bool = False):
    """Load an iteration folder into `model` as Megatron-LM does, strictly: torch_dist through
    dist_checkpointing.load with StrictHandling.RAISE_ALL (a missing or unexpected key raises),
    then load_state_dict(strict=True); torch: this rank's mp_rank file, strict=True.
    `te_extra_state`: a checkpoint written for Transformer Engine's spec (core_attention's extra
    state too) into this local-spec model, under Megatron-LM's default strictness
    (ASSUME_OK_UNEXPECTED: a missing key still raises)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    if ckpt_format == "torch_dist":
        strict = StrictHandling.ASSUME_OK_UNEXPECTED if te_extra_state else StrictHandling.RAISE_ALL
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder,
                                        strict=strict)
        model.load_state_dict(state.pop("model"), strict=True)
        return state
    name = _rank_dir()
    state = torch.load(os.path.join(folder, name, "model_optim_rng.pt"), weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    return state


# A spawn of non-daemonic ranks (megatron-core's torch_dist writer starts a multiprocessing
# Manager, which a daemonic process may not) -----------------------------------------------------

def _rank_main(rank, fn, world, init_file, out_dir, args):
    import datetime
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
    finally:
        dist.destroy_process_group()
        import multiprocessing
        for child in multiprocessing.active_children():   # the torch_dist writer's Manager: a
            child.terminate()                              # failed rank must not leave it behind


def spawn(fn, world: int, out_dir: str, *args) -> list:
    """Run fn(rank, world, *args) on `world` gloo ranks (torch.multiprocessing.spawn: a rank's
    exception is raised here with its traceback); each rank's return value, in rank order."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(fn, world, os.path.join(tmp, "store"), out_dir, args),
                 nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"result_{r}.pt"), weights_only=False)
            for r in range(world)]
