"""The hosting processes' garbage-collector tuning (`cli.collector`)."""

from __future__ import annotations

import gc
import signal
import sys

import pytest

from runplane.cli import collector
from runplane.cli.main import main as runplane_main
from runplane.cli.commands import COMMANDS


def test_tuning_freezes_and_raises_thresholds_and_restores():
    try:
        collector.tune_for_hosting()
        assert gc.get_threshold() == collector.HOSTING_THRESHOLDS
        assert gc.get_freeze_count() > 0
        assert gc.isenabled()
    finally:
        collector.restore_defaults()
    assert gc.get_threshold() == collector.DEFAULT_THRESHOLDS
    assert gc.get_freeze_count() == 0


def test_every_hosting_command_exists_and_read_only_ones_are_left_alone():
    assert collector.HOSTING_COMMANDS <= set(COMMANDS)
    assert {"status", "runs", "doctor", "token"}.isdisjoint(collector.HOSTING_COMMANDS)


def test_cycles_are_still_collected_when_tuned():
    class Node:
        pass

    try:
        collector.tune_for_hosting()
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect(0) >= 2  # a young collection reclaims the cycle
    finally:
        collector.restore_defaults()


@pytest.mark.parametrize("command, tuned", [("supervise", True), ("token", False)])
def test_the_process_command_tunes_only_hosting_commands(monkeypatch, command, tuned):
    calls = []
    handler, configure, help = COMMANDS[command]
    monkeypatch.setitem(COMMANDS, command, (lambda args: 0, configure, help))
    monkeypatch.setattr(collector, "tune_for_hosting", lambda: calls.append(command))
    monkeypatch.setattr(sys, "argv", ["runplane", command])
    sigint = signal.getsignal(signal.SIGINT)
    try:
        assert runplane_main() == 0  # the process's own command (argv from sys.argv)
        assert runplane_main([command]) == 0  # called from Python: never tuned
    finally:
        signal.signal(signal.SIGINT, sigint)  # main() ignores SIGINT as a process exits
    assert calls == ([command] if tuned else [])
