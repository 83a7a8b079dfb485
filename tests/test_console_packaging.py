"""The console ships in the wheel: its template, stylesheet and script are package data, and no
page refers to anything outside the console's own origin."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ("runplane/engine/console/templates/base.html",
          "runplane/engine/console/static/console.css",
          "runplane/engine/console/static/console.js")


def test_the_wheel_carries_the_console_assets(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("runplane-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ASSETS:
        assert asset in names, asset


def test_no_asset_reaches_outside_the_console():
    for asset in ASSETS:
        text = (ROOT / "engine" / asset.split("engine/", 1)[1]).read_text()
        assert not re.search(r"https?://", text), asset
        assert "<script>" not in text and " style=" not in text, asset
