"""Save the figures embedded in a timlab HTML report as PNG files, named by their alt text.

    python scripts/report_figures.py demo_out/report.html OUT_DIR [--prefix demo_] [--only "validation accuracy,dose-response"]

The README's demo figures are made this way from a `timlab demo` report.
"""

from __future__ import annotations

import argparse
import base64
import html
import re
from pathlib import Path

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">')


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("out_dir")
    ap.add_argument("--prefix", default="")
    ap.add_argument("--only", help="comma-separated alt texts to keep (default: all)")
    args = ap.parse_args(argv)
    keep = None if args.only is None else {s.strip() for s in args.only.split(",")}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, int] = {}
    for data, alt in IMG.findall(Path(args.report).read_text()):
        alt = html.unescape(alt)
        if keep is not None and alt not in keep:
            continue
        stem = args.prefix + re.sub(r"[^a-z0-9]+", "_", alt.lower()).strip("_")
        seen[stem] = seen.get(stem, 0) + 1
        name = stem if seen[stem] == 1 else f"{stem}_{seen[stem]}"
        path = out / f"{name}.png"
        path.write_bytes(base64.b64decode(data))
        print(path)
    if not seen:
        ap.exit(1, f"report_figures.py: no figure matched in {args.report}\n")


if __name__ == "__main__":
    main()
