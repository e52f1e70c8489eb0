"""Megatron-LM checkpoints in and out (docs/checkpoints.md), against REAL checkpoints that
megatron-core 0.16.1 makes on CPU in one 2-rank spawn (megatron_lm_maker.py):

- GQA: tp 2, GQA 4 heads / 2 groups, RMSNorm, SwiGLU, RoPE, qk-norm, untied, no biases;
- GPT: pp 2 (2 layers per stage), MHA, LayerNorm, exact GELU, learned positions, tied, biases;
- MoE: Mixtral-shaped (4 SwiGLU experts in every layer, top-2, GQA, RoPE), ep 2 (torch format:
  one file per expert-parallel rank, mp_rank_00_000 / mp_rank_00_001);
  each saved as Megatron-LM saves it, in torch_dist and in torch format (iteration 3, 24 samples).

Checked (fp32, logits within 1e-5 of megatron-core's forward on the same tokens):
- in: convert.py's reader on each of the four folders (save folder and iteration folder), our
  one-rank model; also loaded into our tp 2 and sp 2 layouts by the training loader;
- round trip: Megatron -> convert.py --saver megatron_sp -> --saver megatron at another layout
  (GQA tp 2 -> tp 1 x pp 2, GPT pp 2 -> tp 2 x pp 1, MoE -> pp 2, both formats) loads in
  megatron-core strictly
  (StrictHandling.RAISE_ALL and load_state_dict(strict=True)), and with --transformer-impl
  transformer_engine under Megatron-LM's default strictness (unexpected keys allowed);
- one step to Hugging Face (--loader megatron --saver hf): transformers' logits (qwen3, mixtral);
- pretrain_gpt.py --load <Megatron folder> --use-checkpoint-args trains on: iteration, consumed
  samples and schedule position continued, weights one Adam step away from the checkpoint's;
- the refusals: one sentence each, nothing written.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

import megatron_lm_maker as mk
from megatron_sp.testing import load_script

pytestmark = pytest.mark.timeout(400)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
convert = load_script("tools/checkpoint/convert.py")
ATOL = 1e-5
FORMATS = ("torch_dist", "torch")
# name: (spec, the layout it is made at, the layout the round trip writes)
MODELS = {"gqa": (mk.GQA, (2, 1), (1, 2)), "gpt": (mk.GPT, (1, 2), (2, 1)),
          "moe": (mk.MOE, (1, 1), (1, 2))}
TOKEN_SEED = 11


def _round_trips(out: str) -> None:
    """Rank 0, between the spawn's phases: Megatron -> ours -> Megatron through convert.py."""
    for name, (_, _, (tp, pp)) in MODELS.items():
        for fmt in FORMATS:
            ours = f"{out}/ours_{name}_{fmt}"
            convert.main(["--loader", "megatron", "--saver", "megatron_sp",
                          "--load-dir", f"{out}/{name}_{fmt}", "--save-dir", ours])
            convert.main(["--loader", "megatron_sp", "--saver", "megatron", "--ckpt-format", fmt,
                          "--target-tensor-parallel-size", str(tp),
                          "--target-pipeline-parallel-size", str(pp), "--transformer-impl", "local",
                          "--load-dir", ours, "--save-dir", f"{out}/rt_{name}_{fmt}"])
    convert.main(["--loader", "megatron", "--saver", "megatron", "--ckpt-format", "torch_dist",
                  "--target-pipeline-parallel-size", "2", "--load-dir", f"{out}/gqa_torch",
                  "--save-dir", f"{out}/rt_gqa_te"])


def _our_layouts(rank, out, refs) -> dict:
    """The training loader (megatron_lm.load_for_training) into our tp 2 (GPT, saved pp 2, torch)
    and Ulysses sp 2 (GQA, saved tp 2, torch_dist) layouts: the gathered logits' largest
    difference from megatron-core's."""
    import torch.distributed as dist
    from megatron_sp.checkpointing.megatron_lm import load_for_training
    from megatron_sp.checkpointing.megatron_lm.read import read_fields
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig, GPTModel
    diffs = {}
    for name, fmt, sizes, dim in (("gpt", "torch", dict(tp=2), -1),
                                  ("gqa", "torch_dist", dict(sp=2), 1)):
        mesh = ParallelMesh.from_sizes(**sizes)
        config = GPTConfig(**read_fields(f"{out}/{name}_{fmt}"))
        model = GPTModel(config, mesh).eval()
        load_for_training(f"{out}/{name}_{fmt}", [model], mesh, config=config)
        with torch.no_grad():
            local = model(mk.tokens(TOKEN_SEED, MODELS[name][0]["vocab_size"])).contiguous()
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local)
        diffs[(name, fmt, str(sizes))] = (torch.cat(parts, dim=dim) - refs[name]).abs().max().item()
    return diffs


