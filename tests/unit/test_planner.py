"""The parallel-layout planner (docs/design.md §11): model state per sharding mode against hand-computed
bytes, the activation model against the bytes measured under bf16 (autocast and bf16 weights), the
three Arctic Long Sequence Training configurations feasible, --max-seq consistent with feasibility,
each plan's flags accepted by pretrain_gpt.py's parser, and the table's layout."""
import contextlib
import io
import json
import shlex
import sys
from dataclasses import replace

import pytest
import torch

from megatron_sp.cli.arguments import build_parser
from megatron_sp.cli.build import job_config
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant
from megatron_sp.mesh import ParallelDims
from megatron_sp.memory.planner import (Hardware, Workload, activation_bytes,
                                        host_state_pinned_bytes, max_feasible_seq,
                                        model_state_bytes, pinned_bytes, plan, step_peak_bytes)
from megatron_sp.models import GPTModel, GPTConfig, preset

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_memory_accounting import _cfg  # noqa: E402

GB = 2 ** 30

from megatron_sp.testing import load_script  # noqa: E402
plan_parallel = load_script("tools/plan_parallel.py")

BF16_MEMS = [MemoryOptions(), MemoryOptions(recompute_granularity="selective"),
             MemoryOptions(recompute_granularity="full"), MemoryOptions(mlp_tiles=4, loss_chunks=3),
             MemoryOptions(recompute_granularity="full", mlp_tiles=2, loss_chunks=2,
                           offload_activations=True)]
ALST = [(524288, 1), (3_700_000, 8), (15_000_000, 32)]   # Llama-8B tokens, GPUs of 80 GB


def _llama8b(seq):
    return preset("llama-8b", max_position_embeddings=seq)


def _small():
    """P = 2 layers x (qkv 64*16*8 + proj 64*64 + SwiGLU 3*64*96 + 2 norms 64) + 2 x 256*64 + 64."""
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=96, vocab_size=256, normalization="RMSNorm",
                     activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
                     tie_embeddings=False)


