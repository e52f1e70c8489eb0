"""Single-rank training tokens/s: our GPTModel against Hugging Face GPT2LMHeadModel / LlamaForCausalLM.

Both models are built from the same shapes with random weights (no download), and HF gets *our*
initial weights copied in, so the two compute the same function: the first step's losses are printed
side by side (fp32 must agree to ~1e-5). One training step, for both, is

    zero_grad -> forward + loss (autocast bf16 for the bf16 rows) -> backward -> AdamW step

with the same optimizer (megatron_sp.training.optimizer.build_optimizer: torch AdamW, fused, the same
weight-decay groups), the same tokens and the same loss: the mean next-token cross entropy over the
b*(s-1) positions that have a next token. HF gets labels=input_ids (it shifts inside and ignores the
last position); ours gets the left-shifted ids as labels and a loss mask that zeroes the last position
(our model returns the per-token loss [b, s]). HF uses attn_implementation="sdpa", our model the SDPA
backend (--attention unfused: HF's "eager" attention and our unfused backend, both two matrix
products around a softmax). Vocabularies are equal; ours pads its output layer to a multiple of
128 (no padding when the vocabulary already is one, as the default 8192 is).

Steps of the two models are interleaved (ours first on even steps, HF first on odd ones) so that
machine noise hits both alike; tokens/s = b*s / median step time after the warm-up steps.

The machine's limit is measured in the same run: the rate of a 2048-square matrix product (fp32 and
bf16, the threads of the run), once at the start and, per row, after every timed step (median), so
that it sees the same machine load as the steps. Each row prints the model FLOP/s of both models
(Megatron's formula, megatron_sp.training.flops, as the training log line) and that as a fraction of the
GEMM rate of the row's dtype: a CPU "MFU".

    python bench/train_step.py                                # gpt2 + llama, fp32 + bf16, defaults
    python bench/train_step.py --models llama --dtype bf16 --layers 8 --seq 1024 --steps 10
    python bench/train_step.py --profile                      # + top ops of one step, ours and HF
    python bench/train_step.py --fp8 --models llama --dtype bf16  # ours with FP8 linears vs without

--fp8: our model with its qkv, out-proj, fc1 and fc2 in FP8 (torchao,
megatron_sp.tensor_parallel.fp8; hybrid tensorwise) against the same model without, same initial weights, interleaved steps. On CPU
the FP8 matmuls are emulated in fp32 (CPU torch._scaled_mm is slower still): the row measures the
casts' overhead and the first-step loss difference, not FP8's speed (a GPU row: tests/gpu).

Goal: ours/HF >= 1.3 on every row.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root: models/

from megatron_sp.memory.cpu_allocator import keep_freed_memory
from megatron_sp.training.flops import flops_for_config
from megatron_sp.training.optimizer import build_optimizer
from models.config import GPTConfig
from models.gpt import GPTModel
from models.init import init_parameters

GOAL = 1.3
HF_ATTENTION = {"sdpa": "sdpa", "unfused": "eager"}     # ours -> HF at equal settings


# Model builders ---------------------------------------------------------------------------------

def our_config(family: str, args) -> GPTConfig:
    common = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                  vocab_size=args.vocab, max_position_embeddings=max(args.seq, 1024),
                  norm_epsilon=1e-5)
    if family == "gpt2":
        return GPTConfig(**common, normalization="LayerNorm", activation="gelu_tanh",
                         position_embedding_type="learned_absolute", add_bias_linear=True,
                         tie_embeddings=True)
    kv = args.kv_heads or max(1, args.heads // 4)
    return GPTConfig(**common, num_query_groups=kv, ffn_hidden_size=args.ffn,  # None: Megatron's SwiGLU rule
                     normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     rotary_base=10000.0, add_bias_linear=False, tie_embeddings=False)


def hf_model(family: str, cfg: GPTConfig, attention: str = "sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if family == "gpt2":
        hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
                            n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                            n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
                            activation_function="gelu_new", layer_norm_epsilon=cfg.norm_epsilon,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                            attn_implementation=HF_ATTENTION[attention])
        return GPT2LMHeadModel(hf_cfg)
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels,
                         max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.norm_epsilon,
                         rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
                         tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
                         attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                         pad_token_id=None, attn_implementation=HF_ATTENTION[attention])
    return LlamaForCausalLM(hf_cfg)


def _split_qkv(weight: torch.Tensor, cfg: GPTConfig):
    """Our fused QKV rows [g x (q_per_group q, k, v) x d] -> q [h*d, ...], k, v [g*d, ...]."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    qpg = cfg.num_attention_heads // g
    w = weight.reshape(g, qpg + 2, d, *weight.shape[1:])
    flat = lambda t: t.reshape(-1, *weight.shape[1:])  # noqa: E731
    return flat(w[:, :qpg]), flat(w[:, qpg]), flat(w[:, qpg + 1])