def _make_and_check(rank, world, out):
    """The spawn: make the checkpoints, round-trip them (rank 0), load the round trips strictly
    in megatron-core, and load the originals into our layouts."""
    import torch.distributed as dist
    logits, loaded = {}, {}
    for name, (spec, (tp, pp), _) in MODELS.items():
        mk.init_parallel(tp, pp, seed=1234, ep=spec.get("expert_model_parallel_size", 1))
        model = mk.build(spec, tp, pp)
        logits[name] = mk.forward(model, mk.tokens(TOKEN_SEED, spec["vocab_size"]))
        for fmt in FORMATS:
            args = mk.megatron_args(spec, tp, pp, iteration=3, consumed=24, gbs=8)
            mk.save(model, f"{out}/{name}_{fmt}", fmt, args)
    if rank == 0:     # in a process of its own: our checkpoint writer's collectives would
        import subprocess   # wait for rank 1 here
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                        f"import test_megatron_lm_checkpoints as t; t._round_trips({out!r})"],
                       check=True, cwd=ROOT)
    dist.barrier()
    for name, (spec, _, (tp, pp)) in MODELS.items():
        mk.init_parallel(tp, pp, seed=99)                       # other weights until loaded
        spec = dict(spec, expert_model_parallel_size=1)         # written for ep 1
        runs = [(fmt, f"{out}/rt_{name}_{fmt}", "raise_all") for fmt in FORMATS]
        runs += [("torch_dist", f"{out}/rt_gqa_te", "te")] if name == "gqa" else []
        for fmt, root, kind in runs:
            model = mk.build(spec, tp, pp)
            ids = mk.tokens(TOKEN_SEED, spec["vocab_size"])
            before = mk.forward(model, ids)                      # its own random weights
            folder = os.path.join(root, open(f"{root}/latest_checkpointed_iteration.txt").read())
            folder = folder if os.path.isdir(folder) else os.path.join(root, "iter_0000003")
            common = mk.load_strict(model, folder, fmt, te_extra_state=kind == "te")
            loaded[(name, fmt, kind)] = (mk.forward(model, ids), common["iteration"], before)
    everywhere = [None, None]
    dist.all_gather_object(everywhere, {k: v for k, v in logits.items() if v is not None})
    refs = {k: v for part in everywhere for k, v in part.items()}
    return {"logits": logits, "loaded": loaded, "ours": _our_layouts(rank, out, refs)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megatron_lm"))
    results = mk.spawn(_make_and_check, 2, out, out)
    refs = {}
    for r in results:
        refs.update({k: v for k, v in r["logits"].items() if v is not None})
    return {"out": out, "refs": refs, "results": results}


def _our_logits(path: str, vocab: int):
    from megatron_sp.cli.megatron_checkpoints import read_model
    model, ckpt = read_model(path)
    with torch.no_grad():
        return model(mk.tokens(TOKEN_SEED, vocab)), ckpt


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_read_equals_megatron_core_logits(made, name, fmt):
    spec = MODELS[name][0]
    for path in (f"{made['out']}/{name}_{fmt}", f"{made['out']}/{name}_{fmt}/iter_0000003"):
        ours, ckpt = _our_logits(path, spec["vocab_size"])
        diff = (ours - made["refs"][name]).abs().max().item()
        print(f"{name} {fmt} read: max |logit diff| {diff:.2e}")
        assert diff <= ATOL, diff
        assert made["refs"][name].abs().max() > 1.0            # logits that mean something
        assert (ckpt.iteration, ckpt.consumed_train_samples, ckpt.ckpt_format) == (3, 24, fmt)


def test_loaded_into_our_tp2_and_sp2_layouts(made):
    for rank, r in enumerate(made["results"]):
        for case, diff in r["ours"].items():
            print(f"rank {rank} {case}: max |logit diff| {diff:.2e}")
            assert diff <= ATOL, (case, diff)
    assert len(made["results"][0]["ours"]) == 2


def test_round_trip_loads_strictly_in_megatron_core(made):
    seen = set()
    for r in made["results"]:
        for (name, fmt, kind), (logits, iteration, before) in r["loaded"].items():
            # through ours a converted (release) checkpoint, iteration 0; Megatron -> Megatron
            # keeps the source's iteration
            assert iteration == (3 if kind == "te" else 0), (name, fmt, kind, iteration)
            if logits is None:                                   # not a last-stage rank
                continue
            diff = (logits - made["refs"][name]).abs().max().item()
            print(f"{name} {fmt} ({kind}) round trip: max |logit diff| {diff:.2e}")
            assert (before - made["refs"][name]).abs().max() > 0.1   # the load changed them
            assert diff <= ATOL, (name, fmt, kind, diff)
            seen.add((name, fmt, kind))
    assert len(seen) == 7, seen


@pytest.mark.parametrize("name, family", [("gqa", "qwen3"), ("moe", "mixtral")])
def test_one_step_to_hugging_face(made, tmp_path, name, family):
    import json
    from transformers import AutoModelForCausalLM
    hf = str(tmp_path / "hf")
    convert.main(["--loader", "megatron", "--saver", "hf", "--load-dir",
                  f"{made['out']}/{name}_torch_dist", "--save-dir", hf])
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(mk.tokens(TOKEN_SEED, MODELS[name][0]["vocab_size"])).logits
    diff = (logits - made["refs"][name]).abs().max().item()
    print(f"{name} torch_dist -> HF {family}: max |logit diff| {diff:.2e}")
    assert diff <= ATOL, diff


def test_pretrain_resumes_a_megatron_folder(made, tmp_path, capsys):
    """--load of the torch-format GQA folder (saved at tp 2) with its arguments: iteration 3 and
    24 consumed samples go on to iteration 4 and 32; the schedule continues from step 3 of
    warm-up 2 / decay 20; the weights are one Adam step (lr <= 3e-3) from the checkpoint's."""
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    from library_helpers import read_full_tensors
    from megatron_sp.checkpointing import read_meta
    from megatron_sp.checkpointing.megatron_lm import read_checkpoint
    source = f"{made['out']}/gqa_torch"
    run = str(tmp_path / "run")
    pretrain_gpt.main(["--mock-data", "--vocab-size", "90", "--use-checkpoint-args", "--load",
                       source, "--save", run, "--seq-length", str(mk.SEQ), "--micro-batch-size",
                       "4", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
                       "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
                       "--lr-decay-iters", "20", "--eval-iters", "0", "--log-interval", "1",
                       "--attention-backend", "sdpa"])
    said = capsys.readouterr().out
    assert "at iteration 3, 24 samples consumed" in said
    assert "optimizer starts fresh" in said
    meta = read_meta(os.path.join(run, "iter_0000004"))
    assert meta["train_state"]["iteration"] == 4
    assert meta["train_state"]["consumed_train_samples"] == 32
    assert meta["scheduler"]["num_steps"] == 4
    assert (meta["scheduler"]["warmup_iters"], meta["scheduler"]["decay_iters"]) == (2, 20)
    before = read_checkpoint(source).tensors
    after = read_full_tensors(run)
    assert set(before) == set(after)
    moved = max((after[k].reshape(before[k].shape) - before[k]).abs().max().item()
                for k in before)       # stored shapes ([c, n/c, ...] for fused ones) reshaped
    assert 0 < moved <= 3.1e-3, moved


# Refusals ----------------------------------------------------------------------------------------

def _refused(argv, save_dir) -> str:
    with pytest.raises(SystemExit) as info:
        convert.main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and message.endswith(".") and "\n" not in message, message
    assert not os.path.exists(save_dir) or not [n for n in os.listdir(save_dir)
                                                if not n.startswith(".")], os.listdir(save_dir)
    return message


def _to_ours(load_dir, save_dir):
    return ["--loader", "megatron", "--saver", "megatron_sp", "--load-dir", load_dir,
            "--save-dir", save_dir]


def _copy(made, name, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(f"{made['out']}/{name}", dst)
    return dst


def test_refusals_of_what_is_no_whole_checkpoint(made, tmp_path):
    out = str(tmp_path / "out")
    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    assert "is not a Megatron-LM checkpoint" in _refused(_to_ours(empty, out), out)
    assert "--loader megatron_sp" in _refused(_to_ours(f"{made['out']}/ours_gqa_torch", out), out)
    torch_copy = _copy(made, "gqa_torch", tmp_path)
    shard = os.path.join(torch_copy, "iter_0000003", "mp_rank_01", "model_optim_rng.pt")
    os.remove(shard)
    assert f"is missing {shard}" in _refused(_to_ours(torch_copy, out), out)
    dist_copy = _copy(made, "gpt_torch_dist", tmp_path)
    distcp = os.path.join(dist_copy, "iter_0000003", "__1_0.distcp")
    os.remove(distcp)
    assert distcp in _refused(_to_ours(dist_copy, out), out)
    half = _copy(made, "gqa_torch_dist", tmp_path)
    os.remove(os.path.join(half, "iter_0000003", ".metadata"))
    assert "has no .metadata" in _refused(_to_ours(half, out), out)
    os.remove(os.path.join(half, "latest_checkpointed_iteration.txt"))
    assert "no latest_checkpointed_iteration.txt" in _refused(_to_ours(half, out), out)
    os.rename(os.path.join(half, "iter_0000003"), os.path.join(half, "iter_0000003.tmp"))
    assert "did not finish" in _refused(_to_ours(os.path.join(half, "iter_0000003.tmp"), out), out)


def test_a_pickle_asking_for_code_is_refused_unrun(made, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/ran",))
    folder = _copy(made, "gqa_torch_dist", tmp_path)
    torch.save({"args": Payload()}, os.path.join(folder, "iter_0000003", "common.pt"))
    out = str(tmp_path / "out")
    message = _refused(_to_ours(folder, out), out)
    assert "system" in message and "weights_only=True" in message, message
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("arg, value, named", [
    ("multi_latent_attention", True, "multi-latent attention"),
    ("mtp_num_layers", 1, "multi-token prediction"),
    ("hybrid_override_pattern", "M*M*", "hybrid Mamba"),
])
def test_features_we_cannot_represent_are_named(made, tmp_path, arg, value, named):
    folder = _copy(made, "gqa_torch_dist", tmp_path)
    path = os.path.join(folder, "iter_0000003", "common.pt")
    common = torch.load(path, weights_only=False)
    setattr(common["args"], arg, value)
    torch.save(common, path)
    out = str(tmp_path / "out")
    assert named in _refused(_to_ours(folder, out), out)


def test_an_unknown_tensor_is_named(made, tmp_path):
    folder = _copy(made, "gpt_torch", tmp_path)
    path = os.path.join(folder, "iter_0000003", "mp_rank_00_001", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.1.self_attention.linear_gate.weight"] = torch.zeros(2, 2)
    torch.save(state, path)
    out = str(tmp_path / "out")
    assert "self_attention.linear_gate.weight" in _refused(_to_ours(folder, out), out)


def test_a_layout_megatron_cannot_build_is_refused(made, tmp_path):
    out = str(tmp_path / "out")
    message = _refused(["--loader", "megatron", "--saver", "megatron", "--load-dir",
                        f"{made['out']}/gqa_torch", "--save-dir", out,
                        "--target-tensor-parallel-size", "4"], out)
    assert "does not divide num_query_groups=2" in message


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "inverse-square-root"])
def test_schedule_position_equals_megatron_cores(style):
    """The stored scheduler (samples) read as ours (iterations): the learning rate at every later
    iteration equals megatron-core's OptimizerParamScheduler at iteration x global batch."""
    from types import SimpleNamespace
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_sp.checkpointing.megatron_lm.resume import our_scheduler
    from megatron_sp.training.optimizer import LRScheduler
    gbs, warmup, decay, at = 8, 3, 17, 5
    group = {"lr": 0.0, "max_lr": 3e-3, "min_lr": 3e-4, "wd_mult": 1.0, "lr_mult": 1.0,
             "weight_decay": 0.0}
    theirs = OptimizerParamScheduler(SimpleNamespace(param_groups=[group]), 0.0, 3e-3, 3e-4,
                                     warmup * gbs, decay * gbs, style, 0.0, 0.0, decay * gbs,
                                     "constant")
    theirs.step(at * gbs)
    ckpt = SimpleNamespace(scheduler=theirs.state_dict(), stored={"global_batch_size": gbs})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    ours = LRScheduler(opt, 1.0, 0.0, 0, 0, "constant")
    ours.load_state_dict(our_scheduler(ckpt))
    for _ in range(decay + 3 - at):
        assert abs(ours.lr - theirs.get_lr(group)) <= 1e-12, (ours.num_steps, ours.lr)
        ours.step()
        theirs.step(gbs)
