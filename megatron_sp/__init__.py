"""megatron_sp: pretrain GPT models at million-token contexts.

Tensor (tp), Ulysses sequence (sp), pipeline (pp) and data (dp) parallelism composed through one
device mesh (`megatron_sp.mesh.ParallelMesh`), built once and passed to whatever needs a group.
"""
__version__ = "0.1.0"


def load_pretrained(path, **kwargs):
    """A one-rank GPTModel for inference from a megatron_sp checkpoint (any layout) or export.

    See megatron_sp.checkpointing.load_pretrained; the models are imported only when called.
    """
    from megatron_sp.checkpointing import load_pretrained as _load_pretrained
    return _load_pretrained(path, **kwargs)
