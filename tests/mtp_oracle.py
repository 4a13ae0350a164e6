"""MTP heads arranged to predict exactly what their target will say, in both public
layouts, so that a correct engine accepts nearly every draft.

The target is rewritten so its next token depends only on the current token: every
attention / linear-attention output projection and every MLP but layer `kept`'s are
zeroed, and the embedding rows get unit RMS. Then the target computes
`head(norm(e + mlp_kept(post_norm_kept(e))))` for the current token's embedding `e`. Each
MTP layer becomes layer `kept` (output projection zeroed too), its fusion projection
passes the normalised embedding through and drops the hidden state, and its final norm is
the target's: fed token t + 1, it outputs what the target will say after t + 1.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

SILENCED = ("o_proj.", "out_proj.")


def _rewrite_target(path: str, kept: int) -> dict[str, torch.Tensor]:
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    for name, t in weights.items():
        pieces = SILENCED if f"layers.{kept}." in name else (*SILENCED, "down_proj.")
        if any(piece in name for piece in pieces):
            weights[name] = torch.zeros_like(t)
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(weights, file)
    return weights


def make_oracle(target_path: str, mtp_path: str, style: str, kept: int) -> None:
    """Rewrite the target at `target_path` and the MTP head written by
    `random_heads` at `mtp_path` (whose checkpoint links the target's
    file). `style`: "deepseek" or "qwen3_next"."""
    weights = _rewrite_target(target_path, kept)
    mtp_file = os.path.join(mtp_path, "mtp.safetensors")
    mtp = load_file(mtp_file)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    passthrough = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    source = f"model.layers.{kept}."
    if style == "qwen3_next":
        layers = {"mtp.layers.0.": "mtp.layers.0."}
        mtp["mtp.fc.weight"] = passthrough
        mtp["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)  # zero-centred: x 1
        mtp["mtp.norm.weight"] = weights["model.norm.weight"]
    else:
        first = len({n.split(".")[2] for n in weights if n.startswith("model.layers.")})
        layers = {}
        for name in [n for n in mtp if n.endswith(".eh_proj.weight")]:
            prefix = name[: -len("eh_proj.weight")]
            layers[prefix] = prefix
            mtp[name] = passthrough
            mtp[prefix + "enorm.weight"] = torch.ones(hidden)
            mtp[prefix + "shared_head.norm.weight"] = weights["model.norm.weight"]
        assert all(int(p.split(".")[2]) >= first for p in layers)
    for prefix in layers:
        block = [n for n in mtp if n.startswith(prefix)]
        for name in block:
            rest = name[len(prefix) :]
            if source + rest in weights:  # the block's tensors (not the fusion's)
                mtp[name] = weights[source + rest]
    save_file({name: t.clone() for name, t in mtp.items()}, mtp_file)
