"""`PlacementConfig`: how much each rank's placement-group bundle reserves and how the
bundles spread over nodes (used by the Ray actors; plain data, no Ray import)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class PlacementConfig(BaseModel):
    """How many resources each rank's bundle reserves, and how bundles are spread."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = "PACK"
    use_gpu: bool = False
    # CPUs reserved per worker; fractional values let several ranks share a small node.
    worker_cpus: float = Field(default=0.5, ge=0.0)
    # CPUs of the Serve replica (merged into bundle 0 with the scheduler actor).
    replica_cpus: float = Field(default=0.1, ge=0.0)
    # torch intra-op threads per worker; None means max(1, round(worker_cpus)).
    threads_per_worker: int | None = Field(default=None, ge=1)
    # How each step reaches the workers (the scheduler actor sends it to every rank):
    # "compiled_graph", a Ray Compiled Graph (shared-memory channels on a node);
    # "sockets", one socket per rank, served inside one long call on the worker; "tasks", one Ray
    # task per rank. Ray's channel readers wait by spinning (a core each for the
    # scheduler actor and every idle worker), which pays where ranks own GPUs and their
    # cores and costs model time where ranks share a few CPU cores, so "auto" is
    # "compiled_graph" with GPUs and "sockets" without. If the channel cannot be set up,
    # the engine falls back to tasks (and logs why).
    step_channel: Literal["auto", "compiled_graph", "sockets", "tasks"] = "auto"

    @property
    def resolved_step_channel(self) -> str:
        if self.step_channel != "auto":
            return self.step_channel
        return "compiled_graph" if self.use_gpu else "sockets"

    def bundles(self, world_size: int) -> list[dict[str, float]]:
        """One bundle per rank; bundle 0 also carries the replica's CPUs."""
        out = []
        for i in range(world_size):
            cpus = self.worker_cpus + (self.replica_cpus if i == 0 else 0.0)
            bundle: dict[str, float] = {"CPU": round(cpus, 4)}
            if self.use_gpu:
                bundle["GPU"] = 1.0
            out.append(bundle)
        return out

    @property
    def torch_threads(self) -> int:
        return self.threads_per_worker or max(1, round(self.worker_cpus))
