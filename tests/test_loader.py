"""Checkpoint loading: sharded files with an index, `.bin` files, and clear errors (a
missing, extra or mis-shaped tensor is named)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama

from cluster.config import ModelConfig
from cluster.config.checkpoints import checkpoint_files, checkpoint_tensor_shapes
from cluster.models.loader import load_model
from cluster.models.registry import model_class_for
from cluster.parallel import ParallelState


@pytest.fixture()
def tiny(tmp_path):
    path = str(tmp_path / "tiny")
    make_tiny_llama(path)
    return path


def _state_dict(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_multi_file_checkpoint_with_index(tiny, tmp_path):
    tensors = _state_dict(tiny)
    out = tmp_path / "sharded"
    out.mkdir()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_bytes((tmp_path / "tiny" / "config.json").read_bytes())
    assert len(checkpoint_files(str(out))) == 2
    a = load_model(ModelConfig(path=tiny), ParallelState.single(), show_progress=False)
    b = load_model(ModelConfig(path=str(out)), ParallelState.single(), show_progress=False)
    _same_weights(a, b)


def _same_weights(a, b):
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_bin_checkpoints_load_the_same(tiny, tmp_path, sharded):
    tensors = _state_dict(tiny)
    out = tmp_path / "bin"
    out.mkdir()
    (out / "config.json").write_bytes((tmp_path / "tiny" / "config.json").read_bytes())
    if sharded:
        names = sorted(tensors)
        weight_map = {}
        for i, part in enumerate((names[::2], names[1::2])):
            file = f"pytorch_model-0000{i + 1}-of-00002.bin"
            torch.save({n: tensors[n] for n in part}, out / file)
            weight_map.update(dict.fromkeys(part, file))
        (out / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(tensors, out / "pytorch_model.bin")
    assert checkpoint_tensor_shapes(str(out)) == {n: tuple(t.shape) for n, t in tensors.items()}
    a = load_model(ModelConfig(path=tiny), ParallelState.single(), show_progress=False)
    b = load_model(ModelConfig(path=str(out)), ParallelState.single(), show_progress=False)
    _same_weights(a, b)


def test_unexpected_tensor_is_named(tiny):
    tensors = _state_dict(tiny)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, os.path.join(tiny, "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"holds 'model.layers.0.mlp.extra_proj.weight' \(shape \(3, 3\)\), which "
        "LlamaForCausalLM has no parameter for",
    ):
        load_model(ModelConfig(path=tiny), ParallelState.single(), show_progress=False)


def test_missing_tensor_is_named(tiny):
    tensors = _state_dict(tiny)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, os.path.join(tiny, "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensors for: \['model.layers.1.self_attn.qkv_proj.weight'\]"
    ):
        load_model(ModelConfig(path=tiny), ParallelState.single(), show_progress=False)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny):
    tensors = _state_dict(tiny)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(tensors, os.path.join(tiny, "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mlp.down_proj.weight: checkpoint shape \(64, 95\) has 95 in "
        r"dim 1; the model expects 96",
    ):
        load_model(ModelConfig(path=tiny), ParallelState.single(), show_progress=False)


def test_missing_folder_and_files(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_files(str(tmp_path / "nope"))
    os.remove(os.path.join(tiny, "model.safetensors"))
    with pytest.raises(
        FileNotFoundError, match=r"no \*\.safetensors or pytorch_model\*\.bin files"
    ):
        load_model(ModelConfig(path=tiny), ParallelState.single())


def test_unknown_architecture_is_refused(tiny):
    config = ModelConfig(path=tiny).hf_config
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] are not supported"):
        model_class_for(config)
