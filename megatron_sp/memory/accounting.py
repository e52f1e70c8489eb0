"""Saved-tensor accounting: bytes that autograd keeps for backward, per rank and per layer.

    acct = SavedTensorAccountant().attach(model)     # labels: embedding, layer <i>, output, other
    with acct.recording():
        loss = model(...); loss.backward()
    acct.report()   # {"device_bytes", "host_bytes", "by_label": {...}, "passes": n}

A `torch.autograd.graph.saved_tensors_hooks` pair sees every tensor saved for backward outside a
checkpointed region (inside one, the checkpoint's own hooks drop them: they are recomputed, and the
checkpoint's saved inputs *are* seen). Storages are deduplicated (a view or a tensor saved by two ops
counts once, at its storage's size: that is what stays alive); parameters are not activations and are
skipped, and weight copies (aten::linear's w^T on CPU, autocast's bf16 casts: tensors whose every
autograd path ends at a parameter) are counted apart as `weight_copy_bytes` (they do not grow with the
sequence; `device_bytes` are the activations). Each forward of an attached model starts a new pass (one micro-batch: its graph is freed by its
backward before the next forward); the report is the largest pass. Tensors moved to host by
megatron_sp.memory.offload are counted as host bytes instead.

`peak_device_memory()` is torch.cuda.max_memory_allocated on GPU (None on CPU).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

_ACTIVE: list["SavedTensorAccountant"] = []
_LABELS: list[str] = ["other"]


@contextlib.contextmanager
def scope(label: str):
    """Attribute tensors saved in the body to `label` (cheap no-op cost when nothing records)."""
    _LABELS.append(label)
    try:
        yield
    finally:
        _LABELS.pop()


def _pop_label() -> None:
    _LABELS.pop()        # a forward hook must return None (a value would replace the output)


def _storage_key(t: torch.Tensor):
    try:
        st = t.untyped_storage()
        return (t.device.type, t.device.index, st.data_ptr()), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return (t.device.type, t.device.index, id(t)), t.numel() * t.element_size()


def is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


_COPY_NODES = {"TBackward0", "ToCopyBackward0", "TransposeBackward0", "PermuteBackward0",
               "ViewBackward0", "CloneBackward0", "ExpandBackward0"}


def derived_from_parameters(t: torch.Tensor, depth: int = 4) -> bool:
    """True for a weight copy (w.t() kept by aten::linear on CPU, the bf16 cast under autocast): t comes
    from parameters through a few transpose/cast/view ops only."""
    fn = t.grad_fn
    if fn is None:
        return False

    def walk(node, left):
        if node is None:
            return True                       # an input that needs no grad
        if type(node).__name__ == "AccumulateGrad":
            return is_parameter(node.variable)
        if left == 0 or type(node).__name__ not in _COPY_NODES:
            return False                      # e.g. an embedding lookup is an activation
        return all(walk(n, left - 1) for n, _ in node.next_functions)
    return walk(fn, depth)


def record_weight_copy(t: torch.Tensor) -> None:
    for acct in _ACTIVE:
        acct._add(t, weight_copy=True)


def record_host(t: torch.Tensor, device_tensor: torch.Tensor, block=None) -> None:
    """Called by the offload hooks: `device_tensor` now lives on the host as `t`; block: (key,
    bytes) when t is a block of a host pool's slab (HostPool.block: its own bytes, not the slab's)."""
    for acct in _ACTIVE:
        acct._add(t, host=True, block=block)


class _Pass:
    def __init__(self):
        self.seen = set()
        self.device_bytes = 0
        self.host_bytes = 0
        self.weight_copy_bytes = 0
        self.by_label: dict[str, int] = {}
        self.host_by_label: dict[str, int] = {}


class SavedTensorAccountant:
    def __init__(self):
        self.passes: list[_Pass] = []
        self._handles = []
        self._recording = False
        self._param_storages = set()

    # Model hooks: passes and labels --------------------------------------------------------------
    def attach(self, models) -> "SavedTensorAccountant":
        models = models if isinstance(models, (list, tuple)) else [models]
        for model in models:
            self._handles.append(model.register_forward_pre_hook(lambda m, a: self.new_pass()))
            if getattr(model, "embedding", None) is not None:
                self._label_module(model.embedding, "embedding")
            for name, layer in getattr(model, "layers", {}).items():
                self._label_module(layer, f"layer {name}")
            if getattr(model, "final_norm", None) is not None:   # everything after it: "output"
                self._handles.append(model.final_norm.register_forward_pre_hook(
                    lambda m, a: _LABELS.__setitem__(0, "output")))
                self._handles.append(model.register_forward_hook(
                    lambda m, a, o: _LABELS.__setitem__(0, "other")))
        return self

    def _label_module(self, module, label):
        self._handles.append(module.register_forward_pre_hook(lambda m, a: _LABELS.append(label)))
        self._handles.append(module.register_forward_hook(lambda m, a, o: _pop_label()))

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_pass(self):
        # A checkpoint's recompute may stop early (before a layer's forward hook pops its label):
        # every forward starts from a clean label stack.
        _LABELS[:] = ["other"]
        if self._recording:
            self.passes.append(_Pass())

    # Recording -----------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor, host: bool = False, weight_copy: bool = False, block=None):
        if not self.passes:
            self.passes.append(_Pass())
        p = self.passes[-1]
        key, nbytes = block or _storage_key(t)
        if key in p.seen:
            return
        p.seen.add(key)
        label = _LABELS[-1]
        if weight_copy:
            p.weight_copy_bytes += nbytes
        elif host:
            p.host_bytes += nbytes
            p.host_by_label[label] = p.host_by_label.get(label, 0) + nbytes
        else:
            p.device_bytes += nbytes
            p.by_label[label] = p.by_label.get(label, 0) + nbytes

    def _pack(self, t):
        if is_parameter(t) or _storage_key(t)[0] in self._param_storages:
            return t
        if derived_from_parameters(t):
            self._add(t, weight_copy=True)
        else:
            self._add(t)
        return t

    @contextlib.contextmanager
    def recording(self):
        """Record every tensor saved for backward in the body (passes start at model forwards)."""
        self.passes = []
        self._recording = True
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE.remove(self)
            self._recording = False

    def report(self) -> dict:
        """The largest pass: device bytes, host bytes (offloaded), per-label device bytes."""
        if not self.passes:
            return {"device_bytes": 0, "host_bytes": 0, "weight_copy_bytes": 0, "by_label": {},
                    "host_by_label": {},
                    "passes": 0}
        p = max(self.passes, key=lambda q: q.device_bytes + q.host_bytes)
        return {"device_bytes": p.device_bytes, "host_bytes": p.host_bytes,
                "weight_copy_bytes": p.weight_copy_bytes,
                "by_label": dict(p.by_label), "host_by_label": dict(p.host_by_label),
                "passes": len(self.passes)}


def layer_bytes(report: dict) -> dict[str, int]:
    return {k: v for k, v in report["by_label"].items() if k.startswith("layer ")}


def peak_device_memory(device=None) -> int | None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.max_memory_allocated(device)
    return None


def format_report(report: dict, peak: int | None = None) -> str:
    mb = 2 ** 20
    layers = layer_bytes(report)
    per_layer = max(layers.values()) / mb if layers else 0.0
    parts = [f"saved for backward (MB/rank): {report['device_bytes'] / mb:.2f}",
             f"per layer: {per_layer:.2f}",
             f"output: {report['by_label'].get('output', 0) / mb:.2f}"]
    if report.get("weight_copy_bytes"):
        parts.append(f"weight copies: {report['weight_copy_bytes'] / mb:.2f}")
    if report["host_bytes"]:
        parts.append(f"offloaded to host: {report['host_bytes'] / mb:.2f}")
    if peak is not None:
        parts.append(f"peak device memory (GB): {peak / 2**30:.2f}")
    return " | ".join(parts)


def measure_saved_bytes(model, input_ids, labels, reduce: str = "sum") -> tuple[torch.Tensor, dict]:
    """One forward + backward of `model` (per-token loss, summed or averaged) under a fresh
    accountant; returns (the loss, the accountant's report). Used by the tests and benches."""
    acct = SavedTensorAccountant().attach(model)
    with acct.recording():
        per_token = model(input_ids=input_ids, labels=labels)
        loss = per_token.sum() if reduce == "sum" else per_token.mean()
        loss.backward()
    acct.detach()
    return loss.detach(), acct.report()


class LiveTensorPeak:
    """The peak of live tensor bytes created inside the context, on any device (CPU included,
    where torch has no allocator statistics): a TorchDispatchMode adds every op output's new
    storage once (a view or an in-place result shares its input's and is not counted) and drops it
    when the storage is freed (checked after every op), so `peak` is the most bytes alive at once
    beyond what existed before, and `largest` the largest single new tensor's elements. Kernels' internal scratch (the fused kernels' tiles) is not seen. For tests and
    benchmarks (every op pays a sweep over the live storages).

        with LiveTensorPeak() as tracker:
            loss = f(x); loss.backward()
        tracker.peak, tracker.largest
    """

    def __init__(self):
        self.peak = self.live = self.largest = 0
        self._storages = {}
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.multiprocessing.reductions import StorageWeakRef
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._sweep()
                inputs = {t.untyped_storage().data_ptr()
                          for t in torch.utils._pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type != "meta"}
                for t in torch.utils._pytree.tree_leaves(out):
                    if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                            and t.untyped_storage().data_ptr() not in inputs):   # views, in-place
                        tracker._add(t, StorageWeakRef)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def _add(self, t: torch.Tensor, weak_ref) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._storages or storage.nbytes() == 0:
            return
        self._storages[key] = (weak_ref(storage), storage.nbytes())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        self.largest = max(self.largest, t.numel())

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._storages.items() if ref.expired()]:
            self.live -= self._storages.pop(key)[1]

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False
