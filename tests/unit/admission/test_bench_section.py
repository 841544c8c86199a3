"""bench.report rewrites only the given section of BENCHMARKS.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.report import TITLE, publish, replace_section

NEW = "## Admission\n\nnew figures\n"


def test_appends_to_an_empty_or_foreign_document() -> None:
    assert replace_section("", NEW) == TITLE + "\n" + NEW
    assert replace_section("# Benchmarks\n\n## Engine\n\nx\n", NEW) == (
        "# Benchmarks\n\n## Engine\n\nx\n\n" + NEW
    )


def test_replaces_only_the_admission_section() -> None:
    document = "# Benchmarks\n\n## Engine\n\ne\n\n## Admission\n\nold\n\n## Disagg\n\nd\n"
    assert replace_section(document, NEW) == (
        "# Benchmarks\n\n## Engine\n\ne\n\n## Admission\n\nnew figures\n\n## Disagg\n\nd\n"
    )
    last = "# Benchmarks\n\n## Admission\n\nold\n"
    assert replace_section(last, NEW) == "# Benchmarks\n\n" + NEW


def test_a_longer_heading_is_another_section() -> None:
    document = "# Benchmarks\n\n## Admission load\n\nkept\n"
    assert replace_section(document, NEW) == document + "\n" + NEW


def test_publish_writes_the_json_the_png_and_only_its_own_section(tmp_path: Path) -> None:
    document = tmp_path / "BENCHMARKS.md"
    document.write_text(TITLE + "\n## Other\n\nkept\n")
    drawn: list[Path] = []

    def draw(report: Any, path: Path) -> None:
        drawn.append(path)
        path.write_bytes(b"png")

    said = publish("demo", {"x": 1}, "## Demo\n\nfigures\n", draw, tmp_path, document)
    assert json.loads((tmp_path / "demo.json").read_text()) == {"x": 1}
    assert drawn == [tmp_path / "demo.png"] and (tmp_path / "demo.png").read_bytes() == b"png"
    text = document.read_text()
    assert "## Other\n\nkept" in text and text.rstrip().endswith("## Demo\n\nfigures")
    assert said == f"wrote {tmp_path / 'demo.json'}, {tmp_path / 'demo.png'} and the 'Demo' section"
