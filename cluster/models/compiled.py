"""A compiled forward: one torch.compile graph per token-count bucket, eager elsewhere;
or (`CompileOptions.dynamic`, what a batch-invariant CPU engine uses) one graph whose
token count is symbolic, for every step of 2 rows or more.

A forward with `n` tokens runs the graph of the smallest bucket `>= n`, its inputs padded
with zero rows and its outputs cut back to `n` rows; above the largest bucket (long
prefill chunks, where the matrix products are large enough to run well eagerly) and for
any bucket whose compilation failed, it runs the eager module. The padding rows attend to
nothing and write no KV (`cluster.models.attention`), and every other op of a decoder
works row by row, so the real rows are those of an eager forward up to the kernels'
rounding.

CPU, weights prepacked for oneDNN (bfloat16, `cluster.kernels.packed_linear`): the weights
stay graph inputs, the products are the opaque op `cluster::packed_linear`, and the graph's
wrapper is C++. Such a graph holds no weight, so inductor's on-disk caches keep it and a
second start loads it instead of compiling (a frozen graph holds oneDNN tensors, which the
caches cannot store: every start compiled again, ~30 s for the default model). The C++
wrapper matters: a Python wrapper unpacks every weight input into a local of one frame,
and with hundreds of them CPython 3.11 maps and unmaps a frame-stack chunk around each op
called from that frame (decode ran ~40% slower). CPU, other weights (float32): inductor
with frozen weights (folded into the graph as constants, the linear layers packed by
inductor); `max-autotune` lets inductor time its C++ GEMM templates against the BLAS calls
per shape. CUDA: the same
buckets, with inductor's CUDA graphs captured around the attention op (which is tagged
unsafe for capture: it reads the step's metadata on the host), so everything between two
attention calls replays as one graph; outputs are copied out of the graphs' memory pool.
Compiled artefacts go to inductor's on-disk caches (`TORCHINDUCTOR_CACHE_DIR`, which the
engine points under its cache folder), so a second start with the same model shapes and
buckets reuses them (frozen graphs excepted, see above).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.models.attention import AttentionMetadata, attention_context
from cluster.parallel.pipeline import StageActivations

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOptions:
    sizes: tuple[int, ...]  # token-count buckets, ascending
    autotune: bool = True  # CPU: let inductor time its GEMM templates (slower to compile)
    # One graph for every token count of 2 and more (the token dimension symbolic) instead
    # of one per bucket: every row of every step then runs the same kernels, which is what
    # batch invariance needs (per-bucket graphs pick kernels and fusions by size, and an
    # eager forward above the largest bucket rounds differently from a compiled one).
    # One graph also compiles in a fraction of the buckets' time. A 1-token forward is
    # padded to 2 rows (dynamo specialises a dimension of size 1).
    dynamic: bool = False
    # CPU: fold the weights into the graph (freezing). False where the module's linear
    # weights are prepacked already: the graph then takes them as inputs, has a C++
    # wrapper, and is cached on disk (see the module docstring).
    freeze: bool = True
    # Every forward runs eagerly until `warm_up` has built its graphs (on a thread, while
    # the engine serves): see `ModelRunner.warm_up`.
    background: bool = False

    @property
    def min_rows(self) -> int:
        return 2 if self.dynamic else 1


# The key of the one graph of a dynamic compiled forward (where buckets are token counts).
DYNAMIC_GRAPH = 0


def bucket_for(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `num_tokens` rows; None above the largest."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` ([n, ...]) with zero rows appended up to `rows`."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def cut_rows(out: Any, n: int, copy: bool = False) -> Any:
    """The first `n` rows of every tensor in a forward's output (`copy`: as new tensors)."""
    if isinstance(out, torch.Tensor):
        return out[:n].clone() if copy else out[:n]
    if isinstance(out, StageActivations):
        hidden, residual, *aux = cut_rows([out.hidden, out.residual, *out.aux], n, copy)
        return StageActivations(hidden, residual, aux)
    if isinstance(out, (list, tuple)):
        return type(out)(cut_rows(o, n, copy) for o in out)
    return out


