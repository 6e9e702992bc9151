"""Terminal tables: text left, numbers right, gaps in a number column shown as "-" without breaking it."""
from __future__ import annotations

from harness.tables import format_table


def test_numbers_align_right_and_text_left():
    table = format_table(("name", "ms"), [("block", 1.5), ("embedding", 12.25)]).splitlines()
    assert table[0] == "name          ms"
    assert table[2] == "block        1.5"
    assert table[3] == "embedding  12.25"


def test_a_number_column_with_gaps_stays_right_aligned():
    table = format_table(("stage", "error %"), [(0, 12.5), (1, None), (2, "-")]).splitlines()
    assert [line[-7:] for line in table[2:]] == ["   12.5", "      -", "      -"]


def test_a_column_of_gaps_or_words_is_text():
    table = format_table(("what", "value"), [("a", "-"), ("b", None)]).splitlines()
    assert table[2] == "a     -" and table[3] == "b     -"
    table = format_table(("what", "value"), [("a", 1), ("b", "n/a")]).splitlines()
    assert table[2] == "a     1" and table[3] == "b     n/a"  # a word in it: the column is text, left-aligned
