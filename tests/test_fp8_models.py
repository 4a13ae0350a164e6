"""DeepSeek-V3 FP8 block-scaled checkpoints (`quant_method: fp8`) on tiny random models:
read dequantised (transformers' logits on the dequantised weights, < 1e-4), and with FP8
compute (forced on CPU, where it runs the torch reference of the FP8 linear): linear
weights held as float8_e4m3fn with the checkpoint's block scales, logits within the
activation quantisation's error and greedy tokens unchanged. (The kernels and TP sharding
of the scales: `test_fp8_linear.py`.)"""

import json
import os
import shutil

import pytest
import torch
from forward_helpers import prefill
from safetensors.torch import load_file, save_file
from tiny_models import hf_logits, make_tiny_family, write_fp8_copy
from transformers import AutoTokenizer

from cluster.config import ModelConfig, engine_config_from_args
from cluster.kernels.fp8_linear import quantize_activations_ref
from cluster.models.loader import load_model
from cluster.models.moe import SparseMoeBlock
from cluster.parallel import ParallelState
from cluster.parallel.linear import LinearBase

TOL = 1e-4
SEQ_LENS = [1, 7, 19, 4]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_path):
    """(path, hf model) of a tiny DeepSeek-V3 (MLA, MoE with a shared expert)."""
    path = str(tmp_path_factory.mktemp("deepseek_v3"))
    hf = make_tiny_family(path, "deepseek_v3", seed=15)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    return path, hf


def _batch(vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS]


def test_fp8_block_scaled_checkpoint_loads_dequantised(deepseek, tmp_path):
    """A DeepSeek-V3 checkpoint with FP8 projection weights and `weight_scale_inv`
    blocks: the loaded weights are the blocks times their scales, and the logits equal
    transformers' on those dequantised weights."""
    path, hf = deepseek
    folder = tmp_path / "fp8"
    dequantised = write_fp8_copy(path, str(folder), block=16)
    config = json.loads((folder / "config.json").read_text())
    model = load_model(
        ModelConfig(path=str(folder), dtype="float32"), ParallelState.single(), False
    )
    kv_b = "model.layers.2.self_attn.kv_b_proj.weight"
    assert torch.equal(dict(model.named_parameters())[kv_b], dequantised[kv_b])
    plain = tmp_path / "dequantised"  # transformers reads the same weights unquantised
    shutil.copytree(path, plain)
    save_file(dequantised, plain / "model.safetensors")
    reference = type(hf).from_pretrained(str(plain), dtype=torch.float32).eval()
    seqs = _batch(hf.config.vocab_size, seed=4)
    with torch.no_grad():
        logits = model.compute_logits(prefill(model, torch.cat(seqs), SEQ_LENS))
    for ours, ref in zip(logits.split(SEQ_LENS), hf_logits(reference, seqs), strict=True):
        assert (ours - ref).abs().max().item() < TOL
    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        config["quantization_config"] = {"quant_method": "awq"}
        (folder / "config.json").write_text(json.dumps(config))
        engine_config_from_args(str(folder), max_model_len=128)


def _fake_quantised_inputs(model, names, group):
    """Make the layers `names` of `model` see their input as FP8 compute does: quantised
    per token and `group` columns, then dequantised (`quantize_activations_ref`)."""

    def hook(module, args):
        x_q, scale = quantize_activations_ref(args[0], group)  # [n, k], [n, groups]
        scales = scale.repeat_interleave(group, dim=1)[:, : x_q.shape[1]]
        return (x_q.float() * scales,)

    for name in names:
        model.get_submodule(name).register_forward_pre_hook(hook)


def _fake_quantised_experts(model, group):
    """Make the MoE blocks of `model` run their (dequantised) experts as FP8 compute does:
    each expert's input and SiLU-gated intermediate quantised per row and `group` columns,
    then dequantised."""

    def fake(x):
        x_q, scale = quantize_activations_ref(x, group)
        return x_q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]

    def experts(x, block):
        top_ids, top_weights = block.route(x)
        out = torch.zeros_like(x)
        for t, row in enumerate(x):
            for j, e in enumerate(top_ids[t].tolist()):
                gate, up = (fake(row[None]) @ block.w13[e].T).chunk(2, dim=-1)
                h = fake(torch.nn.functional.silu(gate) * up)
                out[t] += top_weights[t, j] * (h @ block.w2[e].T)[0]
        return out

    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts = lambda x, block=module: experts(x, block)


