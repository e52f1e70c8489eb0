"""Ulysses sequence parallelism for unmodified Hugging Face causal LMs (docs/design.md §15).

    model = sequence_parallel(model, sp_group)           # attention through our all-to-alls
    shard = shard_batch(batch, sp_group)                 # this rank's chunk, labels shifted first
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    loss(out.logits, shard, sp_group, dp_group=dp_group).backward()
    # then average the gradients over dp x sp (DDP / FSDP2 over the world do)

No DeepSpeed, no checkpoint conversion: llama, mistral, qwen2, qwen3 and gpt2 configs, with the
attention they were loaded with (sdpa; flash_attention_2 where installed).
"""
from megatron_sp import comm_stats
from megatron_sp.hf.attention import FAMILIES, sequence_parallel, ulysses_attention
from megatron_sp.hf.batch import SequenceParallelError, shard_batch, shard_for_rank
from megatron_sp.hf.loss import loss, tiled_loss

comm_stats.keep_out_of_graphs()   # users compile their own models around our collectives

__all__ = ["sequence_parallel", "shard_batch", "loss", "tiled_loss", "SequenceParallelError",
           "shard_for_rank", "ulysses_attention", "FAMILIES", "SequenceParallelTrainer",
           "SequenceParallelMixin", "sequence_parallel_trainer"]

_TRAINER = ("SequenceParallelTrainer", "SequenceParallelMixin", "sequence_parallel_trainer")


def __getattr__(name):
    """The Trainer integration is imported on first use: transformers.Trainer is slow to import."""
    if name in _TRAINER:
        from megatron_sp.hf import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'megatron_sp.hf' has no attribute '{name}'")
