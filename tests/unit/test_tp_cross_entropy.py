"""vocab_parallel_cross_entropy on one rank against F.cross_entropy (fp32: 1e-5; bf16 input: the
loss is computed in fp32 from the rounded logits, so it matches F.cross_entropy on those)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_sp.tensor_parallel import vocab_parallel_cross_entropy


def _reference(logits, labels, vocab_size, label_smoothing=0.0):
    """Per-token F.cross_entropy over the real vocabulary; Megatron's smoothing alpha*K/(K-1)."""
    real = logits[..., :vocab_size].float()
    eps = label_smoothing * vocab_size / (vocab_size - 1)
    return F.cross_entropy(real.flatten(0, 1), labels.flatten(), reduction="none",
                           label_smoothing=eps).view(labels.shape)


@pytest.mark.parametrize("vocab_size,smoothing", [(None, 0.0), (37, 0.0), (40, 0.1), (33, 0.2)])
def test_loss_and_grad_match_cross_entropy(vocab_size, smoothing):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 40)).requires_grad_()
    real = vocab_size or 40
    labels = torch.randint(0, real, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, labels, None, vocab_size=vocab_size,
                                        label_smoothing=smoothing)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = _reference(ref_logits, labels, real, smoothing)
    assert loss.dtype == torch.float32 and loss.shape == (2, 5)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    weights = torch.rand(2, 5)  # a loss mask / arbitrary upstream gradient
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.all(logits.grad[..., real:] == 0), "padding columns must get no gradient"


def test_padding_values_do_not_change_the_loss():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 16)
    labels = torch.randint(0, 12, (3, 4))
    noisy = logits.clone()
    noisy[..., 12:] = 50.0  # huge padding logits would dominate an unmasked softmax
    a = vocab_parallel_cross_entropy(logits, labels, None, vocab_size=12, label_smoothing=0.1)
    b = vocab_parallel_cross_entropy(noisy, labels, None, vocab_size=12, label_smoothing=0.1)
    torch.testing.assert_close(a, b)


def test_bf16_logits_computed_in_fp32_with_bf16_grad():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 32).bfloat16().requires_grad_()
    labels = torch.randint(0, 32, (2, 3))
    loss = vocab_parallel_cross_entropy(logits, labels, None)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, _reference(logits.detach(), labels, 32), rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().float().requires_grad_()
    _reference(ref_logits, labels, 32).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad.bfloat16(), rtol=1e-2, atol=1e-2)


def test_input_logits_are_not_modified_and_bad_arguments_raise():
    logits = torch.randn(1, 2, 8)
    before = logits.clone()
    vocab_parallel_cross_entropy(logits, torch.tensor([[1, 2]]), None, vocab_size=6)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="vocab_size 9"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[1, 2]]), None, vocab_size=9)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[1, 2]]), None, label_smoothing=1.0)
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 2]), None)
