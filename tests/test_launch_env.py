"""The environment a Ray started by `cluster serve` gets: nothing unless the user turned
Serve's HAProxy ingress on (`RAY_SERVE_ENABLE_HA_PROXY=1`); then free ports for HAProxy's
own listeners and a short draining period, never over a variable the user set, and this
process's environment left as it was."""

import os

import pytest

from cluster.serve import launch

ADDED = (*launch.HAPROXY_DRAINING_S, *launch.HAPROXY_PORT_VARS)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RAY_SERVE_ENABLE_HA_PROXY", *ADDED):
        monkeypatch.delenv(var, raising=False)


def test_without_the_switch_nothing_is_added(monkeypatch):
    assert launch.local_ray_env() == {}
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert launch.local_ray_env() == {}


def test_with_the_switch_haproxy_gets_free_ports(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert launch.haproxy_ingress_available()  # ray[serve] 2.60 on Linux installs it
    env = launch.local_ray_env()
    assert set(env) == set(ADDED)
    ports = [int(env[var]) for var in launch.HAPROXY_PORT_VARS]
    assert all(1024 <= p < 65536 for p in ports) and ports[0] != ports[1]


def test_a_variable_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "12345")
    env = launch.local_ray_env()
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and "RAY_SERVE_HAPROXY_METRICS_PORT" in env


def test_the_switch_without_haproxy_is_an_error(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setattr(launch, "haproxy_ingress_available", lambda: False)
    with pytest.raises(RuntimeError, match="no HAProxy ingress"):
        launch.local_ray_env()


@pytest.mark.parametrize("fails", [False, True])
def test_ray_init_sees_the_variables_and_this_process_keeps_its_own(monkeypatch, fails):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    before = dict(os.environ)
    seen = {}

    def fake_init(**kwargs):
        seen.update(env=dict(os.environ), kwargs=kwargs)
        if fails:
            raise RuntimeError("no Ray today")

    monkeypatch.setattr(launch.ray, "init", fake_init)
    if fails:
        with pytest.raises(RuntimeError, match="no Ray today"):
            launch.start_local_ray(num_cpus=1)
    else:
        launch.start_local_ray(num_cpus=1)
    assert seen["kwargs"] == {"address": "local", "num_cpus": 1}
    assert set(ADDED) <= set(seen["env"])
    assert dict(os.environ) == before
