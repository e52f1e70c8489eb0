"""megatron_sp: pretrain GPT models at million-token contexts.

Tensor (tp), Ulysses sequence (sp), pipeline (pp) and data (dp) parallelism composed through one
device mesh (`megatron_sp.mesh.ParallelMesh`), built once and passed to whatever needs a group.
"""
__version__ = "0.1.0"
