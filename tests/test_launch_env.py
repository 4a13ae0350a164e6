"""The environment a Ray started by `cluster serve` gets: Serve's HAProxy ingress on where
this Ray has it (`RAY_SERVE_ENABLE_HA_PROXY=0` keeps Serve's Python proxy), with free ports
for HAProxy's own listeners, a folder of its own and a short draining period, never over a
variable the user set, and this process's environment left as it was."""

import os

import pytest

from cluster.serve import launch

ADDED = (
    launch.HAPROXY_SWITCH,
    *launch.HAPROXY_DRAINING_S,
    *launch.HAPROXY_FORWARD_BODY,  # the route server reads each request's body
    *launch.HAPROXY_MAXCONN,  # Ray < 2.60's default needs more descriptors than allowed here
    *launch.HAPROXY_PORT_VARS,
    *launch.HAPROXY_FILE_VARS,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ADDED:
        monkeypatch.delenv(var, raising=False)


def test_haproxy_is_the_default_with_free_ports_and_a_folder_of_its_own():
    assert launch.haproxy_ingress_available()  # ray[serve] 2.60 on Linux installs it
    env = launch.local_ray_env()
    assert set(env) == set(ADDED) and env[launch.HAPROXY_SWITCH] == "1"
    ports = [int(env[var]) for var in launch.HAPROXY_PORT_VARS]
    # outside the ports the OS and Ray hand out by themselves, so none is taken before
    # HAProxy binds it
    assert all(p in launch.QUIET_PORTS for p in ports) and ports[0] != ports[1]
    folder = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert os.path.isdir(folder) and not os.listdir(folder)
    files = [env[var] for var, name in launch.HAPROXY_FILE_VARS.items() if name]
    assert all(os.path.dirname(f) == folder for f in files)
    # Serve puts a 56-character node id between the folder and a socket's name, and
    # HAProxy refuses socket paths over 97 characters
    assert all(len(f) + 57 <= 97 for f in files if f.endswith(".sock"))
    other = launch.local_ray_env()  # a second server on this machine
    assert other["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] != folder


def test_switched_off_nothing_is_added(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert launch.local_ray_env() == {}


def test_a_variable_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "12345")
    env = launch.local_ray_env()
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env and "RAY_SERVE_HAPROXY_METRICS_PORT" in env
    assert launch.HAPROXY_SWITCH not in env  # the user's own


def test_without_haproxy_serves_proxy_and_the_switch_is_an_error(monkeypatch):
    monkeypatch.setattr(launch, "haproxy_ingress_available", lambda: False)
    assert launch.local_ray_env() == {}  # Serve's Python proxy
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with pytest.raises(RuntimeError, match="no HAProxy ingress"):
        launch.local_ray_env()


@pytest.mark.parametrize("fails", [False, True])
def test_ray_init_sees_the_variables_and_this_process_keeps_its_own(monkeypatch, fails):
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
