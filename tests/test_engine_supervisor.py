"""`EngineSupervisor`'s policy, on stand-in engines: a failure starts one restart at a time,
requests wait for it, restarts stop after `max_restarts` in the window, and a restart that
fails leaves the engine dead for good (the health check then lets Serve replace the
replica). The restart of real engines is tested in `test_serve_faults.py` and
`test_serve_replicas.py`."""

import asyncio
import itertools

import pytest

from cluster.engine.errors import EngineDeadError
from cluster.serve.engine_supervisor import EngineSupervisor


class StandInEngine:
    def __init__(self, engine_id: str, on_death) -> None:
        self.engine_id = engine_id
        self.on_death = on_death
        self.error = None
        self.stopped = False

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
            self.on_death(reason)

    def stop_actors(self) -> None:
        self.stopped = True

    def shutdown(self) -> None:
        self.stop_actors()


def factory(fail_after: int | None = None):
    """Engines e0, e1, ...; the start after `fail_after` engines raises."""
    counter = itertools.count()
    started = []

    def start(on_death, restart: bool):
        n = next(counter)
        assert restart == (n > 0)  # every engine after the first replaces a dead one
        if fail_after is not None and n >= fail_after:
            raise RuntimeError("no room for the workers")
        started.append(StandInEngine(f"e{n}", on_death))
        return started[-1]

    return start, started


def test_a_dead_engine_is_replaced_and_requests_wait_for_the_new_one():
    async def main():
        start, started = factory()
        supervisor = EngineSupervisor(start, max_restarts=2)
        first = supervisor.engine
        first.fail("worker rank 1 is dead")  # as the engine's pump would
        assert supervisor.restarting and supervisor.dead is None
        assert supervisor.engine_failed("noticed twice") is True  # one restart at a time
        engine = await supervisor.ready()
        assert engine is started[1] and engine is supervisor.engine
        assert first.stopped and not engine.stopped
        assert supervisor.num_restarts == 1 and len(started) == 2

    asyncio.run(main())


def test_restarts_stop_after_max_restarts_in_the_window():
    async def main():
        start, started = factory()
        supervisor = EngineSupervisor(start, max_restarts=2)
        for _ in range(2):
            supervisor.engine.fail("killed")
            await supervisor.ready()
        supervisor.engine.fail("killed again")
        assert not supervisor.restarting
        assert "server.max_engine_restarts=2" in supervisor.dead
        with pytest.raises(EngineDeadError, match="killed again"):
            await supervisor.ready()
        assert len(started) == 3 and supervisor.num_restarts == 2

    asyncio.run(main())


def test_no_restarts_when_max_restarts_is_zero():
    async def main():
        start, started = factory()
        supervisor = EngineSupervisor(start, max_restarts=0)
        assert supervisor.engine_failed("health check: stalled") is False
        assert "stalled" in supervisor.dead and len(started) == 1

    asyncio.run(main())


def test_a_failed_restart_leaves_the_engine_dead_with_both_reasons():
    async def main():
        start, _ = factory(fail_after=1)
        supervisor = EngineSupervisor(start, max_restarts=3)
        supervisor.engine.fail("node lost")
        with pytest.raises(EngineDeadError, match=r"node lost.*no room for the workers"):
            await supervisor.ready()
        assert supervisor.dead is not None and supervisor.num_restarts == 0

    asyncio.run(main())


def test_a_replicas_restarted_engine_serves_while_its_graphs_compile(monkeypatch, smollm2_path):
    """`LLMServer` starts its first engine as configured (compiling before it serves) and
    every engine that replaces a dead one with `compile.background` on."""
    from types import SimpleNamespace

    from cluster.serve import server as server_module

    configs = []
    monkeypatch.setattr(
        server_module, "EngineClient", lambda config, *args, **kwargs: configs.append(config)
    )
    server = server_module.LLMServer.__new__(server_module.LLMServer)
    args = {"model": {"path": smollm2_path}, "compile": {"mode": "on"}}
    server.args = server_module.ClusterArgs.model_validate(args)
    server.engine_config = server.args.engine_config()
    server.placement_group, server.tokenizer = None, None
    server.metrics = SimpleNamespace(observe_batch=None)
    server._start_engine(lambda reason: None, False)
    server._start_engine(lambda reason: None, True)
    first, restarted = configs
    assert first is server.engine_config and not first.compile.background
    assert restarted.compile.background
    assert restarted.model_copy(update={"compile": first.compile}) == first  # nothing else