@torch.no_grad()
def copy_into_hf(ours: GPTModel, hf, family: str, cfg: GPTConfig) -> None:
    """Load our (initialised) weights into the HF model, so both compute the same function."""
    V = cfg.vocab_size
    sd = {k: v.detach() for k, v in ours.state_dict().items()}
    emb = sd["embedding.word_embeddings.weight"][:V]
    pairs = []  # (hf tensor, our tensor)
    if family == "gpt2":
        t = hf.transformer
        pairs += [(t.wte.weight, emb), (t.wpe.weight, sd["embedding.position_embeddings.weight"]),
                  (t.ln_f.weight, sd["final_norm.weight"]), (t.ln_f.bias, sd["final_norm.bias"])]
        for i, block in enumerate(t.h):
            p = f"layers.{i}."
            q, k, v = _split_qkv(sd[p + "attention.qkv.weight"], cfg)
            qb, kb, vb = _split_qkv(sd[p + "attention.qkv.bias"], cfg)
            pairs += [  # HF Conv1D weights are [in, out]: ours transposed
                (block.ln_1.weight, sd[p + "input_norm.weight"]), (block.ln_1.bias, sd[p + "input_norm.bias"]),
                (block.attn.c_attn.weight, torch.cat([q, k, v]).t()),
                (block.attn.c_attn.bias, torch.cat([qb, kb, vb])),
                (block.attn.c_proj.weight, sd[p + "attention.proj.weight"].t()),
                (block.attn.c_proj.bias, sd[p + "attention.proj.bias"]),
                (block.ln_2.weight, sd[p + "post_attention_norm.weight"]),
                (block.ln_2.bias, sd[p + "post_attention_norm.bias"]),
                (block.mlp.c_fc.weight, sd[p + "mlp.fc1.weight"].t()), (block.mlp.c_fc.bias, sd[p + "mlp.fc1.bias"]),
                (block.mlp.c_proj.weight, sd[p + "mlp.fc2.weight"].t()),
                (block.mlp.c_proj.bias, sd[p + "mlp.fc2.bias"])]
    else:
        m = hf.model
        pairs += [(m.embed_tokens.weight, emb), (m.norm.weight, sd["final_norm.weight"])]
        if not cfg.tie_embeddings:                  # tied (llama-1b): lm_head is embed_tokens
            pairs.append((hf.lm_head.weight, sd["output_layer.weight"][:V]))
        for i, layer in enumerate(m.layers):
            p = f"layers.{i}."
            q, k, v = _split_qkv(sd[p + "attention.qkv.weight"], cfg)
            gate, up = sd[p + "mlp.fc1.weight"].chunk(2, dim=0)
            a = layer.self_attn
            pairs += [(layer.input_layernorm.weight, sd[p + "input_norm.weight"]),
                      (a.q_proj.weight, q), (a.k_proj.weight, k), (a.v_proj.weight, v),
                      (a.o_proj.weight, sd[p + "attention.proj.weight"]),
                      (layer.post_attention_layernorm.weight, sd[p + "post_attention_norm.weight"]),
                      (layer.mlp.gate_proj.weight, gate), (layer.mlp.up_proj.weight, up),
                      (layer.mlp.down_proj.weight, sd[p + "mlp.fc2.weight"])]
    for dst, src in pairs:
        assert dst.shape == src.shape, (dst.shape, src.shape)
        dst.copy_(src)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    pad = ours.config.padded_vocab_size() - V
    extra = pad * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    assert n_ours - extra == n_hf, f"parameter counts differ: ours {n_ours} (-{extra} padding), HF {n_hf}"


