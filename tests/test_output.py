"""Terminal tables and CSV: text left, numbers right, one format per number column, gaps shown as "-"."""
from __future__ import annotations

import csv

import pytest

from harness.common.errors import UserError
from harness.common.output import check_outputs, format_table, write_csv


def test_numbers_align_right_and_text_left():
    table = format_table(("name", "ms"), [("block", 1.5), ("embedding", 12.25)]).splitlines()
    assert table[0] == "name          ms"
    assert table[2] == "block       1.50"
    assert table[3] == "embedding  12.25"


def test_a_number_column_has_one_format():
    # the largest value gets four significant digits and every other float in the column the same decimals
    table = format_table(("what", "ms"), [("a", 38.8), ("b", 0.3895), ("c", 0.0004)]).splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["38.80", "0.39", "0.00"]
    table = format_table(("what", "ms"), [("a", 0.3895), ("b", 0.0123)]).splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["0.390", "0.012"]
    table = format_table(("what", "ms"), [("a", 12345.6), ("b", 2.25)]).splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["12,346", "2"]
    table = format_table(("what", "n"), [("a", 1234567), ("b", 2)]).splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["1,234,567", "2"]


def test_a_number_column_with_gaps_stays_right_aligned():
    table = format_table(("stage", "error %"), [(0, 12.5), (1, None), (2, "-")]).splitlines()
    assert [line[-7:] for line in table[2:]] == ["  12.50", "      -", "      -"]


def test_a_column_of_gaps_or_words_is_text():
    table = format_table(("what", "value"), [("a", "-"), ("b", None)]).splitlines()
    assert table[2] == "a     -" and table[3] == "b     -"
    table = format_table(("what", "value"), [("a", 1), ("b", "n/a")]).splitlines()
    assert table[2] == "a     1" and table[3] == "b     n/a"  # a word in it: the column is text, left-aligned


def test_csv_keeps_full_precision_and_leaves_gaps_empty(tmp_path):
    path = write_csv(tmp_path / "sub" / "t.csv", ("stage", "ms"), [(0, 0.123456789), (1, None)])
    assert list(csv.reader(path.open())) == [["stage", "ms"], ["0", "0.123456789"], ["1", ""]]


def test_an_unwritable_csv_is_bad_input(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write"):
        write_csv(tmp_path / "file" / "t.csv", ("a",), [(1,)])


def test_a_pseudo_file_system_states_no_free_space():
    """/proc states a size of 0: not a full disk, so nothing is refused for want of space there."""
    import shutil
    from pathlib import Path

    from harness.common.output import free_bytes

    if not Path("/proc").is_dir() or shutil.disk_usage("/proc").total:
        pytest.skip("no /proc stating a size of 0 on this system")
    assert free_bytes("/proc/none/x.h5") is None


@pytest.mark.parametrize("name", ["chart.txt", "chart"])
def test_a_chart_is_written_as_png_only(tmp_path, name):
    from analysis.plot import pyplot, save

    fig = pyplot().figure()
    with pytest.raises(UserError, match="charts are written as PNG; give a file name ending in .png"):
        save(fig, tmp_path / name)
    assert not list(tmp_path.iterdir())
    assert save(pyplot().figure(), tmp_path / "chart.png").is_file()


def test_a_trace_is_written_as_json_only(tmp_path):
    from analysis.perfetto import write_document

    with pytest.raises(UserError, match="a trace is written as FILE.json or FILE.json.gz"):
        write_document(tmp_path / "trace.txt", {"traceEvents": []})
    assert write_document(tmp_path / "trace.json.gz", {"traceEvents": []}).is_file()
    upper = write_document(tmp_path / "TRACE.JSON.GZ", {"traceEvents": []})  # a name check_name takes is gzipped
    assert upper.read_bytes()[:2] == b"\x1f\x8b"


def test_a_file_where_a_folder_should_be_is_said(tmp_path):
    from harness.common.output import write_csv

    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="a part of .*afile is a file, not a folder"):
        write_csv(tmp_path / "afile" / "out.csv", ("a",), [(1,)])


def test_outputs_are_checked_before_the_work(tmp_path):
    """check_outputs: an empty name, a folder, a path under a file, one of the inputs and two options at one path
    are refused, each naming its option; a missing folder (made when written) and a name that is not a file among
    the inputs (a launch's arguments) are not."""
    measured = tmp_path / "profile.h5"
    measured.write_bytes(b"measured")
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [({"--csv": ""}, "--csv: the file name is empty"),
             ({"--csv": str(tmp_path)}, "it is a folder"),
             ({"--png": str(blocker / "x.png")}, "is a file, not a folder"),
             ({"--out": str(measured)}, "which this command reads; writing it would lose it"),
             ({"--csv": str(tmp_path / "a.csv"), "--out": str(tmp_path / "a.csv")}, "--csv writes the same file")]
    for outputs, message in cases:
        with pytest.raises(UserError, match=message):
            check_outputs(outputs, [str(measured), "--num-layers " + "9" * 5000])
    with pytest.raises(UserError, match="profile.h5, which this command reads"):  # a folder: what is read in it
        check_outputs({"--csv": str(measured)}, [str(tmp_path)])
    check_outputs({"--csv": str(tmp_path / "new" / "a.csv"), "--png": None}, [str(measured), "h100-sxm"])
    check_outputs({"--png": str(tmp_path / "chart.png")}, [str(tmp_path)])  # a new file in an input folder
    with pytest.raises(UserError, match="--csv .*: cannot write it .File name too long"):  # not an OSError
        check_outputs({"--csv": str(tmp_path / ("a" * 300 + ".csv"))})
    assert measured.read_bytes() == b"measured" and not (tmp_path / "new").exists()


def test_the_launchers_rank_is_read_without_mpi():
    from harness.common.launch_env import launched_rank

    assert launched_rank({}) is None
    assert launched_rank({"PMI_RANK": "3", "PMI_SIZE": "4"}) == 3
    assert launched_rank({"OMPI_COMM_WORLD_RANK": "1"}) == 1
    assert launched_rank({"SLURM_PROCID": "2"}) is None  # a batch script's shell, not a step's task
    assert launched_rank({"SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}) == 2
    assert launched_rank({"PMI_RANK": ""}) is None  # a launcher's variable left empty: no rank said
