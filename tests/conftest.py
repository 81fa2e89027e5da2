"""Session setup: one torch thread, OpenMP threads that sleep when idle, one SFT warm-start cache.

Under pytest-xdist (``make test`` runs ``pytest -n 2``) the controller makes the cache folder,
hands its path to every worker (``pytest_configure_node``) and deletes it once all workers are
done; two workers that need the same warm start at once are serialized by the lock that
``timlab.trainer.pretrain`` takes around each cache entry, which it fills through a partial folder
and a rename, so a reader never sees half a model.
"""

import os
import shutil
import tempfile

# Set before torch loads its OpenMP runtime, which reads it once. Waiting threads sleep instead of
# spinning: on a shared machine (another test worker, a sweep) a spinning thread takes the core
# the working one needs (a 2-thread rollout: 10.0 s against 1.1 s; bench/RESULTS.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import timlab.model  # noqa: E402,F401  (the exact path's MKL/oneDNN settings, before any test module's first matmul)

torch.set_num_threads(1)

# One warm-start cache per test session: the smoke model is pretrained once, never downloaded, and
# nothing is written to the user's cache (~/.cache/timlab) unless TIMLAB_CACHE points there.
_OWN_CACHE = "TIMLAB_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["TIMLAB_CACHE"] = tempfile.mkdtemp(prefix="timlab-test-cache-")


def cache_note() -> str:
    """The line each test session starts with: where its SFT warm starts go."""
    where = "a temporary folder, deleted at the end" if _OWN_CACHE else "from the environment"
    return f"timlab: SFT warm starts cached in {os.environ['TIMLAB_CACHE']} (TIMLAB_CACHE: {where})"


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller configures each worker
def pytest_configure_node(node):
    node.workerinput["timlab_cache"] = os.environ["TIMLAB_CACHE"]
    node.workerinput["timlab_own_cache"] = _OWN_CACHE


def pytest_configure(config):
    """An xdist worker uses the controller's cache, whose path it usually inherits; a folder its
    own import made (an environment that was not inherited) is removed."""
    global _OWN_CACHE
    if not _is_worker(config):
        return
    shared = config.workerinput["timlab_cache"]
    if _OWN_CACHE and os.environ["TIMLAB_CACHE"] != shared:
        shutil.rmtree(os.environ["TIMLAB_CACHE"], ignore_errors=True)
    os.environ["TIMLAB_CACHE"] = shared
    _OWN_CACHE = config.workerinput["timlab_own_cache"]


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not _is_worker(session.config):  # printed even under -q, unlike a header
        reporter.write_line(cache_note())


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE and not _is_worker(session.config):  # the controller, after every worker is done
        shutil.rmtree(os.environ["TIMLAB_CACHE"], ignore_errors=True)


@pytest.fixture
def device_loop_calls(monkeypatch) -> list:
    """The ``loop`` argument of every ``device_loop.generate`` call made in the test, in order
    (the calls still run)."""
    from timlab.engines import device_loop

    calls = []
    real = device_loop.generate
    monkeypatch.setattr(device_loop, "generate", lambda *a, **k: calls.append(k["loop"]) or real(*a, **k))
    return calls
