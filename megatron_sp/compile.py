"""--torch-compile: every transformer layer compiled on its own, as torchtitan compiles its blocks.

torchtitan applies, per TransformerBlock and in this order, tensor parallelism, activation
checkpointing, `torch.compile`, then FSDP2. Here the parallel layers are built in (tp and the
Ulysses all-to-alls live inside TransformerLayer), recompute wraps the layer calls from outside
(megatron_sp/memory/recompute.py), pipeline stages are the chunks, and FSDP2 shards the compiled
layers afterwards (sharding/fsdp.py): so `compile_layers` runs on the built chunks, before the
sharding.

    layer.compile(backend, fullgraph)   nn.Module.compile: in place, so parameter names, FSDP2 units,
                                        checkpoint keys and the recompute segments stay as they are

One graph per layer: the layers share their code and their shapes, so with torch's default of
nn.Module parameters as graph inputs the first layer's graph serves the others (no recompile per
layer; the embedding, output layer and loss stay eager). fullgraph=True where a layer holds no
collective (no tp, Ulysses or ring inside it) and no attention dropout; with them the collectives'
autograd Functions and the byte counters (comm_stats.record), or the RNG tracker's fork around
attention dropout (torch.get_rng_state / set_rng_state), break the graph and run eagerly between
compiled regions, which gives the same results (tests/distributed/test_compile.py).

Backends: "inductor" (the default; Triton kernels on CUDA, C++ on CPU, slow to compile),
"aot_eager" (AOTAutograd's joint graph without code generation: the tests' fast path), "eager"
(Dynamo only). Dropout under inductor draws from inductor's own generator (other masks than eager,
the same distribution).

Refused (CompileLayoutError, one sentence): FP8, through Transformer Engine (its modules and
fp8_autocast are not traced here) or torchao (its casts in our linears are not compiled here). Composes (equal to eager): dp, tp (with --sequence-parallel),
Ulysses sp, pipeline stages, FSDP2, full and selective recompute (tests/distributed/
test_compile.py); compared by hand but not in the tests: the ring (cp 2) and, on one rank,
--offload-activations, --mlp-tiles and --loss-chunks.
"""
from __future__ import annotations

import torch

from megatron_sp import comm_stats

BACKENDS = ("inductor", "aot_eager", "eager")


class CompileLayoutError(ValueError):
    """--torch-compile with a feature it does not compose with (refused at start-up)."""


def check_compile(*, backend: str, fp8: bool = False) -> None:
    """The one-sentence refusals of --torch-compile (CompileLayoutError)."""
    if backend not in BACKENDS:
        raise CompileLayoutError(f"--torch-compile-backend {backend!r} is not one of "
                                 f"{', '.join(BACKENDS)}; pick one of them.")
    if fp8:
        raise CompileLayoutError("--torch-compile with --fp8-format: FP8 (Transformer Engine's "
                                 "modules, torchao's casts in our linears) is not compiled here; "
                                 "drop one of the two flags.")


def layer_holds_collectives(mesh) -> bool:
    """Whether a transformer layer communicates inside (tp all-reduce, Ulysses all-to-all, ring)."""
    return mesh.tp_size * mesh.sp_size * mesh.cp_size > 1


def _forks_rng(chunks) -> bool:
    """Whether attention dropout runs inside the layers on the RNG tracker's stream: its fork
    (torch.get_rng_state / set_rng_state) is not traced, so it breaks the graph."""
    return any(getattr(chunk, "rng_tracker", None) is not None and chunk.config.attention_dropout
               for chunk in chunks)


def compile_layers(chunks, mesh, *, backend="inductor", fullgraph: bool | None = None) -> int:
    """Compile every transformer layer of the model chunks in place; returns how many.

    backend: a name of BACKENDS or a torch.compile backend callable (tests count graphs with one).
    fullgraph: None = True unless the layers hold collectives (see the module docstring).
    """
    comm_stats.keep_out_of_graphs()
    if fullgraph is None:
        fullgraph = not (layer_holds_collectives(mesh) or _forks_rng(chunks))
    count = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(backend=backend, fullgraph=fullgraph)
            count += 1
    return count


def describe(backend, count: int, mesh, chunks=()) -> str:
    """The start-up line."""
    if layer_holds_collectives(mesh):
        mode = "graphs between the layers' collectives"
    elif _forks_rng(chunks):
        mode = "graphs around attention dropout's RNG fork"
    else:
        mode = "one graph per layer"
    name = backend if isinstance(backend, str) else type(backend).__name__
    return f"> torch.compile: {count} transformer layers, backend {name} ({mode})"


def first_step_note(backend) -> str:
    """The line before a process's first step: torch.compile traces and compiles the layers on
    their first call, so that step is long (inductor: Triton / C++ code generation)."""
    name = backend if isinstance(backend, str) else type(backend).__name__
    took = "about a minute" if name == "inductor" else "some seconds"
    return (f"> compiling the model on the first step (--torch-compile, backend {name}: {took}; "
            f"the steps after it run the compiled layers) ...")


def reset() -> None:
    """Forget every compiled graph (tests that build several layouts in one process)."""
    torch._dynamo.reset()


def compile_from_config(chunks, mesh, job) -> str | None:
    """--torch-compile of a JobConfig: refuse what does not compose, compile the layers; returns
    the start-up line (None without the flag)."""
    t = job.training
    if not t.torch_compile:
        return None
    check_compile(backend=t.torch_compile_backend, fp8=job.precision.fp8_format is not None)
    count = compile_layers(chunks, mesh, backend=t.torch_compile_backend)
    return describe(t.torch_compile_backend, count, mesh, chunks)
