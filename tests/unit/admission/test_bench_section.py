"""bench.report rewrites only the given section of BENCHMARKS.md."""

from __future__ import annotations

from bench.report import TITLE, replace_section

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
