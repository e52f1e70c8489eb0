"""Fixtures of the CUDA tests."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 references in fp32 (no TF32 matmuls) for every CUDA test here."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