def test_model_state_bytes_each_mode_by_hand():
    cfg = _small()
    layer = 64 * 16 * 8 + 64 * 64 + 3 * 64 * 96 + 2 * 64        # 30848
    P = 2 * layer + 2 * 256 * 64 + 64                             # 94528
    assert cfg.num_parameters() == P == 94528
    # FSDP units: embedding 16384, two layers of 30880 (the final norm's 64 shared), output 16384;
    # in flight: the largest adjacent pair (the two layers, 61760 params) at bf16 params + grads,
    # + the largest unit's bf16 reduce-scatter output (2 bytes / n) and, offloaded, its fp32 shard
    # on the way in and its fp32 grad shard on the way out (4 / n + 4 / n)
    n = 4
    in_flight = 2 * 30880 * 4 + 30880 * 2 // n
    in_flight_offload = 2 * 30880 * 4 + 30880 * 10 // n
    expect = {("none", False): (16 * P, 0),
              ("distributed-optimizer", False): (8 * P + 8 * P // n, 0),
              ("distributed-optimizer", True): (8 * P, 16 * P // n),
              ("fsdp", False): (16 * P // n + in_flight, 0),
              ("fsdp", True): (in_flight_offload, 16 * P // n)}
    for (mode, offload), (device, host) in expect.items():
        got = model_state_bytes(cfg, tp=1, pp=1, n=n, sharding=mode, cpu_offload=offload)
        assert (got["device"], got["host"]) == (device, host), (mode, offload, got)
    assert (device, host) == (324240, 378112)                    # the last row, in numbers
    # tp = 2 halves every slice (the padded vocabulary stays 256); pp = 2 keeps one layer and the
    # output layer on the heavier stage
    assert model_state_bytes(cfg, tp=2, sharding="none")["device"] == 16 * P / 2
    assert model_state_bytes(cfg, pp=2, sharding="none")["device"] == 16 * (layer + 32 + 16384)
    with pytest.raises(ValueError, match="optimizer-cpu-offload"):
        model_state_bytes(cfg, sharding="none", cpu_offload=True)
    assert pinned_bytes(3 * 2 ** 20) == 4 * 2 ** 20 and pinned_bytes(2 ** 20) == 2 ** 20
    # offloaded state on host, n = 4: fp32 weight and grad shards pinned, each rounded up to a power
    # of two (per layer qkv 8192 B, proj 4096, fc1 12288 -> 16384, fc2 6144 -> 8192; two vocabulary
    # tables of 16384), norms (80 params per rank) exact, Adam m and v exact (8 bytes/param)
    pinned = 2 * (2 * (8192 + 4096 + 16384 + 8192) + 2 * 16384)
    assert host_state_pinned_bytes(cfg, 1, 1, n) == pinned + 2 * 4 * 80 + 8 * P / n == 402688


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("weights", ["autocast", "bf16"])
def test_activation_model_equals_measured_bytes_in_bf16(name, weights):
    """Matmul inputs bf16; the residual stream fp32 under autocast over fp32 weights (what --bf16
    does without FSDP2), bf16 with bf16 weights (FSDP2's MixedPrecisionPolicy); RMSNorm keeps fp32
    copies either way. Predicted = measured within 2%, or the label views the chunked loss keeps
    (b*s*8 bytes, counted apart by the accountant)."""
    cfg = _cfg(name)
    torch.manual_seed(0)
    for mem in BF16_MEMS:
        model = GPTModel(cfg, memory=mem)
        if weights == "bf16":
            model = model.to(torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (2, 96))
        acct = SavedTensorAccountant().attach(model)
        with acct.recording(), torch.autocast("cpu", torch.bfloat16, enabled=weights == "autocast"):
            model(input_ids=ids, labels=ids).float().mean().backward()
        measured = acct.report()["device_bytes"]
        pred = activation_bytes(cfg, 96, 2, memory=mem, dtype_bytes=2, device="cpu",
                                residual_bytes=4 if weights == "autocast" else 2)
        assert abs(pred["total"] - measured) <= max(0.02 * measured, 2 * 96 * 8), (mem, pred, measured)


@pytest.mark.parametrize("seq,gpus", ALST)
def test_alst_configurations_are_feasible(seq, gpus):
    plans = plan(_llama8b(seq), Workload(seq), Hardware(gpus, gpu_mem_gb=80))
    assert plans, f"Llama-8B at {seq} tokens on {gpus} x 80 GB"
    best = plans[0]
    assert best.tp * best.sp * best.pp * best.dp == gpus
    assert best.total_gb <= 80 and best.host_node_gb <= 2048 * 0.9
    assert best.sharding != "none"
    # the reserve is stated: 4 GB + 10% of what is modelled
    modelled = best.state_device_gb + best.activations_gb
    assert best.reserve_gb == pytest.approx(4 + 0.1 * modelled)
    assert best.total_gb == pytest.approx(modelled + best.reserve_gb)
    # replicated model state (no sharding) finds no layout for the 1- and 8-GPU runs
    if gpus <= 8:
        assert not plan(_llama8b(seq), Workload(seq), Hardware(gpus, gpu_mem_gb=80),
                        sharding="none")


def test_every_plan_covers_every_gpu_when_a_node_size_does_not_divide_them():
    """12 GPUs, 8 to a node: tp = 8 leaves no whole layout (it once gave tp=8 dp=1, 8 ranks)."""
    cfg = GPTConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                    vocab_size=32000, normalization="RMSNorm", activation="swiglu",
                    position_embedding_type="rope", add_bias_linear=False)
    plans = plan(cfg, Workload(32768, global_batch=12), Hardware(12))
    assert plans and all(p.tp * p.sp * p.pp * p.dp == 12 for p in plans)
    assert {p.tp for p in plans} <= {1, 2, 4}


def test_max_seq_is_monotone_and_consistent_with_feasibility():
    make = lambda s: preset("llama-1b", max_position_embeddings=s)  # noqa: E731
    found = {}
    for gpus, mem in ((1, 24), (1, 40), (2, 40), (4, 40)):
        seq, best = max_feasible_seq(make, Hardware(gpus, gpu_mem_gb=mem))
        step = 1024                                   # lcm(1024, gpus)
        assert seq > 0 and seq % step == 0 and best is not None and best.total_gb <= mem
        assert plan(make(seq), Workload(seq), Hardware(gpus, gpu_mem_gb=mem))
        assert not plan(make(seq + step), Workload(seq + step), Hardware(gpus, gpu_mem_gb=mem))
        found[gpus, mem] = seq
    assert found[1, 24] < found[1, 40] <= found[2, 40] <= found[4, 40]


def _flag_argv(p):
    return [tok for flag in p.flag_list() for tok in shlex.split(flag)]


def test_each_plans_flags_are_accepted_by_pretrain_gpt():
    """Each plan's own flags (no --seq-length added) parse back to its layout and sequence; the
    ring plans' through _context_flags_parse (the 32-GPU ALST run with the ring); a MoE preset's
    (Qwen3-30B-A3B on 64 GPUs, each sharding mode) with its --expert-model-parallel-size."""
    parser = build_parser()
    cfg8 = _llama8b(131072)
    cases = [("llama-8b", plan(_llama8b(s), Workload(s), Hardware(g))) for s, g in ALST]
    ringed = plan(_llama8b(ALST[2][0]), Workload(ALST[2][0]), Hardware(ALST[2][1]), ring=True)
    assert any(p.cp > 1 for p in ringed[:6])
    for p in ringed[:6]:
        _context_flags_parse(parser, p)
    modes = (("none", None), ("distributed-optimizer", False), ("distributed-optimizer", True),
             ("fsdp", False), ("fsdp", True))
    cases += [("llama-8b", plan(cfg8, Workload(131072, global_batch=16), Hardware(32), sharding=m,
                                cpu_offload=o)) for m, o in modes]
    qwen = preset("qwen3-30b-a3b", max_position_embeddings=32768)
    cases += [("qwen3-30b-a3b", plan(qwen, Workload(32768, global_batch=64), Hardware(64),
                                     sharding=m, cpu_offload=o)) for m, o in modes]
    seen = set()
    for model, plans in cases:
        assert plans
        for p in plans[:6]:
            argv = ["--model", model] + _flag_argv(p)
            args, unknown = parser.parse_known_args(argv)
            assert not unknown, unknown
            assert (args.seq_length, args.max_position_embeddings) == (p.seq_length,) * 2
            assert (args.tensor_model_parallel_size, args.sequence_parallel_size,
                    args.pipeline_model_parallel_size, args.micro_batch_size,
                    args.expert_model_parallel_size) == (p.tp, p.sp, p.pp, 1, p.ep)
            assert args.bf16 and args.sequence_parallel == p.sequence_parallel
            if model == "qwen3-30b-a3b":              # the layout planned: whole experts per tp rank
                assert (args.expert_tensor_parallel_size or p.tp) == 1
            assert MemoryOptions.from_config(job_config(args).memory) == p.memory
            for flag, on in (("--use-distributed-optimizer", p.sharding == "distributed-optimizer"),
                             ("--use-torch-fsdp2", p.sharding == "fsdp"),
                             ("--optimizer-cpu-offload", p.cpu_offload)):
                assert (flag in argv) == on and getattr(args, flag[2:].replace("-", "_")) == on
            seen.add((p.sharding, p.cpu_offload, p.pp > 1, p.sequence_parallel, model, p.ep > 1))
    assert {s[:2] for s in seen} == {("none", False), ("distributed-optimizer", False),
                                     ("distributed-optimizer", True), ("fsdp", False),
                                     ("fsdp", True)}
    assert {s[:2] for s in seen if s[4] == "qwen3-30b-a3b" and s[5]} == {s[:2] for s in seen}


def test_cli_table_fits_120_columns_with_labelled_columns_and_json(capsys):
    main = plan_parallel.main
    assert main(["--model", "llama-8b", "--seq-length", "3700000", "--num-gpus", "8", "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    header = out.splitlines()[3]
    for label in ("sharding", "state", "activ", "reserve", "total", "host"):
        assert label in header
    assert "--use-torch-fsdp2" in out
    assert main(["--model", "llama-8b", "--seq-length", "524288", "--num-gpus", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans"][0]["total_gb"] <= 80 and "--optimizer-cpu-offload" in data["plans"][0]["flags"]
    assert main(["--model", "llama-1b", "--num-gpus", "2", "--gpu-memory-gb", "40", "--max-seq",
                 "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    make = lambda s: preset("llama-1b", max_position_embeddings=max(s, 2048))  # noqa: E731
    assert found["max_seq"] == max_feasible_seq(make, Hardware(2, gpu_mem_gb=40))[0] > 0
    assert main(["--model", "llama-8b", "--num-gpus", "8", "--max-seq"]) == 0
    out = capsys.readouterr().out
    # the exact host pool (offloaded activations counted unrounded): the powers of two no longer
    # bind at 8 GPUs (with Ulysses head chunks the node's host memory itself does)
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "limited by" in out and "powers of two" not in out
    with pytest.raises(SystemExit):
        main(["--model", "llama-8b", "--seq-length", "8192", "--num-gpus", "1", "--sharding", "none",
              "--optimizer-cpu-offload"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "needs a sharded mode" in err[-1] and "Traceback" not in "".join(err)  # argparse usage


def test_qk_layernorm_term_matches_the_measured_difference():
    """--qk-layernorm keeps the QKV output, (h + 2g) * d values per token and layer per tp rank
    (measured in tests/unit/test_families.py); YaRN counts as RoPE (the shared cos/sin)."""
    from megatron_sp.memory.planner import activation_bytes
    from megatron_sp.models import preset
    shape = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 kv_channels=32, ffn_hidden_size=128, vocab_size=300, max_position_embeddings=64)
    for tp, sp in ((1, 1), (2, 1), (1, 2)):
        with_qk, without = (activation_bytes(preset("qwen3-0.6b", qk_layernorm=qk, **shape), 32, 2,
                                             tp=tp, sp=sp)["layer"] for qk in (True, False))
        assert with_qk - without == 2 * 32 / sp * (4 + 2 * 2) // tp * 32 * 4
    yarn = preset("qwen3-0.6b", position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                  yarn_original_max_position_embeddings=32, **shape)
    assert activation_bytes(yarn, 32, 2)["shared"] == 2 * 64 * 32 * 4


def predicted_and_measured_peak(cfg, mem, ids, bf16):
    """(the planner's step peak, the measured one) of a one-rank GPTModel step on ids [1, s]
    (gradients allocated first; under bf16 autocast less the weights' bf16 copies)."""
    model = GPTModel(cfg, memory=mem)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    measured = _measured_peak(model, ids, bf16) - (2 * cfg.num_parameters() if bf16 else 0)
    pred = step_peak_bytes(cfg, ids.shape[1], 1, memory=mem, dtype_bytes=2 if bf16 else 4,
                           residual_bytes=4, device="cpu")["device"]
    return pred, measured


def _measured_peak(model, ids, bf16):
    """Peak bytes allocated during one training step above what existed before it (gradients
    preexist, as in every step after the first), from the profiler's memory timeline (CPU). Uses
    torch.profiler._memory_profiler, the timeline behind prof.export_memory_timeline. No
    with_stack: the Python tracer only names parameters (PREEXISTING events, not summed here);
    every step-peak case measured the same bytes without it, at half the time (issue 49)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import _memory_profiler

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids.roll(-1, 1)).float().mean()
        loss.backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    now = peak = 0
    for _, action, _, size in _memory_profiler.MemoryProfile(prof.profiler.kineto_results).timeline:
        if action == _memory_profiler.Action.CREATE:
            now += size
        elif action == _memory_profiler.Action.DESTROY:
            now -= size
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_step_peak_is_an_upper_bound_of_the_measured_peak(bf16):
    """step_peak_bytes against the measured peak of a step: never more than 3% under (timeline
    granularity), at most 35% over (the layer backward and loss-chunk terms are deliberately
    conservative). Where the unchunked output layer sets the peak (vocabulary 8192 against hidden
    128) within 5%: the old output term, which counted the fp32 softmax twice, was 37-66% over.
    Weight copies under autocast (2 bytes/param, model state in the planner) are taken off the
    measured peak."""
    torch.manual_seed(0)
    mems = [MemoryOptions(), MemoryOptions(recompute_granularity="full"),
            MemoryOptions(loss_chunks=4), MemoryOptions(mlp_tiles=4),
            MemoryOptions(recompute_granularity="full", mlp_tiles=4, loss_chunks=4)]
    seq = 1024
    for vocab in (8192, 512):
        cfg = preset("llama-tiny", num_layers=2, hidden_size=128, num_attention_heads=8,
                     num_query_groups=4, ffn_hidden_size=384, vocab_size=vocab,
                     max_position_embeddings=seq)
        ids = torch.randint(0, vocab, (1, seq))
        for mem in mems:
            pred, measured = predicted_and_measured_peak(cfg, mem, ids, bf16)
            output_sets_peak = vocab == 8192 and mem.loss_chunks == 1
            upper = 1.05 if output_sets_peak else 1.35
            assert 0.97 <= pred / measured <= upper, (vocab, mem, pred / measured, pred, measured)


def test_rms_norm_term_follows_the_device_kernel():
    """device="cuda" models torch's fused RMSNorm (input + fp32 rstd kept), "cpu" the composite
    (fp32 x, rstd, x_hat): per RMSNorm (2 per layer + the final one) they differ by exactly the
    x_hat copy, plus the upcast of a 16-bit input; LayerNorm is the same kernel on both."""
    from megatron_sp.memory.planner import _fused_rms_norm
    if not _fused_rms_norm("cuda"):
        pytest.skip("this torch has no fused RMSNorm kernel (aten::_fused_rms_norm, torch < 2.8)")
    seq, b = 64, 2
    llama, gpt2 = _cfg("llama"), _cfg("gpt2")
    T, H, L = seq * b, llama.hidden_size, llama.num_layers
    for r in (4, 2):                       # fp32 residual (bf16 autocast), bf16 weights
        cpu, cuda = (activation_bytes(llama, seq, b, dtype_bytes=2, residual_bytes=r, device=d)
                     for d in ("cpu", "cuda"))
        assert cpu["layer"] - cuda["layer"] == 2 * T * H * (8 - r)
        assert cpu["output"] - cuda["output"] == T * H * (8 - r)
        assert cpu["total"] - cuda["total"] == (2 * L + 1) * T * H * (8 - r)
    assert activation_bytes(gpt2, seq, b, device="cpu") == activation_bytes(gpt2, seq, b)
    with pytest.raises(ValueError, match="device must be one of cuda, cpu"):
        activation_bytes(llama, seq, b, device="gpu")


# Peaks measured on an H200 (torch 2.11 + CUDA 13.0) by bench/gpu_long_context.py in stop 21:
# llama-1b, batch 1, bf16 autocast, SDPA; torch.cuda.max_memory_allocated of the step minus the
# model state present at that peak (fp32 weights and their bf16 copies; gradients and AdamW state in
# the runs with timed steps), GiB. Recorded figures from real hardware, not computed here.
H200_ACTIVATION_PEAKS_GIB = [("plain", 32768, 68.7), ("chunked loss", 65536, 101.3),
                             ("tiled mlp", 65536, 86.5), ("full recompute", 131072, 112.6),
                             ("all", 131072, 22.6)]


@pytest.mark.parametrize("name,seq,measured_gib", H200_ACTIVATION_PEAKS_GIB)
def test_step_peak_against_the_h200_measurements(name, seq, measured_gib):
    """The step peak for CUDA (fused RMSNorm) within [-2%, +10%] of the H200's measured peaks; the
    CPU composite's count was 17-19% over where the layers set the peak (one fp32 [T, H] per
    RMSNorm: 8.25 GiB at 32K)."""
    from megatron_sp.memory import TECHNIQUES
    from megatron_sp.memory.planner import _fused_rms_norm
    if not _fused_rms_norm("cuda"):
        pytest.skip("this torch has no fused RMSNorm kernel (aten::_fused_rms_norm, torch < 2.8)")
    mem = MemoryOptions(**TECHNIQUES[name])
    pred = step_peak_bytes(preset("llama-1b"), seq, 1, memory=mem, dtype_bytes=2,
                           residual_bytes=4)["device"] / 2**30
    assert 0.98 <= pred / measured_gib <= 1.10, (name, seq, pred, measured_gib)


# The ring of context parallelism (cp > 1, docs/design.md §14) -----------------------------------

def _context_flags_parse(parser, p):
    """p's flags through pretrain_gpt's parser and the JobConfig: Megatron's context-parallel flags
    give back p's Ulysses degree and ring, and its own --seq-length and positions."""
    argv = ["--model", "llama-8b"] + _flag_argv(p)
    args, unknown = parser.parse_known_args(argv)
    assert unknown == [], unknown
    assert (args.seq_length, args.max_position_embeddings) == (p.seq_length,
                                                                p.max_position_embeddings)
    if p.cp > 1:
        assert args.cp_comm_type == ("p2p" if p.sp == 1 else "a2a+p2p")
        if p.sp > 1:
            assert list(args.hierarchical_context_parallel_sizes) == [p.sp, p.cp]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.micro_batch_size) == (p.tp, p.pp, 1)
    if p.cp == 1:
        assert args.sequence_parallel_size == p.sp and "--context-parallel-size" not in argv
    else:
        assert args.context_parallel_size == p.sp * p.cp and "--sequence-parallel-size" not in argv
    assert args.bf16 and args.sequence_parallel == p.sequence_parallel
    job = job_config(args)
    assert MemoryOptions.from_config(job.memory) == p.memory
    assert (job.parallel.sequence_parallel_size, job.parallel.ring_size) == (p.sp, p.cp)
    assert job.training.seq_length == p.seq_length
    return unknown


def test_ring_layouts_reach_past_the_head_limit_and_their_flags_parse():
    """Llama-8B (32 query heads) on 256 GPUs at 64M tokens: Ulysses stops at tp*sp = 32, so
    without a ring no layout fits (one sequence per step leaves dp = 1: pp would have to take
    the rest); with the ring there are plans whose sequence spans sp*cp > 32 ranks, ring alone
    (--cp-comm-type p2p) and around Ulysses (a2a+p2p), and pretrain_gpt's parser takes their
    flags (the two context-parallel flags it may not know yet aside)."""
    seq, gpus = 64 * 2 ** 20, 256
    assert not plan(_llama8b(seq), Workload(seq), Hardware(gpus))
    plans = plan(_llama8b(seq), Workload(seq), Hardware(gpus), ring=True)
    assert plans and all(p.tp * p.sp * p.cp * p.pp * p.dp == gpus for p in plans)
    assert all(p.tp * p.sp <= 32 for p in plans)              # Ulysses still within the heads
    assert plans[0].sp * plans[0].cp > 32 and plans[0].total_gb <= 80
    assert plans[0].to_dict()["cp"] == plans[0].cp
    hybrid = next(p for p in plans if p.sp > 1 and p.cp > 1)
    alone = next(p for p in plans if p.sp == 1 and p.cp > 1)
    assert alone.context_flags() == [f"--context-parallel-size {alone.cp}", "--cp-comm-type p2p"]
    assert hybrid.context_flags() == [f"--context-parallel-size {hybrid.sp * hybrid.cp}",
                                      "--cp-comm-type a2a+p2p",
                                      f"--hierarchical-context-parallel-sizes {hybrid.sp} {hybrid.cp}"]
    parser = build_parser()
    for p in [hybrid, alone] + plans[:4]:
        _context_flags_parse(parser, p)
    assert plans[0].comm_gb["cp"] > 0


def _gqa(num_layers=1, hidden=64, heads=8, groups=4, ffn=8):
    return GPTConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                     num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=256,
                     normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     add_bias_linear=False, tie_embeddings=False)


def test_ring_memory_terms_by_hand():
    """b = 2, s = 64, h = 8, g = 4, d = 8, bf16 (e = 2). Outside attention a rank holds
    T = b s/(sp cp) = 32 tokens whether sp = 2, cp = 2 (hybrid) or cp = 4 (ring alone), so every
    saved term equals Ulysses' with the same T; the ring's saved lse is fp32 [b, h/sp, s/cp] and
    its out [b, s/cp, h/sp, d] (with sp = 1 the out-proj input itself: not counted twice). One kv
    block [b, s/cp, max(g, sp)/sp, d] has K = 1024 elements: forward the held and the received
    block, 2 x 2K x 2 = 8192 bytes; backward + dk, dv accumulating, travelling and received in
    fp32, 3 x 2K x 4 = 24576 more, and they add to one layer's attention backward exactly."""
    from megatron_sp.memory.planner import _layer_backward_peak, ring_buffer_bytes
    cfg = _gqa()
    b, s = 2, 64
    for sp, cp in ((2, 2), (1, 4)):
        T = b * s / (sp * cp)
        assert T == 32
        ring = ring_buffer_bytes(cfg, T, tp=1, sp=sp, cp=cp, dtype_bytes=2)
        K = b * (s // cp) * (max(4, sp) // sp) * 8
        assert ring == {"forward": 8192, "backward": 32768, "block_elements": K} and K == 1024
        terms = activation_bytes(cfg, s, b, sp=sp, cp=cp, dtype_bytes=2)["terms"]
        assert terms == activation_bytes(cfg, s // cp, b, sp=sp, dtype_bytes=2)["terms"]
        assert terms["sdpa_lse"] == b * (8 // sp) * (s // cp) * 4 == 1024
        assert terms["sdpa_out"] == (b * (s // cp) * (8 // sp) * 8 * 2 if sp > 1 else 0)
        assert terms["sdpa_qkv"] == (T * 8 * 8 + 2 * K) * 2 == 8192
        with_ring, without = (_layer_backward_peak(cfg, T, 1, sp, False, 2, 4, MemoryOptions(),
                                                   "cuda", c) for c in (cp, 1))
        assert with_ring - without == 32768
        peak = step_peak_bytes(cfg, s, b, sp=sp, cp=cp)
        assert peak["ring"] == ring and peak["layer_backward"] >= ring["backward"]
    assert ring_buffer_bytes(cfg, 32, sp=4) == {"forward": 0, "backward": 0, "block_elements": 0}
    # tp = 2 halves the kv heads each ring block carries: g/tp = 2 < sp = 4 replicated to 4
    assert ring_buffer_bytes(cfg, 32, tp=2, sp=4, cp=2)["block_elements"] == 32 * 4 * 8


def test_ring_comm_bytes_equal_the_measured_formulas():
    """comm_bytes_per_step's ring bytes against tests/distributed/test_ring_attention.py's measured
    formula (B = 2, S = 32, D = 8, h = 4, g = 2, fp32: forward 2 (cp-1) kv_elems 4, backward that
    + cp 2 kv_elems 4), and the hybrid's (a = sp = 2, r = cp = 2) against
    tests/distributed/test_context_parallel_hybrid.py's, all-to-alls included; full and selective
    recompute run the forward ring twice."""
    from dataclasses import replace
    from megatron_sp.mesh import ParallelDims
    from megatron_sp.memory.planner import comm_bytes_per_step
    B, S, D, h, g = 2, 32, 8, 4, 2
    cfg = _gqa(hidden=h * D, heads=h, groups=g)
    work = Workload(S, global_batch=B, micro_batch=B, dtype_bytes=4)
    for cp in (2, 4):
        kv_elems = B * (S // cp) * g * D
        forward = 2 * (cp - 1) * kv_elems * 4
        backward = 2 * (cp - 1) * kv_elems * 4 + cp * 2 * kv_elems * 4
        got = comm_bytes_per_step(cfg, work, ParallelDims(cp, cp=cp))
        assert got["cp"] == forward + backward and "sp" not in got
        for rec in ("full", "selective"):
            mem = MemoryOptions(recompute_granularity=rec)
            assert comm_bytes_per_step(cfg, replace(work, memory=mem),
                                       ParallelDims(cp, cp=cp))["cp"] == 2 * forward + backward
    kv_elems = 2 * 8 * 2 * 8                  # cp = 4: [2, 8, 2, 8]
    assert comm_bytes_per_step(cfg, work, ParallelDims(4, cp=4))["cp"] == 6144 + 14336 == 20480
    # the hybrid, a = 2 Ulysses ranks x r = 2 ring ranks, n = S/(a r) = 8 tokens per rank
    a, r = 2, 2
    n, g_e = S // (a * r), max(g, a)
    a2a = ((a - 1) * B * n * D * (h + 2 * g_e) // a + (a - 1) * B * n * D * h // a) * 4
    ring_fwd = 2 * (r - 1) * B * n * g_e * D * 4
    ring_bwd = ring_fwd + 2 * r * B * n * g_e * D * 4
    got = comm_bytes_per_step(cfg, work, ParallelDims(4, sp=a, cp=r))
    assert (got["sp"], got["cp"]) == (2 * a2a, ring_fwd + ring_bwd) == (6144, 8192)
    try:
        from megatron_sp.context_parallel.hybrid import hybrid_comm_bytes
    except ImportError:
        return
    want = hybrid_comm_bytes(B, S, h, g, D, a, r)
    assert got["sp"] == want["a2a_forward"] + want["a2a_backward"]
    assert got["cp"] == want["ring_forward"] + want["ring_backward"]


def test_ring_layouts_only_add_to_the_answers_without_a_ring():
    """Every plan without a ring is the same with ring layouts allowed (same numbers, same flags);
    the ring's come after them in the layout order, so equal scores keep the plain plan first."""
    from megatron_sp.memory.planner import layouts
    cfg = _llama8b(131072)
    for gpus, batch in ((8, 1), (16, 2)):
        work, hw = Workload(131072, global_batch=batch), Hardware(gpus)
        plain = [p.to_dict() for p in plan(cfg, work, hw)]
        ringed = [p.to_dict() for p in plan(cfg, work, hw, ring=True)]
        assert plain and [p for p in ringed if p["cp"] == 1] == plain
        assert any(p["cp"] > 1 for p in ringed)
        order = layouts(hw, ring=True)
        first_ring = next(i for i, d in enumerate(order) if d.cp > 1)
        assert order[:first_ring] == layouts(hw) and all(d.cp > 1 for d in order[first_ring:])


def test_llama3_70b_preset_and_the_no_ring_flag(capsys):
    """--model llama3-70b: the published shapes (80 layers, hidden 8192, 64 heads, 8 kv heads, ffn
    28672, vocab 128256, RoPE theta 5e5); --no-ring gives the plans without cp."""
    cfg = preset("llama3-70b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
            cfg.ffn_hidden_size, cfg.vocab_size, cfg.rotary_base, cfg.tie_embeddings) == \
        (80, 8192, 64, 8, 28672, 128256, 500000.0, False)
    main = plan_parallel.main
    assert main(["--model", "llama3-70b", "--seq-length", "1048576", "--num-gpus", "64", "--json",
                 "--top", "50"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == 70553706496 and any(p["cp"] > 1 for p in data["plans"])
    assert main(["--model", "llama3-70b", "--seq-length", "1048576", "--num-gpus", "64", "--json",
                 "--top", "50", "--no-ring"]) == 0
    plain = json.loads(capsys.readouterr().out)["plans"]
    assert plain and all(p["cp"] == 1 for p in plain)
    assert main(["--model", "llama3-70b", "--seq-length", "1048576", "--num-gpus", "64",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120


# The attention kernel and packed documents (segments through the block kernels) ---------------

def test_each_plan_names_its_attention_kernel():
    """attention_kernel (a pure function) names the kernel in block_kernels' words: SDPA without a
    ring or documents, else block_kernel's choice, FlashAttention-2 varlen on CUDA in bf16 (a head
    dim that is a multiple of 8), the memory-efficient kernel in fp32 or for other head dims, the
    CPU flash kernel on CPU; each plan carries it (and its JSON), and the table prints it on one
    line within 120 columns."""
    from megatron_sp.attention.block_kernels import KERNEL_DESCRIPTIONS, block_kernel
    from megatron_sp.memory.planner import attention_kernel, attention_kernel_name
    flash = KERNEL_DESCRIPTIONS["flash"].split(", one call")[0]
    assert attention_kernel("cuda", torch.bfloat16, 128, 4) == (
        "FlashAttention-2 varlen (aten._flash_attention_forward/_backward), ring blocks as "
        "segments")
    assert attention_kernel("cuda", 2, 128, 4, documents=True) == (
        f"{flash}, ring blocks and packed documents as segments")
    assert attention_kernel("cuda", "bf16", 128, 1, documents=True) == (
        f"{flash}, packed documents as segments")
    assert attention_kernel("cpu", 2, 128, 2).startswith("aten's CPU flash kernel, ring blocks")
    assert attention_kernel("cuda", 4, 128, 2).startswith("the memory-efficient kernel (aten.")
    assert attention_kernel("cuda", 2, 128, 1).startswith("SDPA without a ring or documents: cuDNN")
    assert attention_kernel("cpu", 4, 64, 1).startswith("SDPA without a ring or documents: flash")
    for device in ("cuda", "cpu"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in (64, 128, 100, 512):
                assert attention_kernel_name(device, dtype, d, 2) == \
                    block_kernel(torch.device(device), dtype, d)
                assert attention_kernel_name(device, dtype, d, 1) == "sdpa"
    with pytest.raises(ValueError, match="device must be one of"):
        attention_kernel("gpu", 2, 128, 2)
    plans = plan(_llama8b(131072), Workload(131072), Hardware(8), ring=True)
    assert {p.attention_kernel for p in plans} == {attention_kernel("cuda", 2, 128, 1),
                                                   attention_kernel("cuda", 2, 128, 2)}
    assert all(p.to_dict()["attention_kernel"] == p.attention_kernel for p in plans)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_parallel.main(["--model", "llama-8b", "--seq-length", "131072",
                                   "--num-gpus", "8", "--top", "3", "--no-ring"]) == 0
    lines = out.getvalue().splitlines()
    assert f"attention kernel: {attention_kernel('cuda', 2, 128, 1)}" in lines
    assert max(len(line) for line in lines) <= 120


def test_attention_backward_counts_the_kernels_own_gqa_buffers():
    """b s = 128 tokens, h = 8 query heads, g = 4 (GQA) or 8, d = 64 (q = T h d elements, T =
    b s/cp; d large against the hidden size 64, so that attention sets the layer's peak):
    one layer's attention backward holds the kernel's own key/value head buffers on top of the
    common ones: FlashAttention-2 (SDPA's at cp = 1, varlen in the ring, bf16) dk, dv expanded to
    the query heads under GQA, 2 q e; the memory-efficient block kernel (fp32 on CUDA) k, v
    repeated per segment and their gradients at the query heads, 4 q e, even without GQA; aten's
    CPU flash kernel nothing. The ring's own buffers come on top, the same for every kernel
    (LayerNorm: the same norm kernel on both devices)."""
    from megatron_sp.memory.planner import _layer_backward_peak, ring_buffer_bytes
    b, s, mem = 2, 64, MemoryOptions()
    for groups in (4, 8):
        cfg = replace(_gqa(groups=groups), normalization="LayerNorm", kv_channels=64)
        gqa = groups < 8
        for cp in (1, 2, 4):
            T = b * s / cp
            q = T * 8 * 64

            def peak(device, e):
                return _layer_backward_peak(cfg, T, 1, 1, False, e, 4, mem, device, cp)

            def common(device, e):        # the same layer with no kernel-specific buffers
                return peak(device, e) - ring_buffer_bytes(cfg, T, cp=cp, dtype_bytes=e)["backward"]
            flash, cpu = common("cuda", 2), common("cpu", 2)
            assert flash - cpu == (2 * q * 2 if gqa else 0)          # the same saved terms
            if cp > 1:                                               # the block kernel in fp32
                assert common("cuda", 4) - common("cpu", 4) == 4 * q * 4
            else:                                                    # SDPA's on CUDA in fp32
                assert common("cuda", 4) - common("cpu", 4) == (2 * q * 4 if gqa else 0)


def _index_elements(plan_steps, b, n):
    """q and k token indices the varlen kernel's packed batches hold (segments.SegmentBatch; a
    batch of one segment runs on views and packs nothing)."""
    return sum(x.numel() for batches in plan_steps for batch in batches
               if len(batch.segments) > 1 for x in batch.packed(b, n, n, "cpu")[:2])


def test_plan_index_bytes_count_the_segment_plans_indices():
    """plan_index_bytes against the plans the kernels run (attention/segments.py): the ring's
    plan without documents holds no indices (every segment runs on views); with random packed
    documents never more than b 3c (cp + 1) on every rank (c = s/(2cp)); blockwise attention over
    packed documents (cp = 1) at most 2 b s; cu_seqlens aside. Nothing for the kernels that run
    per segment on slices."""
    from megatron_sp.attention.blockwise import blockwise_plan
    from megatron_sp.attention.segments import document_bounds, ring_plan
    from megatron_sp.memory.planner import plan_index_bytes
    gen = torch.Generator().manual_seed(0)
    for cp in (2, 3, 4):
        for b in (1, 2):
            s = 2 * cp * 16
            c, n = s // (2 * cp), s // cp
            formula = plan_index_bytes(s, b, cp=cp, documents=True)
            assert formula == 8 * b * 3 * c * (cp + 1) and plan_index_bytes(s, b, cp=cp) == 0
            ids = (torch.rand(b, s, generator=gen) < 0.05).long().cumsum(1)   # random documents
            for rank in range(cp):
                assert _index_elements(ring_plan(None, b, s, cp, rank, True).steps, b, n) == 0
                assert 8 * _index_elements(ring_plan(document_bounds(ids), b, s, cp, rank,
                                                     True).steps, b, n) <= formula
    b, s = 2, 256
    ids = (torch.rand(b, s, generator=gen) < 0.05).long().cumsum(1)
    batches = [[batch for batch, _ in blockwise_plan(ids, s, s, True)]]
    assert 0 < 8 * _index_elements(batches, b, s) <= plan_index_bytes(s, b, documents=True) \
        == 8 * 2 * b * s
    assert plan_index_bytes(s, b) == 0                                  # SDPA: no plan
    for kernel in ("cpu", "efficient"):
        assert plan_index_bytes(s, b, cp=2, kernel=kernel, documents=True) == 0


def test_documents_cost_only_their_index_tensors_and_grow_linearly():
    """Packed documents are segments, never a mask: the step's peak with documents is the peak
    without + their plans' index tensors (plan_index_bytes: blockwise attention's 2 b s at
    cp = 1, the ring plan's b 3c (cp + 1) at cp > 1, per micro-batch in flight), on CUDA in
    bf16 (FlashAttention-2 both ways; without documents every segment runs on views, no index);
    on CPU, where the kernel indexes nothing, the same bytes.
    That term is linear in s (no s^2): doubling the sequence doubles it. The planner's plans with
    documents differ from those without by the term (and its fragmentation share) only, and print
    --reset-attention-mask, which pretrain_gpt.py takes."""
    from megatron_sp.memory.planner import plan_index_bytes
    cfg = preset("llama-tiny", max_position_embeddings=16384)
    mem = MemoryOptions(recompute_granularity="full")
    diffs = {}
    for seq in (4096, 8192):
        for sp, cp in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4)):
            for in_flight in (1, 2):
                def peak(documents, device="cuda"):
                    return step_peak_bytes(cfg, seq, 2, sp=sp, cp=cp, memory=mem,
                                           in_flight_micro_batches=in_flight, device=device,
                                           documents=documents)
                with_docs, without = peak(True), peak(False)
                index = [plan_index_bytes(seq, 2, cp=cp, documents=d,
                                          in_flight_micro_batches=in_flight)
                         for d in (True, False)]
                assert with_docs["device"] - without["device"] == index[0] - index[1]
                assert (with_docs["index"], without["index"]) == tuple(index)
                assert with_docs["host"] == without["host"]
                assert peak(True, "cpu")["device"] == peak(False, "cpu")["device"]
                assert peak(True, "cpu")["index"] == 0
                diffs[seq, sp, cp, in_flight] = (index[0] - index[1], index[0])
        assert diffs[seq, 1, 1, 1][0] == 8 * 2 * 2 * seq                # 2 b s int64, cp = 1
        assert diffs[seq, 1, 2, 1][0] == 8 * 2 * 3 * seq / 4 * 3        # b 3c (cp+1), c = s/4
        assert diffs[seq, 1, 2, 2][0] == 2 * diffs[seq, 1, 2, 1][0]     # one plan per in flight
    for key in diffs:
        if key[0] == 4096:
            assert diffs[(8192,) + key[1:]] == tuple(2 * x for x in diffs[key])
    # the planner: the same layouts and techniques, totals apart by the index term only
    work, hw = Workload(8192, global_batch=2), Hardware(4, gpu_mem_gb=8)
    plain = {(p.tp, p.sp, p.cp, p.pp): p for p in plan(cfg, work, hw, ring=True)}
    packed = plan(cfg, replace(work, documents=True), hw, ring=True)
    assert packed and len(packed) == len(plain)
    parser = build_parser()
    for p in packed:
        q = plain[p.tp, p.sp, p.cp, p.pp]
        assert (p.memory, p.sharding, p.cpu_offload, p.documents) == \
            (q.memory, q.sharding, q.cpu_offload, True)
        in_flight = work.in_flight(ParallelDims(4, tp=p.tp, sp=p.sp, cp=p.cp, pp=p.pp))
        index = [plan_index_bytes(8192, 1, cp=p.cp, documents=d,
                                  in_flight_micro_batches=in_flight) for d in (True, False)]
        extra = (index[0] - index[1]) / GB
        assert p.activations_gb - q.activations_gb == pytest.approx(extra, rel=1e-9, abs=1e-12)
        assert p.total_gb - q.total_gb == pytest.approx(1.1 * extra, rel=1e-9, abs=1e-12)
        assert p.comm_gb == q.comm_gb
        assert "--reset-attention-mask" in p.flags() and "--reset-attention-mask" not in q.flags()
        args, unknown = parser.parse_known_args(["--model", "llama-tiny"] + _flag_argv(p))
        assert not unknown and args.reset_attention_mask


# Each plan's cost: step time (compute + communication), tokens/s, MFU; --max-step-seconds -------

def test_each_plans_cost_is_its_step_time_tokens_and_model_flops():
    """step_s = compute_s + comm_s (the score); compute_s = Megatron-LM's model FLOPs (by hand,
    docs/design.md §9) / (GPUs x peak x mfu) x technique cost x (1 + bubble); tokens_per_s =
    global batch x seq / step_s; mfu = model FLOPs / (step_s x GPUs x peak), at most the assumed
    mfu, below it by what recompute, the bubble and communication cost; all in to_dict."""
    from megatron_sp.training.flops import num_floating_point_operations
    seq = 131072
    cfg = preset("llama-tiny", max_position_embeddings=seq)
    work, hw = Workload(seq, global_batch=4), Hardware(8, gpu_mem_gb=5, peak_tflops=500, mfu=0.5)
    L, H, a, g = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
    F, V, d = cfg.ffn_hidden_size, cfg.padded_vocab_size(1), cfg.kv_channels
    flops = 12 * 4 * seq * L * H ** 2 * ((1 + g / a + seq / H) * d * a / H + F / H * 1.5
                                         + V / (2 * L * H))
    assert num_floating_point_operations(4, seq, L, H, a, g, F, V, d, True) == \
        pytest.approx(flops, rel=1e-12)
    plans = plan(cfg, work, hw, ring=True)
    assert len(plans) > 5 and any(p.pp > 1 for p in plans) and any(p.cost > 1.02 for p in plans)
    peak = 8 * 500e12
    for p in plans:
        bubble = (p.pp - 1) / work.micro_batches(p.dp)
        assert p.model_flops == pytest.approx(flops, rel=1e-12) and p.peak_flops == peak
        assert p.compute_s == pytest.approx(flops / (peak * 0.5) * p.cost * (1 + bubble))
        assert p.comm_s > 0 and p.step_s == p.score == pytest.approx(p.compute_s + p.comm_s)
        assert p.tokens_per_s == pytest.approx(4 * seq / p.step_s)
        assert p.mfu == pytest.approx(flops / (p.step_s * peak))
        assert p.mfu == pytest.approx(0.5 / (p.cost * (1 + bubble) + p.comm_s / (flops / peak / 0.5)))
        assert p.mfu < 0.5
        d_ = p.to_dict()
        for key in ("step_s", "compute_s", "comm_s", "tokens_per_s", "mfu", "model_flops"):
            assert d_[key] == getattr(p, key)
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)


def _tiny(s):
    return preset("llama-tiny", max_position_embeddings=max(s, 2048))


def test_max_step_seconds_bounds_the_longest_sequence_and_says_what_binds():
    """max_feasible_seq(max_step_s=S): the longest length whose fastest plan's step is <= S; the
    next length fits memory but its fastest step exceeds S, and binding_limit says "step time";
    without the bound (or with an ample one) the memory limit's answer and "device memory";
    host memory when only the host stops it; S <= 0 refused in one sentence."""
    from megatron_sp.memory.planner import binding_limit, seq_step
    hw = Hardware(2, gpu_mem_gb=6)
    free, free_plan = max_feasible_seq(_tiny, hw)
    assert binding_limit(_tiny, hw, None, free) == ("device memory", None)
    bound = free_plan.step_s / 4
    seq, best = max_feasible_seq(_tiny, hw, max_step_s=bound)
    step = seq_step(hw)
    assert 0 < seq < free and seq % step == 0 and best.step_s <= bound
    assert best.seq_length == seq and best == plan(_tiny(seq), Workload(seq), hw)[0]
    nxt = plan(_tiny(seq + step), Workload(seq + step), hw)
    assert nxt and nxt[0].step_s > bound
    why, shown = binding_limit(_tiny, hw, None, seq, max_step_s=bound)
    assert why == "step time" and shown.seq_length == seq + step and shown.step_s > bound
    assert max_feasible_seq(_tiny, hw, max_step_s=10 * free_plan.step_s) == (free, free_plan)
    assert binding_limit(_tiny, hw, None, free, max_step_s=10 * free_plan.step_s)[0] == \
        "device memory"
    assert max_feasible_seq(_tiny, hw, max_step_s=1e-9) == (0, None)
    # a host of 1 GB per node: offloaded activations stop it, not the device
    small_host = replace(hw, host_memory_gb=1.0)
    hseq, hbest = max_feasible_seq(_tiny, small_host)
    assert hbest is not None and binding_limit(_tiny, small_host, None, hseq)[0] == "host memory"
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="positive number of seconds"):
            max_feasible_seq(_tiny, hw, max_step_s=bad)


def test_cli_prints_each_plans_cost_and_the_step_bound(capsys):
    """The table's s/step, tok/s and MFU columns are the JSON's step_s, tokens_per_s and mfu;
    --max-seq --max-step-seconds prints the bound and what binds (JSON: limited_by); a bound
    of 0 or without --max-seq is refused by the parser."""
    main = plan_parallel.main
    argv = ["--model", "llama-tiny", "--num-gpus", "2", "--gpu-memory-gb", "6", "--max-seq"]
    assert main(argv + ["--json"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["limited_by"] == "device memory" and free["max_step_seconds"] is None
    bound = free["plan"]["step_s"] / 4
    assert main(argv + ["--json", "--max-step-seconds", str(bound)]) == 0
    data = json.loads(capsys.readouterr().out)
    d = data["plan"]
    assert data["limited_by"] == "step time" and data["max_seq"] == d["seq_length"] < free["max_seq"]
    assert d["step_s"] <= bound and d["step_s"] == pytest.approx(d["compute_s"] + d["comm_s"])
    assert d["tokens_per_s"] == pytest.approx(d["seq_length"] / d["step_s"])
    assert d["mfu"] == pytest.approx(d["model_flops"] / (d["step_s"] * 2 * 989e12))
    assert main(argv + ["--max-step-seconds", str(bound)]) == 0
    out = capsys.readouterr().out
    assert f"within {bound:g} s/step: {data['max_seq']} tokens" in out
    assert "limited by step time" in out and max(len(line) for line in out.splitlines()) <= 120
    header = next(line for line in out.splitlines() if "tok/s" in line)
    row = next(line for line in out.splitlines() if line.startswith("  1 "))
    assert header.split()[-3:] == ["GB", "tok/s", "MFU"]
    assert row.split()[-4:-3] == [f"{d['step_s']:.1f}"]
    assert row.split()[-2:] == [plan_parallel.rate(d["tokens_per_s"]), f"{100 * d['mfu']:.1f}"]
    for bad in (["--max-step-seconds", "0"], ["--max-step-seconds", "-5"]):
        with pytest.raises(SystemExit):
            main(argv + bad)
        assert "--max-step-seconds must be a positive number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "llama-tiny", "--num-gpus", "2", "--seq-length", "8192",
              "--max-step-seconds", "5"])
    assert "give --max-seq" in capsys.readouterr().err
