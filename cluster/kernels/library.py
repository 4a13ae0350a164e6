"""Our operators (`cluster::...`), registered with torch's dispatcher directly.

A compiled graph calls our kernels as opaque operators: the packed products, attention,
RMSNorm's mean of squares, the MoE experts, the gated delta rule. `torch.library.custom_op`
wraps each call in a few Python layers of its own; a SmolLM2 step makes 212 such calls,
and inside a compiled graph each cost about 4 us more than an operator made with
`Library.define` and `Library.impl` (2-core AMD EPYC): about 0.8 ms of a 12 ms decode
step. `define_op` registers the latter way: one implementation for every device (the
dispatcher's CompositeExplicitAutograd key, so inductor keeps the call opaque instead of
tracing into it) and a fake for tracing. These operators are for inference: none has a
gradient.

The registrations live as long as the `torch.library.Library` object that made them,
hence this module's one handle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_LIBRARY = torch.library.Library("cluster", "FRAGMENT")


def define_op(
    schema: str,
    impl: Callable[..., torch.Tensor],
    fake: Callable[..., torch.Tensor],
    tags: Sequence[torch.Tag] = (),
) -> torch._ops.OpOverloadPacket:
    """`torch.ops.cluster.<name>` for `schema` ("name(Tensor x, ...) -> Tensor"), run by
    `impl` on every device and by `fake` while tracing."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema, tags=tuple(tags))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cluster::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.cluster, name)
