"""Load an HF checkpoint (safetensors or `.bin`, `cluster.config.checkpoints`) into a (sharded)
model.

Every checkpoint tensor is handed to its parameter's `weight_loader` as a
`LazyTensor`, so each rank reads only the slice it keeps. The model declares
its name mapping (`packed_modules_mapping`, `ignored_checkpoint_tensors`,
`embedding_checkpoint_name`); this file knows no architecture's names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import torch
from torch import nn
from tqdm import tqdm

from cluster.config import ModelConfig
from cluster.config.checkpoints import checkpoint_tensor_shapes, iterate_tensors
from cluster.kernels.fp8_linear import fp8_compute_supported
from cluster.models.draft_base import DraftModel
from cluster.models.fp8 import (
    SCALE_SUFFIX,
    block_size_of,
    make_fp8_layers,
    scales_by_weight,
    split_fp8,
)
from cluster.models.registry import model_class_for
from cluster.parallel import ParallelState
from cluster.parallel.weights import LazyTensor, default_weight_loader

# Checkpoint reads in flight at once on a rank.
LOAD_THREADS = 8


def iterate_checkpoint(path: str, stack: ExitStack) -> Iterator[LazyTensor]:
    """Every tensor of the checkpoint as a LazyTensor (files stay open while `stack` is)."""
    for name, shape, read in iterate_tensors(path, stack):
        yield LazyTensor(name, shape, read)


def load_weights(
    model: nn.Module,
    path: str,
    show_progress: bool = True,
    rename: Callable[[str], str | None] | None = None,
    fp8_compute: bool | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint at `path`, strictly: a tensor
    the model has no parameter for is an error naming it, unless the model lists it in
    `ignored_checkpoint_tensors`; so is a parameter the checkpoint leaves unfilled.

    `rename` (default: the model's `map_checkpoint_name`, if any) maps checkpoint names
    to parameter names; None skips a tensor on purpose (a draft's foreign tensors,
    another pipeline stage's layers). A model's `checkpoint_shard(name)` may place a
    tensor in part of a stacked parameter (MoE experts).

    FP8 checkpoints (`cluster.models.fp8`): with `fp8_compute` (default: whether the
    model's device computes in FP8) the linear layers keep their weights as FP8 with block
    scales; otherwise the weights are read dequantised."""
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    ignored: tuple[str, ...] = getattr(model, "ignored_checkpoint_tensors", ())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    rename = rename or getattr(model, "map_checkpoint_name", None)
    shard_of = getattr(model, "checkpoint_shard", None)
    loaded: dict[str, set[object]] = {}  # parameter -> shard ids filled (None: whole)

    def place(name: str) -> tuple[str, object] | None:
        """Checkpoint name -> (parameter name, shard id); None: skipped on purpose."""
        if tied and name == "lm_head.weight":
            return None
        mapped = rename(name) if rename is not None else name
        if mapped is None or any(piece in mapped for piece in ignored):
            return None
        return _parameter_of(mapped, packed, shard_of)

    def resolve(name: str) -> str | None:
        placed = place(name)
        return None if placed is None else placed[0]

    with ExitStack() as stack:
        tensors = list(iterate_checkpoint(path, stack))
        block = block_size_of(getattr(model, "config", None))
        scales: dict[str, LazyTensor] = {}  # weight kept FP8 -> its block scales
        if block is not None:
            tensors, scales = _split_fp8(model, tensors, block, fp8_compute, resolve)
        params = dict(model.named_parameters())  # (after FP8 layers replaced theirs)
        jobs: list[tuple[nn.Parameter, LazyTensor, object]] = []
        for tensor in tensors:
            placed = place(tensor.name)
            if placed is None:
                continue
            param_name, shard_id = placed
            if param_name not in params:
                raise ValueError(
                    f"checkpoint {path!r} holds {tensor.name!r} (shape {tensor.full_shape}), "
                    f"which {type(model).__name__} has no parameter for"
                )
            jobs.append((params[param_name], tensor, shard_id))
            loaded.setdefault(param_name, set()).add(shard_id)
            if tensor.name in scales:  # an FP8 weight's block scales, sharded alike
                scale_name = param_name + SCALE_SUFFIX
                jobs.append((params[scale_name], scales[tensor.name], shard_id))
                loaded.setdefault(scale_name, set()).add(shard_id)
        # Each job reads its own slice and writes its own part of a parameter: threads keep
        # several reads in flight (the files are memory-mapped; page faults wait on disk).
        inference = torch.is_inference_mode_enabled()  # thread-local: the threads take ours

        def run(job: tuple[nn.Parameter, LazyTensor, object]) -> None:
            with torch.inference_mode(inference):
                _load(*job)

        with ThreadPoolExecutor(LOAD_THREADS) as pool:
            done = pool.map(run, jobs)
            for _ in tqdm(done, total=len(jobs), desc="Loading weights", disable=not show_progress):
                pass
    missing = [
        name
        for name, param in params.items()
        if _expected_shards(name, param, packed) - loaded.get(name, set())
    ]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensors for: {missing[:20]}")


