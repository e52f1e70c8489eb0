"""FP8 linears in the memory and time model (torchao's current scaling in our tensor-parallel
linears, megatron_sp/tensor_parallel/fp8.py; docs/design.md §9, §17).

What changes with --fp8-format (the FP8 linears: qkv, out-proj, fc1, fc2; never the embedding,
output layer, norms, router, experts or shared expert):

  saved for backward   the FP8 linear saves its high-precision input (in the matmul dtype, the
                       same tensor as aten::linear's autocast copy) and the weight parameter
                       itself; no FP8 copy (backward casts again) and no weight copy. The
                       activations are therefore those of bf16, and the weight-copy terms of
                       these linears (w_attn, w_mlp) are 0. Measured equal on CPU
                       (tests/unit/test_planner_fp8.py): FP8 keeps no more than bf16.
  model state          no bf16 copy of these weights lives across the step (bf16 autocast's
                       cast cache keeps one of every other weight): 2 bytes/param less for them.
  transients           each cast of a [R, C] operand makes torchao's fp32 scaled copy (4
                       bytes/element, + 4 for the fp32 upcast of a 16-bit operand; eager), then
                       the 1-byte FP8 tensor;
                       backward recasts the weight (and under autocast makes its bf16 copy),
                       the output gradient and the input (rowwise: each operand cast twice, along
                       either dimension). One linear's backward at a time: `fp8_transient_bytes`,
                       the largest over a layer's FP8 linears, added to the layer's backward peak.
                       Off CUDA the matmuls are emulated (torchao emulate=True): the dequantised
                       operands of one matmul (in the matmul dtype) come on top.
  time                 the FP8 linears' FLOPs (6 per parameter and token, forward and backward)
                       run at the device's FP8 peak (Hardware.fp8_peak_tflops), the rest at its
                       bf16 peak; MFU is then taken against the FP8 peak, as the training loop's
                       (megatron_sp/training/flops.py device_peak_tflops(fp8=True)).
"""
from __future__ import annotations

from megatron_sp.memory.planner.moe import moe_layer_flags

def fp8_linear_shapes(cfg, tp: int, moe: bool = False) -> list[tuple[float, float]]:
    """(K, N) of each FP8 linear of one layer on a tp rank (y [T, N] = x [T, K] W^T): qkv, out-proj
    and, in a dense layer, fc1 and fc2 (a MoE layer's MLP stays in high precision)."""
    H, d, F = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    h, g = cfg.num_attention_heads, cfg.num_query_groups
    shapes = [(H, (h + 2 * g) * d / tp), (h * d / tp, H)]
    if not moe:
        shapes += [(H, F * (2 if cfg.activation == "swiglu" else 1) / tp), (F / tp, H)]
    return shapes


def fp8_linear_parameters(cfg, tp: int, kinds) -> float:
    """Parameters of the FP8 linears on a tp rank over layers of the given kinds (True: MoE)."""
    return sum(K * N for moe in kinds for K, N in fp8_linear_shapes(cfg, tp, moe))


def fp8_transient_bytes(cfg, T: float, tp: int, e: int, recipe: str = "tensorwise",
                        device: str = "cuda", moe: bool = False, mlp_tokens: float | None = None
                        ) -> float:
    """Bytes the largest FP8 linear of one layer allocates in its backward beyond what bf16 does
    (module docstring). T: the rank's tokens at the linears (the column-parallel input gathered
    under --sequence-parallel is T tokens); mlp_tokens: fc1's and fc2's (one tile's with --mlp-
    tiles; default T). Per linear the larger of its cast phase (torchao's fp32 scaled copy of the
    largest operand, 4 bytes/element, + the fp32 upcast of a 16-bit one, 4 more; with the FP8
    copies of the output gradient, the weight and the input alive, twice rowwise) and, off CUDA,
    its emulated matmul's dequantised operands (e bytes each); + the weight's copy in the matmul
    dtype when that is 16-bit (e = 2)."""
    twice = 2 if recipe != "tensorwise" else 1
    worst = 0.0
    for i, (K, N) in enumerate(fp8_linear_shapes(cfg, tp, moe)):
        t = T if i < 2 or mlp_tokens is None else mlp_tokens
        operands = (t * N, N * K, t * K)                   # grad_y, W, x
        cast = (4 + (4 if e == 2 else 0)) * max(operands) + twice * sum(operands)
        matmul = (t * N + N * K) * e if device != "cuda" else 0.0
        worst = max(worst, max(cast, matmul) + (N * K * e if e == 2 else 0))
    return worst


def fp8_flops(cfg, global_batch: int, seq: int) -> float:
    """FLOPs of one step in the FP8 linears: 6 per parameter and token (forward 2, backward 4)."""
    return 6.0 * global_batch * seq * fp8_linear_parameters(cfg, 1, moe_layer_flags(cfg))
