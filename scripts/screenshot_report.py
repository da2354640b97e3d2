#!/usr/bin/env python3
"""Render an HTML report to PNG with headless Chromium (Debian's `chromium`), offline.

    python scripts/screenshot_report.py results/report.html /tmp/report.png [--width 1400] [--height 2400]
        [--section samples] [--scale 1.5]

``--section ID`` renders only that section of the report (e.g. ``samples``, ``providers``), to look
at one part closely; ``--scale`` is Chromium's device scale factor.

Exits 2 when no Chromium is on PATH. Used by tests/test_report.py (skipped without Chromium) and by
hand to look at a report.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: str | Path, png: str | Path, width: int = 1400, height: int = 2400, timeout: float = 120.0,
               chromium: str | None = None, section: str | None = None, scale: float = 1.0) -> Path:
    """Render ``html`` (a local file) to ``png``; raises RuntimeError when Chromium fails."""
    exe = chromium or find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH (apt-get install chromium)")
    html, png = Path(html).resolve(), Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    if png.exists():
        png.unlink()
    with tempfile.TemporaryDirectory(prefix="eagledata-chromium-") as profile:
        page = html
        if section:  # a copy beside the original (relative links keep working) showing one section
            text = html.read_text(encoding="utf-8")
            style = f"<style>main > *:not(#{section}) {{ display: none !important; }}</style>"
            page = html.with_name(f".{html.stem}.{section}.screenshot.html")
            page.write_text(text.replace("</head>", style + "</head>", 1), encoding="utf-8")
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}",
               f"--force-device-scale-factor={scale}", f"--window-size={width},{height}", page.as_uri()]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        finally:
            if page != html:
                page.unlink(missing_ok=True)
    if proc.returncode != 0 or not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=2400)
    ap.add_argument("--section", help="render only this section id (samples, providers, reasons, ...)")
    ap.add_argument("--scale", type=float, default=1.0, help="device scale factor")
    args = ap.parse_args(argv)
    if find_chromium() is None:
        print("screenshot_report: no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 2
    out = screenshot(args.html, args.png, args.width, args.height, section=args.section, scale=args.scale)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
