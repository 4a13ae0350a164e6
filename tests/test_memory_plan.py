"""`cluster plan`: the weight bytes counted from a config alone equal a meta-device
instantiation of our model (real DeepSeek-V3 and Qwen3-235B-A22B configs, and every tiny
family), and the plan's verdicts on the layouts the seed names."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from cluster.cli import main as cli_main
from cluster.models.memory_plan import GIB, memory_plan
from cluster.models.moe import SparseMoeBlock
from cluster.models.registry import model_class_for
from cluster.models.weight_count import stage_weights
from cluster.parallel import ParallelState
from cluster.parallel.linear import LinearBase
from tests.tiny_models import BASE, FAMILIES, VARIANTS

# deepseek-ai/DeepSeek-V3's config.json (public), the fields a model reads.
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    attention_bias=False,
    first_k_dense_replace=3,
    hidden_act="silu",
    hidden_size=7168,
    intermediate_size=18432,
    kv_lora_rank=512,
    max_position_embeddings=163840,
    model_type="deepseek_v3",
    moe_intermediate_size=2048,
    n_group=8,
    n_routed_experts=256,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=128,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_key_value_heads=128,
    num_nextn_predict_layers=1,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    quantization_config={
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    rms_norm_eps=1e-6,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=10000,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
    topk_group=4,
    v_head_dim=128,
    vocab_size=129280,
)
# Qwen/Qwen3-235B-A22B's config.json (public).
QWEN3_235B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    attention_bias=False,
    decoder_sparse_step=1,
    head_dim=128,
    hidden_act="silu",
    hidden_size=4096,
    intermediate_size=12288,
    max_position_embeddings=40960,
    mlp_only_layers=[],
    model_type="qwen3_moe",
    moe_intermediate_size=1536,
    norm_topk_prob=True,
    num_attention_heads=64,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=94,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    vocab_size=151936,
)


def _config(fields: dict) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(**fields)


def _meta_bytes(config, tp: int, pp: int, pp_rank: int, fp8: tuple[int, int] | None = None) -> int:
    """Bytes of the parameters our model class builds on one rank, on the meta device
    (`fp8`: with the layers an FP8 checkpoint keeps in FP8 switched to it)."""
    state = ParallelState(0, tp, pp_rank, pp, None, torch.device("meta"))
    with torch.device("meta"):
        model = model_class_for(config)(config, state, torch.bfloat16)
        for module in list(model.modules()) if fp8 else []:
            if isinstance(module, LinearBase) and module.fp8_allowed:
                module.use_fp8_weight(fp8)
            elif isinstance(module, SparseMoeBlock):
                module.use_fp8_experts(fp8)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    "fields, tp, pp",
    [(DEEPSEEK_V3, 8, 1), (DEEPSEEK_V3, 4, 2), (QWEN3_235B, 8, 1), (QWEN3_235B, 2, 4)],
)
def test_real_configs_weight_bytes_match_meta_instantiation(fields, tp, pp):
    config = _config(fields)
    for pp_rank in range(pp):
        weights, _, _ = stage_weights(config, tp, pp, pp_rank)
        planned, built = weights.num_bytes(2, None), _meta_bytes(config, tp, pp, pp_rank)
        assert abs(planned - built) <= 0.01 * built, (pp_rank, planned / GIB, built / GIB)


def test_deepseek_v3_fp8_weight_bytes_match_meta_instantiation():
    config = _config(DEEPSEEK_V3)
    weights, _, _ = stage_weights(config, 8, 1, 0)
    planned, built = weights.num_bytes(2, (128, 128)), _meta_bytes(config, 8, 1, 0, (128, 128))
    assert abs(planned - built) <= 0.01 * built, (planned / GIB, built / GIB)


def _tiny_configs():
    for name, (arch, overrides) in FAMILIES.items():
        yield name, arch, {**BASE, **overrides}
    for name, overrides in VARIANTS.items():
        yield name, "LlamaForCausalLM", {**BASE, **overrides}


@pytest.mark.parametrize("name, arch, fields", list(_tiny_configs()), ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("tp", [1, 2])
def test_every_family_weight_bytes_equal_meta_instantiation(name, arch, fields, tp):
    model_type = {"LlamaForCausalLM": "llama"}.get(arch) or getattr(
        transformers, arch
    ).config_class.model_type
    config = _config({**fields, "model_type": model_type, "architectures": [arch]})
    if fields.get("num_key_value_heads", 4) % tp and tp % fields["num_key_value_heads"]:
        pytest.skip("layout not allowed")
    weights, _, _ = stage_weights(config, tp, 1, 0)
    assert weights.num_bytes(2, None) == _meta_bytes(config, tp, 1, 0)


def _plan(fields: dict, tp: int, gib: float, **kwargs):
    from cluster.models.fp8 import block_size_of

    config = _config(fields)
    fp8 = kwargs.pop("fp8", True)
    return memory_plan(
        config,
        tp,
        budget_bytes=int(gib * GIB * 0.9),
        fp8_block=block_size_of(config) if fp8 else None,
        **kwargs,
    )


def test_deepseek_v3_fits_eight_h200s_in_fp8_not_in_bfloat16():
    fp8 = _plan(DEEPSEEK_V3, 8, 141)
    assert fp8.fits and fp8.stages[0].kv_tokens >= 100_000
    # the FP8 weights: one byte per linear weight, plus scales and bf16 embeddings/norms
    assert 75 * GIB < fp8.stages[0].weight_bytes < 85 * GIB
    bf16 = _plan(DEEPSEEK_V3, 8, 141, fp8=False)
    assert not bf16.fits and bf16.stages[0].kv_tokens == 0
    assert "NO" in bf16.table() and "does NOT fit" in bf16.table()
    # MLA: one latent and one rope key per token and layer, on every rank
    assert fp8.stages[0].kv_bytes_per_token == 61 * (512 + 64) * 2


def test_qwen3_235b_kv_heads_replicated_beyond_their_count():
    # 4 KV heads at TP=8: each rank keeps one whole KV head
    plan = _plan(QWEN3_235B, 8, 80)
    assert plan.stages[0].kv_bytes_per_token == 94 * 2 * 1 * 128 * 2
    assert plan.fits


def test_cli_plan_prints_the_table_and_fails_when_it_does_not_fit(tmp_path, capsys):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 688_586_727_753}, "weight_map": {}})
    )
    cli_main(["plan", str(folder), "-tp", "8", "--gpu-memory-gib", "141"])
    out = capsys.readouterr().out
    assert "fp8 (block 128x128)" in out and "the layout fits" in out
    assert "641.3 GiB" in out  # the index's total size
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", str(folder), "-tp", "8", "--gpu-memory-gib", "141", "--dequantize"])
    assert exit_info.value.code == 1
    assert "does NOT fit" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="expert-parallel-size=4"):
        cli_main(["plan", str(folder), "-tp", "8", "--expert-parallel-size", "4"])


def test_worker_refuses_a_layout_that_cannot_fit_before_loading(tmp_path):
    from cluster.config import EngineConfig, ModelConfig
    from cluster.worker.memory_check import check_layout_fits
    from tests.tiny_models import make_tiny_llama

    make_tiny_llama(str(tmp_path))
    config = EngineConfig(model=ModelConfig(path=str(tmp_path), dtype="float32"))
    state = ParallelState.single()
    check_layout_fits(config, state)  # this host holds a tiny model
    weights, _, _ = stage_weights(config.model.hf_config, 1, 1, 0)
    with pytest.raises(ValueError, match="does not fit this layout") as error:
        check_layout_fits(config, state, budget_bytes=weights.num_bytes(4, None) // 2)
    assert "| stage | layers | weights GiB" in str(error.value)
