"""Configuration rejects every invalid value with a message naming the field."""

import pytest
from pydantic import ValidationError
from tiny_models import make_tiny_llama

from cluster.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    engine_config_from_args,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cfg") / "m")
    make_tiny_llama(path, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    return path


def test_valid_config_and_defaults(tiny_path):
    cfg = EngineConfig(
        model=ModelConfig(path=tiny_path), parallel=ParallelConfig(tensor_parallel_size=4)
    )
    assert cfg.model.resolved_max_model_len == 512
    assert cfg.parallel.distributed_backend in ("gloo", "nccl")
    assert ParallelConfig(backend="gloo").distributed_backend == "gloo"
    with pytest.raises(ValidationError):  # frozen
        cfg.seed = 3


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda p: ModelConfig(path=p + "-missing"), "path"),
        (lambda p: ModelConfig(path=p, dtype="float64"), "dtype"),
        (lambda p: ModelConfig(path=p, max_model_len=0), "max_model_len"),
        (lambda p: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
        (lambda p: ParallelConfig(pipeline_parallel_size=-1), "pipeline_parallel_size"),
        (lambda p: ParallelConfig(backend="mpi"), "backend"),
        (lambda p: CacheConfig(block_size=0), "block_size"),
        (lambda p: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda p: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda p: ModelConfig(path=p, unknown_key=1), "unknown_key"),
    ],
)
def test_field_errors_name_the_field(tiny_path, build, field):
    with pytest.raises(ValidationError, match=field):
        build(tiny_path)


@pytest.mark.parametrize(
    "parallel, scheduler, max_len, message",
    [
        (
            dict(tensor_parallel_size=3),
            {},
            None,
            r"tensor_parallel_size=3 must divide .*num_attention_heads=4 \(allowed: \[1, 2, 4\]\)",
        ),
        (
            dict(tensor_parallel_size=8),
            {},
            None,
            "tensor_parallel_size=8 must divide the model's num_attention_heads=4",
        ),
        (
            dict(pipeline_parallel_size=4),
            {},
            None,
            "pipeline_parallel_size=4 exceeds the model's num_hidden_layers=3",
        ),
        ({}, {}, 1024, "max_model_len=1024 exceeds the model's max_position_embeddings=512"),
        (
            {},
            dict(max_num_batched_tokens=100, enable_chunked_prefill=False),
            None,
            "max_num_batched_tokens=100 must be at least max_model_len=512",
        ),
    ],
)
def test_checks_against_the_model(tiny_path, parallel, scheduler, max_len, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(
            model=ModelConfig(path=tiny_path, max_model_len=max_len),
            parallel=ParallelConfig(**parallel),
            scheduler=SchedulerConfig(**scheduler),
        )


def test_kv_heads_may_be_replicated(tiny_path, tmp_path):
    # 4 query heads, 2 KV heads: TP=4 replicates each KV head on two ranks (allowed).
    EngineConfig(model=ModelConfig(path=tiny_path), parallel=ParallelConfig(tensor_parallel_size=4))
    path = str(tmp_path / "m6")
    make_tiny_llama(path, hidden_size=48, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(
        ValueError, match="must divide the model's num_key_value_heads=4 or be a multiple of it"
    ):
        EngineConfig(model=ModelConfig(path=path), parallel=ParallelConfig(tensor_parallel_size=6))


def test_pipeline_layout_and_speculation_checks(tiny_path):
    with pytest.raises(ValueError, match=r"pipeline_layer_partition=\[2, 2\] must give every"):
        engine_config_from_args(
            tiny_path, pipeline_parallel_size=2, pipeline_layer_partition=(2, 2)
        )
    config = engine_config_from_args(
        tiny_path, pipeline_parallel_size=2, pipeline_layer_partition=(2, 1)
    )
    assert config.parallel.pipeline_layer_partition == (2, 1)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    engine_config_from_args(tiny_path, pipeline_parallel_size=3, speculative_config=ngram)
    with pytest.raises(ValueError, match=r"speculative\.adaptive needs pipeline_parallel_size=1"):
        engine_config_from_args(
            tiny_path, pipeline_parallel_size=3, speculative_config={**ngram, "adaptive": True}
        )
