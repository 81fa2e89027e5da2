import os
import shutil
import tempfile

import torch

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


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # printed even under -q (pyproject's addopts), unlike a report header
        reporter.write_line(cache_note())


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["TIMLAB_CACHE"], ignore_errors=True)
