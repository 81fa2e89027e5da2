"""SIGTERM handled like Ctrl-C: ``kill``, ``docker stop`` and preemption send SIGTERM, whose default
action ends the process at once, leaving a run's status.json at ``running`` forever.
``handle_sigterm()`` makes SIGTERM raise ``Terminated`` (a ``KeyboardInterrupt``), so every
``finally`` and every handler of Ctrl-C runs: the run records ``failed`` with the step it reached
and releases its lock, and a resume continues from its last checkpoint bit for bit.
"""

from __future__ import annotations

import signal
import threading


class Terminated(KeyboardInterrupt):
    """The process got SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated("stopped by SIGTERM")


def _raise_once(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if signum == signal.SIGTERM:
        raise Terminated("stopped by SIGTERM")
    raise KeyboardInterrupt


def interrupt_once() -> None:
    """For a sweep's worker processes: the first SIGINT or SIGTERM raises (``KeyboardInterrupt``,
    ``Terminated``) and later ones are ignored, so the handler recording the run's status is not
    itself cut short (Ctrl-C reaches a worker from the terminal and again from the sweep)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _raise_once)
        signal.signal(signal.SIGTERM, _raise_once)


def handle_sigterm() -> None:
    """Install the SIGTERM handler (only the main thread may install one; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


__all__ = ["Terminated", "handle_sigterm", "interrupt_once"]