def test_fp8_compute_keeps_linear_weights_fp8(deepseek, tmp_path):
    """FP8 compute forced on CPU (the torch references of the block-scaled FP8 linear and
    fused MoE) for DeepSeek-V3 (MLA, MoE with shared experts): every linear layer and every
    routed expert holds its weight as float8_e4m3fn and the checkpoint's scales;
    kv_b_proj (read as a matrix), the router, embedding, norms and LM head keep the
    dequantised path. Its logits equal, to 1e-4, the dequantised model's with the same
    activation quantisation in front of those layers and inside the experts: every layer
    and expert reads its own scales."""
    path, hf = deepseek
    folder = str(tmp_path / "fp8")
    write_fp8_copy(path, folder, block=16)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    config = ModelConfig(path=folder, dtype="float32")
    fp8 = load_model(config, ParallelState.single(), False, fp8_compute=True)
    dense = load_model(config, ParallelState.single(), False)  # CPU's default: dequantised
    params = dict(fp8.named_parameters())
    layers = {n for n, m in fp8.named_modules() if isinstance(m, LinearBase) and m.fp8_allowed}
    assert len(layers) == 3 * 4 + 2 + 2 * 2  # MLA's 4 per layer, dense MLP, shared experts
    for name in layers:
        assert params[f"{name}.weight"].dtype == torch.float8_e4m3fn
        scale = params[f"{name}.weight_scale_inv"]
        parts = [name]
        if name.endswith("gate_up_proj"):  # gate's scale blocks, then up's
            parts = [name.replace("gate_up_proj", piece) for piece in ("gate_proj", "up_proj")]
        assert torch.equal(scale, torch.cat([stored[f"{p}.weight_scale_inv"] for p in parts]))
    for name in ("w13", "w2"):  # the routed experts of the two MoE layers
        for layer in (1, 2):
            prefix = f"model.layers.{layer}.mlp."
            assert params[prefix + name].dtype == torch.float8_e4m3fn
            want = [
                stored[f"{prefix}experts.{e}.{p}.weight_scale_inv"]
                for e in range(8)
                for p in (("gate_proj", "up_proj") if name == "w13" else ("down_proj",))
            ]
            got = params[prefix + name + "_scale_inv"]
            assert torch.equal(got.flatten(0, 1), torch.cat(want))
    kept = [n for n, p in params.items() if p.dtype != torch.float8_e4m3fn]
    assert all(params[n].dtype == torch.float32 for n in kept)
    assert {n.split(".")[-1] for n in kept if "kv_b_proj" in n} == {"weight"}
    _fake_quantised_inputs(dense, layers, group=16)
    _fake_quantised_experts(dense, group=16)
    seqs = _batch(hf.config.vocab_size, seed=4)
    with torch.no_grad():
        ours = fp8.compute_logits(prefill(fp8, torch.cat(seqs), SEQ_LENS))
        ref = dense.compute_logits(prefill(dense, torch.cat(seqs), SEQ_LENS))
    assert (ours - ref).abs().max().item() < TOL


def test_fp8_compute_greedy_matches_dequantised(tmp_path):
    """A dense DeepSeek-V3 (every MLP dense, so no routing decision can flip): FP8 compute
    is within the activation quantisation's error of the dequantised model (each linear
    ~2% of its output's norm, asserted < 5% of the logits' norm over 3 layers) and greedy
    decoding of a short prompt picks the same 8 tokens."""
    src, folder = str(tmp_path / "src"), str(tmp_path / "fp8")
    make_tiny_family(src, "deepseek_v3", seed=13, first_k_dense_replace=3)
    write_fp8_copy(src, folder, block=16)
    config = ModelConfig(path=folder, dtype="float32")
    models = [load_model(config, ParallelState.single(), False, fp8_compute=on) for on in (1, 0)]
    seqs = _batch(251, seed=5)
    with torch.no_grad():
        fp8, dense = (m.compute_logits(prefill(m, torch.cat(seqs), SEQ_LENS)) for m in models)
    assert (fp8 - dense).norm() / dense.norm() < 0.05
    greedy = []
    for model in models:
        ids = [5, 17, 42, 99, 3]
        for _ in range(8):
            with torch.no_grad():
                logits = model.compute_logits(prefill(model, torch.tensor(ids), [len(ids)]))
            ids.append(int(logits[-1].argmax()))
        greedy.append(ids)
    assert greedy[0] == greedy[1]


def test_a_dequantised_slice_reads_only_its_blocks():
    """A rank's slice of a dequantised FP8 weight (any offsets, also inside a block) equals
    the whole dequantised weight's slice, reading only that slice of the weight."""
    from tiny_models import quantize_fp8_blocks

    from cluster.models.fp8 import dequantize_blocks, dequantize_slice
    from cluster.parallel.weights import LazyTensor

    weight, scales = quantize_fp8_blocks(torch.randn(40, 56), 16)
    asked: list[tuple[slice, ...]] = []

    def lazy(name, t):
        def read(slices):
            asked.append((name, slices))
            return t[slices] if slices else t

        return LazyTensor(name, tuple(t.shape), read)

    full = dequantize_blocks(weight, scales, (16, 16))
    for rows, cols in [
        (slice(0, 40), slice(0, 56)),
        (slice(16, 32), slice(0, 56)),
        (slice(5, 37), slice(20, 50)),
    ]:
        asked.clear()
        got = dequantize_slice(lazy("w", weight), lazy("s", scales), (rows, cols), (16, 16))
        assert torch.equal(got, full[rows, cols])
        assert dict(asked)["w"] == (rows, cols)  # never the whole weight
