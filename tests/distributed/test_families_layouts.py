"""The Hugging Face families' features in every layout: a tiny Qwen3-style model (qk-norm, tied
embeddings, head_dim 32 != hidden 64 / 4 heads; also with YaRN) and a Llama-3.1-style one (llama3
RoPE scaling that changes the frequencies at these lengths) train like one rank in tp2, sp2, sp4,
tp2 x sp2, pp2, and a Qwen2.5-style one (bias in q/k/v only) in tp2 x sp2: losses 1e-5 relative,
full gradients 1e-4, three optimizer steps (layout_utils). The Qwen3-style model under selective
recompute and under full recompute + tiled MLP + chunked loss (tp2 x sp2) equals one rank without
them. A Hugging Face Qwen3 converted by tools/checkpoint/convert.py loads into tp2 x sp2 and
pp2 x tp2 and its first training loss equals transformers' loss on the same batch (1e-5 relative).

One 4-rank spawn for everything (dp fills the ranks a layout leaves)."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_sp.testing import run_distributed

from layout_utils import check_layouts, global_batches

QWEN3 = dict(model="qwen3-0.6b", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                num_query_groups=2, kv_channels=32,
                                                ffn_hidden_size=128, vocab_size=300,
                                                max_position_embeddings=64))
QWEN3_YARN = dict(QWEN3, overrides=dict(QWEN3["overrides"], position_embedding_type="yarn",
                                        yarn_rotary_scaling_factor=4.0,
                                        yarn_original_max_position_embeddings=16))
LLAMA31 = dict(model="llama3.1-8b", overrides=dict(num_layers=2, hidden_size=64,
                                                   num_attention_heads=8, num_query_groups=4,
                                                   ffn_hidden_size=128, vocab_size=300,
                                                   max_position_embeddings=64,
                                                   rope_original_max_position_embeddings=16))
QWEN25 = dict(model="qwen2.5-7b", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                num_query_groups=2, ffn_hidden_size=128,
                                                vocab_size=300, max_position_embeddings=64))
COMMON = dict(seq=32, global_batch=4, steps=3)
CASES = [
    dict(QWEN3, name="qwen3 tp2 (x dp2)", tp=2, micro_batch=2, **COMMON),
    dict(QWEN3, name="qwen3 sp2 (x dp2)", sp=2, micro_batch=1, **COMMON),
    dict(QWEN3, name="qwen3 sp4 (2 kv heads < sp, replicated)", sp=4, micro_batch=4, **COMMON),
    dict(QWEN3, name="qwen3 tp2 x sp2 sequence-parallel", tp=2, sp=2, micro_batch=2,
         sequence_parallel=True, **COMMON),
    dict(QWEN3, name="qwen3 pp2 x tp2", tp=2, pp=2, micro_batch=1, **COMMON),
    dict(QWEN3_YARN, name="qwen3 yarn tp2 x sp2", tp=2, sp=2, micro_batch=4, **COMMON),
    dict(LLAMA31, name="llama3.1 tp2 (x dp2) sequence-parallel", tp=2, micro_batch=1,
         sequence_parallel=True, **COMMON),
    dict(LLAMA31, name="llama3.1 sp4", sp=4, micro_batch=2, **COMMON),
    dict(LLAMA31, name="llama3.1 tp2 x sp2", tp=2, sp=2, micro_batch=4, **COMMON),
    dict(LLAMA31, name="llama3.1 pp2 x sp2", sp=2, pp=2, micro_batch=2, **COMMON),
    dict(QWEN25, name="qwen2.5 (q/k/v bias only) tp2 x sp2 sequence-parallel", tp=2, sp=2,
         micro_batch=2, sequence_parallel=True, **COMMON),
]
CONVERTED_LAYOUTS = [dict(tp=2, sp=2), dict(tp=2, pp=2)]
MEMORY_TECHNIQUES = ["selective", "all"]   # all: full recompute, tiled MLP, chunked loss


def _rank_main(rank, world, cases, converted, batch, hf_loss):
    results = check_layouts(rank, world, cases)
    results += [_memory_techniques(technique) for technique in MEMORY_TECHNIQUES]
    return results, [_converted_loss(path_layout, converted, batch) for path_layout in
                     CONVERTED_LAYOUTS], hf_loss


def _memory_techniques(technique):
    """The Qwen3-style model under a memory technique in tp2 x sp2 equals one rank without it."""
    from megatron_sp.memory import TECHNIQUES, MemoryOptions
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    from layout_utils import compare, train_layout
    cfg = preset(QWEN3["model"], **QWEN3["overrides"])
    batches = global_batches(cfg.vocab_size, COMMON["seq"], COMMON["global_batch"], COMMON["steps"],
                             seed=13)
    reference = train_layout(ParallelMesh.single(), cfg, batches, COMMON["global_batch"])
    mem = dict(TECHNIQUES[technique])
    mem.update({k: 2 for k, v in mem.items() if v == "auto"})   # "auto" is 1 tile at this length
    candidate = train_layout(ParallelMesh.from_sizes(tp=2, sp=2), cfg, batches, 2,
                             sequence_parallel=True, model_kwargs={"memory": MemoryOptions(**mem)})
    name = f"qwen3 tp2 x sp2 {technique}"
    return (name,) + compare(reference, candidate, name)


def _converted_loss(layout, path, batch):
    """Load the converted release checkpoint into `layout` and return its first training loss."""
    from megatron_sp.checkpointing import load_checkpoint, read_meta, resolve_checkpoint
    from megatron_sp.config import JobConfig
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig
    from megatron_sp.training.optimizer import LRScheduler, build_optimizer
    from megatron_sp.training import Trainer
    from layout_utils import build_chunks, micro_batches
    config = GPTConfig.from_dict(read_meta(resolve_checkpoint(path))["config"])
    mesh = ParallelMesh.from_sizes(**layout)
    chunks, schedule = build_chunks(mesh, config)
    load_checkpoint(path, chunks, mesh, config=config, finetune=True)
    optimizer = build_optimizer(chunks, lr=1e-4)
    scheduler = LRScheduler(optimizer, 1e-4, 1e-5, warmup_iters=0, decay_iters=2, style="constant")
    n = batch["tokens"].shape[0]
    job = JobConfig.from_flags({"global_batch_size": n, "micro_batch_size": 1,
                                "seq_length": batch["tokens"].shape[1], "clip_grad": 1.0})
    trainer = Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule)
    return trainer.train_step(micro_batches(batch, 1, mesh.dp_rank, mesh.dp_size)).loss


def _convert_tiny_qwen3(tmp):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                                   tie_word_embeddings=True, rms_norm_eps=1e-6)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    hf.save_pretrained(os.path.join(tmp, "hf"), safe_serialization=True)
    from megatron_sp.testing import load_script
    convert = load_script("tools/checkpoint/convert.py")
    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", os.path.join(tmp, "hf"),
                  "--save-dir", os.path.join(tmp, "ours")])
    batch = global_batches(300, 32, 4, 1, seed=5)[0]
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits.float()                 # [b, s, V]
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 300),
                                                  batch["labels"].reshape(-1), reduction="none")
    mask = batch["loss_mask"].reshape(-1)
    return os.path.join(tmp, "ours"), batch, (per_token * mask).sum().item() / mask.sum().item()


def test_families_layouts_and_converted_checkpoint(tmp_path):
    path, batch, hf_loss = _convert_tiny_qwen3(str(tmp_path))
    results = run_distributed(_rank_main, 4, CASES, path, batch, hf_loss, timeout_s=400)
    layouts, converted, _ = results[0]
    assert [r[0] for r in layouts] == [c["name"] for c in CASES] + [
        f"qwen3 tp2 x sp2 {t}" for t in MEMORY_TECHNIQUES]
    for rank_result in results:
        for layout, loss in zip(CONVERTED_LAYOUTS, rank_result[1]):
            rel = abs(loss - hf_loss) / hf_loss
            assert rel <= 1e-5, f"converted qwen3 in {layout}: loss {loss} vs transformers {hf_loss}"
