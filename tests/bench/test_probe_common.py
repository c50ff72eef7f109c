"""benchmarks/_common.py: the probes' command line."""

from __future__ import annotations

import json
import sys

import torch
from _common import probe_cli


def test_probe_cli_parses_measures_prints_and_writes(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "sub" / "probe.json"
    argv = ["probe", "random:tiny", "--repeats", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        probe_cli("A probe.\n\nMore.", lambda a: {"specs": a.specs, "repeats": a.repeats})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    written = json.loads(out.read_text())
    assert written == json.loads(capsys.readouterr().out)
    assert written["specs"] == ["random:tiny"] and written["repeats"] == 2
    assert written["threads"] == 1 and written["torch"] == torch.__version__