# One training step ------------------------------------------------------------------------------

def _autocast(dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def ours_step(model, opt, batch, dtype):
    opt.zero_grad(set_to_none=True)
    with _autocast(dtype):
        per_token = model(batch["input_ids"], labels=batch["labels"])      # [b, s] fp32
    loss = (per_token * batch["loss_mask"]).sum() / batch["num_tokens"]
    loss.backward()
    opt.step()
    return loss.detach()


def hf_step(model, opt, batch, dtype):
    opt.zero_grad(set_to_none=True)
    with _autocast(dtype):
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss  # shifts inside
    loss.backward()
    opt.step()
    return loss.detach()


def make_batch(step: int, args) -> dict:
    gen = torch.Generator().manual_seed(1234 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # next token; last: none
    mask = torch.ones(args.batch, args.seq)
    mask[:, -1] = 0.0
    return {"input_ids": ids, "labels": labels, "loss_mask": mask, "num_tokens": mask.sum()}


def build(family, args):
    cfg = our_config(family, args)
    ours = GPTModel(cfg, attention_backend=args.attention)
    init_parameters(ours, seed=args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_model(family, cfg, args.attention)
    copy_into_hf(ours, hf, family, cfg)
    ours.train(), hf.train()
    opt_ours = build_optimizer([ours], lr=1e-4, weight_decay=0.01)
    opt_hf = build_optimizer([hf], lr=1e-4, weight_decay=0.01)
    return cfg, ours, hf, opt_ours, opt_hf


def bench_row(family, dtype, args) -> dict:
    cfg, ours, hf, opt_ours, opt_hf = build(family, args)
    times = {"ours": [], "hf": [], "gemm": []}
    cpu = {"ours": [], "hf": []}
    gemm = Gemm(dtype)
    first = {}
    runners = {"ours": lambda b: ours_step(ours, opt_ours, b, dtype),
               "hf": lambda b: hf_step(hf, opt_hf, b, dtype)}
    for step in range(args.warmup + args.steps):
        batch = make_batch(step, args)
        order = ("ours", "hf") if step % 2 == 0 else ("hf", "ours")
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            loss = runners[name](batch)
            elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            if step == 0:
                first[name] = float(loss)
            if step >= args.warmup:
                times[name].append(elapsed)
                cpu[name].append(cpu_s)
        if step >= args.warmup:      # the limit, under the same machine load as the steps
            times["gemm"].append(gemm.time())
    tokens = args.batch * args.seq
    row = {"model": family, "dtype": dtype, "params": sum(p.numel() for p in hf.parameters()),
           "loss_ours": first["ours"], "loss_hf": first["hf"]}
    for name in ("ours", "hf"):
        row[f"ms_{name}"] = 1000 * statistics.median(times[name])
        row[f"tps_{name}"] = tokens / statistics.median(times[name])
    row["ratio"] = row["tps_ours"] / row["tps_hf"]
    flops = flops_for_config(cfg, args.batch, args.seq)      # per step, Megatron's formula
    for name in ("ours", "hf"):
        row[f"flops_{name}"] = flops / statistics.median(times[name])
    row["gemm"] = gemm.flops / statistics.median(times["gemm"])
    row["cpu_ratio"] = statistics.median(cpu["hf"]) / statistics.median(cpu["ours"])
    batch = make_batch(0, args)
    row["share_ours"] = kernel_share(ours_step, ours, opt_ours, batch, dtype)
    row["share_hf"] = kernel_share(hf_step, hf, opt_hf, batch, dtype)
    if args.profile:
        profile_row(family, dtype, args, ours, hf, opt_ours, opt_hf)
    return row


# Results (bench/performance_table.py's schema) -----------------------------------------------------

RESULT_COLUMNS = [("model", "model"), ("dtype", "dtype"), ("layers", "layers"), ("hidden", "hidden"),
                  ("seq", "seq"), ("batch", "batch"), ("layout", "layout"),
                  ("attention", "attention"), ("impl", "impl"), ("params", "params"),
                  ("tokens_per_s", "tokens/s"), ("tflops", "TFLOP/s"), ("mfu", "MFU vs GEMM"),
                  ("vs_hf", "ours/HF"), ("cpu_time_ratio", "CPU-time ratio"),
                  ("first_loss", "first-step loss")]


def result_rows(rows, args) -> list[dict]:
    """One schema row per (model, dtype, implementation): ours and HF side by side."""
    out = []
    for r in rows:
        for impl in ("ours", "hf"):
            out.append({"model": r["model"], "dtype": r["dtype"], "layers": args.layers,
                        "hidden": args.hidden, "seq": args.seq, "batch": args.batch,
                        "layout": "1 rank", "attention": args.attention if impl == "ours"
                        else HF_ATTENTION[args.attention], "impl": impl, "params": r["params"],
                        "tokens_per_s": r[f"tps_{impl}"], "tflops": r[f"flops_{impl}"] / 1e12,
                        "mfu": r[f"flops_{impl}"] / r["gemm"],
                        "vs_hf": r["ratio"] if impl == "ours" else None,
                        "cpu_time_ratio": r["cpu_ratio"] if impl == "ours" else None,
                        "first_loss": r[f"loss_{impl}"]})
    return out


def write_rows(rows, args) -> str:
    from performance_table import device_info, write_results
    device = device_info(peak_note="CPU: MFU against the 2048-square GEMM rate of the row's dtype, "
                                   "timed between the steps")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return write_results(
        args.results.format(device=device["kind"]), "train_step", result_rows(rows, args),
        title="single-rank training step, ours vs Hugging Face", columns=RESULT_COLUMNS,
        device=device,
        notes=[f"{args.warmup} warm-up + {args.steps} timed steps, interleaved; "
               f"{torch.get_num_threads()} threads; load average {load:.1f} at the end",
               "MFU here: model FLOP/s / the measured GEMM rate of the same dtype (a CPU ratio)"])


# The machine's limit ------------------------------------------------------------------------------

class Gemm:
    """An n x n matrix product in `dtype`: the machine's limit, timed between the steps too."""

    def __init__(self, dtype: str, n: int = 2048):
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(n, n, generator=gen).to(dt) for _ in range(2))
        self.out = torch.empty(n, n, dtype=dt)
        self.flops = 2.0 * n ** 3
        self.time()                                   # warm-up

    def time(self) -> float:
        t0 = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        return time.perf_counter() - t0


def gemm_rate(dtype: str, reps: int = 5) -> float:
    """FLOP/s of a 2048-square matrix product in `dtype` (median of reps after one warm-up)."""
    gemm = Gemm(dtype)
    return gemm.flops / statistics.median(gemm.time() for _ in range(reps))


# Profiling --------------------------------------------------------------------------------------

def profile_row(family, dtype, args, ours, hf, opt_ours, opt_hf):
    from torch.profiler import ProfilerActivity, profile, record_function
    batch = make_batch(0, args)
    for name, step, model, opt in (("ours", ours_step, ours, opt_ours), ("hf", hf_step, hf, opt_hf)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function(f"{name}_step"):
                step(model, opt, batch, dtype)
        print(f"\n--- profile: {family} {dtype} {name} (one step, top {args.profile_rows} ops by self CPU "
              f"time) ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows,
                                        max_name_column_width=48))


KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")


def kernel_share(step, model, opt, batch, dtype) -> float:
    """Fraction of one step's CPU time (profiler self time) spent in the matrix products and the
    SDPA attention kernels, which both models call with the same shapes: a model whose every other
    op took no time at all would run the step in that fraction of the time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, opt, batch, dtype)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shared = sum(e.self_cpu_time_total for e in events if e.key.startswith(KERNELS))
    return shared / total


# Main -------------------------------------------------------------------------------------------

def parse_args(argv=None):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=("gpt2", "llama"), default=["gpt2", "llama"])
    p.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                   help="fp32: no autocast; bf16: torch.autocast(cpu, bfloat16), fp32 master weights")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="Llama key/value heads (default heads/4)")
    p.add_argument("--ffn", type=int, default=None,
                   help="FFN size (default: 4*hidden for GPT-2, Megatron's SwiGLU rule for Llama)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=cores, help=f"torch.set_num_threads (default {cores})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print the top ops of one step per model")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--attention", choices=tuple(HF_ATTENTION), default="sdpa",
                   help="sdpa: SDPA in both (flash kernels); unfused: our unfused backend and HF's "
                        "eager attention (matmul, softmax, matmul)")
    p.add_argument("--results", default="train_step_{device}",
                   help="write the rows to bench/results/NAME.json (docs/performance.md's schema; "
                        "'{device}' becomes cpu or gpu); '' writes nothing")
    p.add_argument("--fp8", action="store_true",
                   help="ours with FP8 linears (torchao, hybrid tensorwise) vs ours without; no HF")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc settings as they are (default: keep freed memory, "
                        "megatron_sp.memory.cpu_allocator, as pretrain_gpt.py on CPU; both models)")
    return p.parse_args(argv)


def fp8_row(family, dtype, args) -> dict:
    """Ours without FP8 and with FP8 linears (same weights), interleaved: median ms, tokens/s."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.tensor_parallel.fp8 import Fp8Recipe
    from megatron_sp.training.fp8 import enable_fp8
    cfg = our_config(family, args)
    models = {}
    for name in ("plain", "fp8"):
        model = GPTModel(cfg, attention_backend=args.attention)
        init_parameters(model, seed=args.seed)
        if name == "fp8":
            recipe = Fp8Recipe("hybrid", "tensorwise", emulate=True)
            enable_fp8([model], recipe, ParallelMesh.single())
        models[name] = (model.train(), build_optimizer([model], lr=1e-4, weight_decay=0.01))
    times, first = {"plain": [], "fp8": []}, {}
    for step in range(args.warmup + args.steps):
        batch = make_batch(step, args)
        for name in (("plain", "fp8") if step % 2 == 0 else ("fp8", "plain")):
            t0 = time.perf_counter()
            loss = ours_step(*models[name], batch, dtype)
            if step == 0:
                first[name] = float(loss)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    params = sum(p.numel() for p in models["plain"][0].parameters())
    row = {"model": family, "dtype": dtype, "params": params}
    for name in ("plain", "fp8"):
        row[f"ms_{name}"] = 1000 * statistics.median(times[name])
        row[f"tps_{name}"] = tokens / statistics.median(times[name])
        row[f"loss_{name}"] = first[name]
    return row


FP8_COLUMNS = [("model", "model"), ("dtype", "dtype"), ("layers", "layers"), ("hidden", "hidden"),
               ("seq", "seq"), ("batch", "batch"), ("impl", "linears"), ("ms", "ms/step"),
               ("tokens_per_s", "tokens/s"), ("vs_plain", "vs no FP8"),
               ("first_loss", "first-step loss")]


def fp8_main(args) -> int:
    """--fp8: the table of fp8_row per (model, dtype); bench/results/train_step_fp8_<device>.json."""
    rows, out = [fp8_row(f, d, args) for f in args.models for d in args.dtype], []
    header = (f"{'model':6s} {'dtype':5s} {'no FP8 ms':>10s} {'FP8 ms':>8s} {'FP8/no':>7s} "
              f"{'loss no FP8':>12s} {'loss FP8':>10s}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['model']:6s} {r['dtype']:5s} {r['ms_plain']:10.0f} {r['ms_fp8']:8.0f} "
              f"{r['ms_fp8'] / r['ms_plain']:6.2f}x {r['loss_plain']:12.6f} {r['loss_fp8']:10.6f}")
        for impl in ("plain", "fp8"):
            out.append({"model": r["model"], "dtype": r["dtype"], "layers": args.layers,
                        "hidden": args.hidden, "seq": args.seq, "batch": args.batch,
                        "impl": "FP8 (emulated)" if impl == "fp8" else r["dtype"],
                        "ms": r[f"ms_{impl}"], "tokens_per_s": r[f"tps_{impl}"],
                        "vs_plain": r["tps_fp8"] / r["tps_plain"] if impl == "fp8" else None,
                        "first_loss": r[f"loss_{impl}"]})
    if args.results:
        from performance_table import device_info, write_results
        device = device_info(peak_note="CPU: no MFU (FP8 matmuls emulated in fp32)")
        print("wrote " + write_results(
            args.results.format(device=device["kind"]).replace("train_step", "train_step_fp8"),
            "train_step_fp8", out, title="single-rank training step, FP8 linears (torchao) vs none",
            columns=FP8_COLUMNS, device=device,
            notes=[f"{args.warmup} warm-up + {args.steps} timed steps, interleaved; "
                   f"{torch.get_num_threads()} threads",
                   "CPU: the FP8 matmuls are torchao's fp32 emulation, so this measures the casts' "
                   "and amax reductions' overhead, not FP8 speed (the GPU row: "
                   "tests/gpu/gpu_checks.py)"]))
    return 0


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fp8:
        keep_freed_memory()
        return fp8_main(args)
    kept = False if args.default_malloc else keep_freed_memory()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"shapes: layers {args.layers}, hidden {args.hidden}, heads {args.heads} "
          f"(llama kv heads {args.kv_heads or max(1, args.heads // 4)}), vocab {args.vocab}, "
          f"seq {args.seq}, batch {args.batch}; {args.warmup} warm-up + {args.steps} timed steps, "
          f"interleaved; step = forward + loss + backward + AdamW; attention {args.attention} "
          f"(HF {HF_ATTENTION[args.attention]})")
    print("malloc: " + ("freed memory kept for reuse (megatron_sp.memory.cpu_allocator), both models" if kept
                        else "glibc defaults (large tensors page-fault in every step)"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > args.threads:
        print(f"warning: load average {load:.1f} > {args.threads} threads: other processes share "
              f"these cores, so step times are noisy (the CPU-time ratio column is steadier)")
    start = time.perf_counter()
    gemm = {dtype: gemm_rate(dtype) for dtype in args.dtype}
    print("machine limit: 2048-square GEMM " + ", ".join(
        f"{dtype} {gemm[dtype] / 1e12:.3f} TFLOP/s" for dtype in args.dtype) +
        f" ({torch.get_num_threads()} threads)")
    rows = []
    for family in args.models:
        for dtype in args.dtype:
            rows.append(bench_row(family, dtype, args))
            r = rows[-1]
            print(f"  {family:5s} {dtype}: ours {r['ms_ours']:.0f} ms, HF {r['ms_hf']:.0f} ms per step "
                  f"(first-step loss ours {r['loss_ours']:.6f}, HF {r['loss_hf']:.6f})", flush=True)

    header = (f"{'model':6s} {'dtype':5s} {'params':>8s} {'ours tok/s':>11s} {'HF tok/s':>10s} "
              f"{'ours/HF':>8s} {'(CPU-time ratio)':>17s} | {'ours TFLOP/s':>12s} {'HF TFLOP/s':>10s} "
              f"{'GEMM TFLOP/s':>12s} {'ours MFU':>8s} {'HF MFU':>7s} | {'kernels ours':>12s} "
              f"{'HF':>5s} {'ceiling':>7s}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        peak = r["gemm"]
        print(f"{r['model']:6s} {r['dtype']:5s} {r['params'] / 1e6:7.1f}M {r['tps_ours']:11.0f} "
              f"{r['tps_hf']:10.0f} {r['ratio']:7.2f}x {r['cpu_ratio']:16.2f}x | "
              f"{r['flops_ours'] / 1e12:12.4f} {r['flops_hf'] / 1e12:10.4f} {peak / 1e12:12.4f} "
              f"{100 * r['flops_ours'] / peak:7.1f}% {100 * r['flops_hf'] / peak:6.1f}% | "
              f"{100 * r['share_ours']:11.0f}% {100 * r['share_hf']:4.0f}% "
              f"{1 / r['share_hf']:6.2f}x")
    print("TFLOP/s: Megatron's model FLOPs per step / median step time; GEMM: 2048-square matrix "
          "product of the row's dtype timed after every step (median); MFU: TFLOP/s / GEMM\n"
          "kernels: share of one profiled step's CPU time in the matrix products and SDPA attention "
          "kernels (the same kernels and shapes in both models); ceiling: 1 / HF's share, the "
          "ours/HF a model\nwould reach if everything else it does took no time")
    if args.results:
        print("wrote " + write_rows(rows, args))
    worst = min(r["ratio"] for r in rows)
    met = all(r["ratio"] >= GOAL for r in rows)
    print(f"\ngoal: ours/HF >= {GOAL}x on every row -> {'MET' if met else 'NOT MET'} "
          f"(lowest {worst:.2f}x; {time.perf_counter() - start:.0f} s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
