"""Rebuild wikitext-2.txt from the WikiText-2 *test* split (as tokenized by its authors).

Takes the articles from line 2992 (" = Manila = ") to the end, drops the section headings and writes
one paragraph per blank-line-separated block, the unit qpipe's text reader takes as one sample.

    python calibration/make_wikitext.py ../shared/data/wikitext-2/test.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FIRST_LINE = 2992
HEADING = re.compile(r" (= )+.*( =)+ ")
OUT = Path(__file__).with_name("wikitext-2.txt")


def paragraphs(source: Path) -> list[str]:
    lines = source.read_text(encoding="utf-8").split("\n")[FIRST_LINE - 1 :]
    return [line.strip() for line in lines if line.strip() and not HEADING.fullmatch(line)]


def main() -> None:
    body = paragraphs(Path(sys.argv[1]))
    OUT.write_text("\n\n".join(body) + "\n", encoding="utf-8")
    print(f"wrote {len(body)} paragraphs to {OUT}")


if __name__ == "__main__":
    main()