def _load(param: nn.Parameter, tensor: LazyTensor, shard_id: object) -> None:
    if shard_id is None:
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def _split_fp8(
    model: nn.Module,
    tensors: list[LazyTensor],
    block: tuple[int, int],
    fp8_compute: bool | None,
    resolve: Callable[[str], str | None],
) -> tuple[list[LazyTensor], dict[str, LazyTensor]]:
    """`split_fp8` of the checkpoint: its linear layers switched to FP8 weights where the
    model computes in FP8, every other scaled weight dequantised; logs which path."""
    device = next(model.parameters(), torch.empty(0)).device
    compute = fp8_compute_supported(device, block) if fp8_compute is None else fp8_compute
    scaled = scales_by_weight(tensors)
    kept = make_fp8_layers(model, scaled, resolve, block) if compute else set()
    log = logging.getLogger(__name__)
    if compute:
        log.info(
            "FP8 checkpoint (%dx%d blocks): %d linear weights kept in FP8 with block scales "
            "(FP8 compute on %s); %d others (MoE experts, matrices read directly) "
            "dequantised",
            *block,
            len(kept),
            device,
            len(scaled) - len(kept),
        )
    else:
        log.info(
            "FP8 checkpoint (%dx%d blocks): weights dequantised to the model dtype "
            "(no FP8 compute on %s)",
            *block,
            device,
        )
    return split_fp8(tensors, block, kept)


def _parameter_of(
    name: str,
    packed: dict[str, tuple[str, object]],
    shard_of: Callable[[str], tuple[str, object] | None] | None,
) -> tuple[str, object]:
    """(parameter name, shard id or None) for a checkpoint tensor's (renamed) name."""
    placed = shard_of(name) if shard_of is not None else None
    if placed is not None:
        return placed
    for ckpt_piece, (param_piece, packed_shard) in packed.items():
        if f".{ckpt_piece}." in name:
            return name.replace(f".{ckpt_piece}.", f".{param_piece}."), packed_shard
    return name, None


def _expected_shards(
    param_name: str, param: nn.Parameter, packed: dict[str, tuple[str, object]]
) -> set[object]:
    declared = getattr(param, "checkpoint_shards", None)
    if declared is not None:
        return set(declared)
    shards = {shard for piece, shard in packed.values() if f".{piece}." in param_name}
    return shards or {None}


def load_model(
    model_config: ModelConfig,
    state: ParallelState,
    show_progress: bool | None = None,
    fp8_compute: bool | None = None,
) -> nn.Module:
    """Build the target for `model_config` with this rank's shards loaded, in eval mode.
    `fp8_compute`: see `load_weights` (None: FP8 compute where the device has it)."""
    hf_config = model_config.hf_config
    cls = model_class_for(hf_config)
    with torch.device(state.device):
        model = cls(hf_config, state, model_config.torch_dtype)
    show = (state.rank == 0) if show_progress is None else show_progress
    load_weights(model, model_config.path, show_progress=show, fp8_compute=fp8_compute)
    return model.eval()


def load_draft_head(
    cls: type[DraftModel],
    path: str,
    model_config: ModelConfig,
    target: nn.Module,
    state: ParallelState,
) -> DraftModel:
    """Build a draft head of class `cls` for `target` and load it from `path`, sharing
    the target's embedding and LM head as the head requires."""
    from transformers import AutoConfig

    names = set(checkpoint_tensor_shapes(path))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device(state.device):
        draft = cls(config, model_config.hf_config, state, model_config.torch_dtype, names)
    load_weights(draft, path, show_progress=False)
    if draft.embed_tokens is None and target.model.embed_tokens is None:
        _load_embedding_on_last_stage(target, model_config.path)
    draft.share_with_target(target)
    return draft.eval()


def _load_embedding_on_last_stage(target: nn.Module, path: str) -> None:
    """A draft that shares the target's embedding runs on the last pipeline stage, which
    does not otherwise hold it: create it there (and read it unless tied to the LM head)."""
    embed = target.embedding_for_draft()
    if target.lm_head is not None and embed.weight is target.lm_head.weight:
        return
    load_weights(
        embed,
        path,
        show_progress=False,
        rename=lambda name: "weight" if name == target.embedding_checkpoint_name else None,
    )
