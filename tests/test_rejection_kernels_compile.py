"""The rejection kernels compile for a Hopper GPU (sm_90), even on a machine without one;
and without the interpreter, the Triton backend on CPU tensors fails with a clear message.

The interpreter runs kernels as Python, so it misses errors only the compiler sees (types
carried through loops, scalar branches). This compiles every kernel variant to PTX in a
subprocess without TRITON_INTERPRET, and checks that the PTX has no fused multiply-add and
no division but float64's correctly rounded `div.rn.f64`: every float operation is then
correctly rounded, as on the CPU, which is what
lets the kernels match the torch path bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMPILE = r"""
import json, re
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cluster.kernels import rejection_triton as r

i64, f32, f64, b1 = "*i64", "*fp32", "*fp64", "*i1"
signature = {"out_ptr": i64, "out_stride": "i64", "nodes_ptr": i64, "nodes_stride": "i64",
    "cu_num_draft_ptr": i64, "draft_ptr": i64, "parent_ptr": i64, "target_probs_ptr": f32,
    "target_stride": "i64", "row_start_ptr": i64, "argmax_ptr": i64, "draft_probs_ptr": f32,
    "draft_stride": "i64", "has_draft_probs_ptr": b1, "bonus_ptr": i64, "is_greedy_ptr": b1,
    "uniforms_ptr": f64, "inv_exp_ptr": f32, "inv_exp_stride": "i64", "scratch_p_ptr": f32,
    "scratch_q_ptr": f32, "scratch_stride": "i64", "vocab_size": "i32",
    "HAS_DRAFT_PROBS": "constexpr", "HAS_BONUS": "constexpr", "BLOCK": "constexpr"}
kernels = [
    ("_verify_kernel", signature, {"HAS_DRAFT_PROBS": q, "HAS_BONUS": bonus, "BLOCK": 4096})
    for q in (True, False) for bonus in (True, False)
]
report = []
for name, signature, constants in kernels:
    names = list(signature)
    fn = getattr(r, name)
    assert names == fn.arg_names, (name, names, fn.arg_names)
    constexprs = {(names.index(c),): v for c, v in constants.items()}
    ptx = compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    # float64 division is div.rn (correctly rounded); any other division is approximate
    report.append({"kernel": name, "constants": constants,
                   "fma": len(re.findall(r"\bfma\.", ptx)),
                   "div": len(re.findall(r"\bdiv\.(?!rn\.f64)", ptx)),
                   "div_rn_f64": len(re.findall(r"\bdiv\.rn\.f64", ptx))})
print(json.dumps(report))
"""


def test_kernels_compile_for_sm90_without_fma_or_division(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the permissive setting: fusion allowed
    result = subprocess.run(
        [sys.executable, "-c", COMPILE],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],  # the repository root, where `cluster` is
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == 4  # with and without draft probabilities and a given bonus
    for entry in report:
        assert entry["fma"] == 0 and entry["div"] == 0, entry
    assert any(entry["div_rn_f64"] for entry in report)  # the residual's normalisation


NO_INTERPRETER = r"""
import torch
from cluster.sample import rejection_sample
try:
    rejection_sample(torch.tensor([1]), [1], None, torch.full((1, 4), 0.25),
                     torch.tensor([0]), torch.tensor([True]), backend="triton")
except RuntimeError as error:
    print(error)
"""


def test_triton_backend_on_cpu_without_the_interpreter_raises_clearly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", NO_INTERPRETER],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "set TRITON_INTERPRET=1" in result.stdout