def private_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a function or bound method) on a copy of its code object. Dynamo keeps its
    compiled graphs and its recompile budget per code object: with a private copy each
    compiled forward has its own, which it frees with itself (an engine's frozen weights
    are not kept alive by the next engine's graphs in the same process)."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(private_copy(fn.__func__), fn.__self__)
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def compile_kwargs(device: torch.device, options: CompileOptions) -> dict[str, Any]:
    """torch.compile's arguments: CUDA graphs between the attention ops on CUDA; on CPU,
    frozen weights or (weights prepacked) a C++ wrapper."""
    if device.type == "cuda":
        return {"options": {"triton.cudagraphs": True, "graph_partition": True}}
    return {"options": {**_cpu_settings(options), "max_autotune": options.autotune}}


def _cpu_settings(options: CompileOptions) -> dict[str, bool]:
    # emulate_precision_casts: round to bfloat16 between fused ops wherever eager rounds
    # (rotary, SiLU-and-multiply, the norms' casts), so compiled rows equal eager rows.
    # cpp_wrapper_build_separate: the C++ wrapper (thousands of lines of calls) built at
    # -O1 apart from the kernels (-O3); built as one -O3 file it took 44 of the default
    # model's 84 s cold compile, for no measurable speed (benchmarks/cold_start.py).
    return {
        "freezing": options.freeze,
        "cpp_wrapper": not options.freeze,
        "cpp_wrapper_build_separate": not options.freeze,
        "emulate_precision_casts": True,
    }


class CompiledForward:
    """Wraps `fn(input_ids, positions, *rows)`, where every argument is a tensor whose first
    dim is the token count, with one compiled graph per bucket of `options.sizes`."""

    def __init__(
        self, fn: Callable[..., Any], options: CompileOptions, device: torch.device, name: str
    ) -> None:
        if list(options.sizes) != sorted(set(options.sizes)) or options.sizes[0] < 1:
            raise ValueError(f"compile sizes must be ascending positive ints, got {options.sizes}")
        self.fn = fn
        self.options = options
        self.name = name
        self.device = device
        self.ready: set[int] = set()  # buckets that compiled
        # Run eagerly until `warm_up` ends (it runs on a thread of its own meanwhile).
        self.eager_until_warm = options.background
        self.failed: set[int] = set()
        self.num_guard_misses = 0  # calls whose built graph did not fit (0 once warmed up)
        # A CUDA graph's outputs live in its pool and the next replay overwrites them.
        self.copy_outputs = device.type == "cuda"

    @functools.cached_property
    def _compiled(self) -> Callable[..., Any]:
        """The `torch.compile` wrapper, made at the first compile: importing dynamo takes
        about a second, which a background warm-up keeps off the start's path."""
        # One graph per bucket of the same code object: dynamo's per-code-object limit must
        # allow them all (a process-wide setting that is only ever raised here).
        limit = 2 * len(self.options.sizes) + 8
        if torch._dynamo.config.recompile_limit < limit:
            torch._dynamo.config.recompile_limit = limit
        return torch.compile(
            private_copy(self.fn),
            fullgraph=True,
            dynamic=False,
            **compile_kwargs(self.device, self.options),
        )

    def warm_up(self, row_widths: Sequence[int] = (), dtype: torch.dtype | None = None) -> float:
        """Compile every bucket now, on inputs shaped as a step's: token ids and positions
        ([n] int64), then a zero row block [n, w] of `dtype` per entry of `row_widths`.
        Returns the seconds it took; a bucket that fails is logged once and runs eagerly.
        With `options.background`, the forward runs eagerly until this returns."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        sizes = (self.options.min_rows,) if self.options.dynamic else self.options.sizes
        progress = tqdm(
            sizes, desc=f"Compiling {self.name}", unit="graph", disable=self.options.background
        )
        try:
            for size in progress:
                key = DYNAMIC_GRAPH if self.options.dynamic else size
                meta = AttentionMetadata.for_prefill([size], self.device)
                # inference mode and inference tensors, as in the engine's steps (dynamo
                # guards on both: a graph built outside it would be rebuilt at the first step)
                with torch.inference_mode(), attention_context(meta):
                    ids = torch.zeros(size, dtype=torch.int64, device=self.device)
                    positions = torch.arange(size, device=self.device)
                    rows = [
                        torch.zeros(size, w, dtype=dtype, device=self.device) for w in row_widths
                    ]
                    self._run_bucket(key, (ids, positions, *rows))
        finally:
            self.eager_until_warm = False
        return time.perf_counter() - start

    def _compile_config(self) -> Any:
        """Inductor settings in force while a graph is built. CPU: freezing or the C++
        wrapper, set in inductor's config while compiling (as a `torch.compile` option
        freezing does not reach the weight-packing pass, and bfloat16 products then run
        unpacked, ~1.5x slower)."""
        if self.device.type == "cuda":
            return contextlib.nullcontext()
        return torch._inductor.config.patch(_cpu_settings(self.options))

    def _run_bucket(self, size: int, args: tuple[torch.Tensor, ...]) -> Any:
        """The bucket's graph (compiling it the first time). If compiling or running it
        fails, the bucket runs eagerly from then on; running again is safe, since a forward
        only writes this step's keys and values, to the same slots."""
        try:
            if self.options.dynamic:
                for x in args:  # one graph whatever the token count (others stay static)
                    torch._dynamo.maybe_mark_dynamic(x, 0)
            with self._compile_config():
                out = self._compiled(*args)
        except Exception as exc:  # anything the compiler cannot handle runs eagerly
            self.failed.add(size)
            self.ready.discard(size)
            logger.warning(
                "%s: the compiled %s failed, it runs eagerly (%s: %s)",
                self.name,
                "graph" if size == DYNAMIC_GRAPH else f"{size}-token bucket",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return self.fn(*args)
        self.ready.add(size)
        return out

    def __call__(self, *rows: torch.Tensor) -> Any:
        n = rows[0].shape[0]
        if self.options.dynamic:
            size = DYNAMIC_GRAPH if DYNAMIC_GRAPH not in self.failed else None
            rows = tuple(pad_rows(x, max(n, self.options.min_rows)) for x in rows)
        else:
            size = bucket_for(n, self.options.sizes)
        if size is None or size in self.failed or self.eager_until_warm:
            return cut_rows(self.fn(*rows), n)
        args = rows if self.options.dynamic else tuple(pad_rows(x, size) for x in rows)
        if size in self.ready:
            # Once a bucket's graph exists, dynamo only needs the guards that tell the
            # buckets apart (their input shapes); the full set costs ~0.6 ms a call. Should
            # anything else have changed, the bucket recompiles the ordinary way.
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return cut_rows(self._compiled(*args), n, self.copy_outputs)
            except Exception:
                self.num_guard_misses += 1
        return cut_rows(self._run_bucket(size, args), n, self.copy_outputs)
