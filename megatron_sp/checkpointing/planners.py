"""DCP planners that read and write `Shard` rectangles, and DCP's errors turned into ours."""
from __future__ import annotations

import contextlib
import warnings

import torch

from megatron_sp.checkpointing.format import CheckpointError, Shard
from megatron_sp.checkpointing.integrity import verify_files


# DCP planners ---------------------------------------------------------------------------------------

def shard_planners():
    """Save/load planners that understand `Shard` (imported lazily: DCP is a heavy import)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       MetadataIndex, TensorProperties)
    from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                      WriteItem, WriteItemType)
    from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                              _create_write_items,
                                                              create_read_items_for_chunk_list)

    class ShardSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self):
            items = []
            for fqn, obj in self.state_dict.items():
                if isinstance(obj, Shard):
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, obj.offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=obj.offsets, sizes=obj.local.shape),
                            properties=TensorProperties.create_from_tensor(obj.local),
                            size=obj.global_shape)))
                else:
                    items.extend(_create_write_items(fqn, obj))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            if isinstance(obj, Shard):
                return obj.local.contiguous()
            return super().lookup_object(index)

    class ShardLoadPlanner(DefaultLoadPlanner):
        def __init__(self, where: str, verify: tuple[dict, str] | None = None):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.where, self.verify = where, verify   # verify: (recorded checksums, advice)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # Not DefaultLoadPlanner's: its meta-tensor pass turns unknown leaves (Shard) into None.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def create_local_plan(self):
            requests = []
            stored = self.metadata.state_dict_metadata
            for fqn, obj in self.state_dict.items():
                if fqn not in stored:
                    raise CheckpointError(
                        f"checkpoint {self.where} has no tensor {fqn.split('/', 1)[-1]!r} "
                        f"({fqn.split('/')[0]} state): it is incomplete or of a different model.")
                md = stored[fqn]
                if isinstance(obj, Shard):
                    if isinstance(md, BytesStorageMetadata):
                        raise CheckpointError(f"checkpoint {self.where} stores {fqn!r} as bytes, "
                                              f"not as a tensor.")
                    if tuple(md.size) != tuple(obj.global_shape):
                        raise CheckpointError(
                            f"tensor {fqn.split('/', 1)[-1]!r} has shape {tuple(md.size)} in "
                            f"checkpoint {self.where} but shape {tuple(obj.global_shape)} in the "
                            f"model being loaded.")
                    chunk = ChunkStorageMetadata(offsets=obj.offsets, sizes=obj.local.shape)
                    requests += create_read_items_for_chunk_list(fqn, md, [chunk])
                else:
                    requests += _create_read_items(fqn, md, obj)
            if self.verify is not None:   # the bytes this rank's plan reads, before any is read
                ranges = {}
                for r in requests:
                    info = self.metadata.storage_data[r.storage_index]
                    ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
                verify_files(self.where, ranges, *self.verify)
            return LoadPlan(requests)

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.local if isinstance(obj, Shard) else super().lookup_tensor(index)

        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return ShardSavePlanner, ShardLoadPlanner


@contextlib.contextmanager
def dcp_errors(where: str | None = None, advice: str | None = None):
    """Quiet DCP's one-process warning; re-raise our own error out of DCP's per-rank wrapper.

    With `advice` (loading), any other failure of any rank (a file DCP could not open or decode:
    checkpoints saved without checksums, or --no-verify-checkpoint) becomes one CheckpointError
    naming the folder `where`, the first failure and what to do. Every rank sees the same failures
    (DCP gathers them), so every rank raises the same sentence.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as err:
            failures = [f[0] if isinstance(f, tuple) else f
                        for _, f in sorted(getattr(err, "failures", {}).items())]
            for exc in failures:
                if isinstance(exc, CheckpointError):
                    raise CheckpointError(str(exc)) from None
            if advice is not None and failures:
                first = failures[0]
                text = (str(first).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
                text = text if len(text) <= 160 else text[:157] + "..."   # DCP's first sentence
                raise CheckpointError(f"checkpoint {where} could not be read ({type(first).__name__}"
                                      f"{': ' + text if text else ''}): {advice}") from None
            raise
