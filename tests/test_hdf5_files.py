"""Every kind of file the project writes is checksummed, and every command that reads one refuses a damaged,
cut short, foreign or newer file with one message naming the file (exit 2), never a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from analysis.cli import main as analysis_main
from analysis.predict import predict
from analysis.timeline_file import read_timeline, write_timeline
from analysis.trace_reader import read_trace
from harness.commands.cli import main as harness_main
from harness.common.errors import UserError
from harness.plan.collectives import SizeResult
from harness.store.collectives_file import CollectivesRun, write_collectives
from harness.store.hdf5_io import LONG_ATTRS, LONG_TEXT_BYTES, create, open_file, read_attrs, set_attrs
from harness.store.hdf5_schema import PROFILE_KIND, READ_VERSIONS
from harness.store.profile_store import Measurement, read_measurements, write_rank_file
from harness.train.trace_writer import merge_traces
from tests.conftest import ROOT
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile
from tests.test_validate import write_scaled_trace


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """One file of each kind: a profile, a rank file, a trace with its rank files, a timeline."""
    spec = make_spec(pp=2, micro_batches=2, layers=2)
    profile = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"compute": 1e-3}, default=2e-4))
    prediction = predict(profile)
    (tmp_path / "run").mkdir()
    trace = write_scaled_trace(tmp_path / "run" / "trace.h5", prediction.timeline, 1.1)
    timeline = write_timeline(tmp_path / "timeline.h5", prediction.timeline, [0, 1])
    rank = write_rank_file(tmp_path / "rank-00000.h5", 0,
                           [Measurement("abc", "compute", {"kind": "compute"}, np.array([1e-3, 2e-3]), [0], "env")])
    bench = CollectivesRun(tmp_path / "collectives.h5", "mpi4py", "all", "intra", [0, 1], "float32", 100, 1,
                           {op: [SizeResult(op, 1024, "float32", 2, np.linspace(1e-5, 2e-5, 100), 0)]
                            for op in ("allreduce", "sendrecv")}, {"world_size": 2, "device": "cpu"})
    return {"profile": profile, "rank": rank, "trace": trace, "rank-trace": trace.parent / "rank-00000.trace.h5",
            "timeline": timeline, "collectives": write_collectives(bench.path, bench)}


def _datasets(path: Path) -> list[str]:
    """Every non-empty dataset of a file, after checking that every dataset is checksummed."""
    with h5py.File(path) as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert names and all(f[name].fletcher32 for name in names), f"{path}: a dataset without a checksum"
        return [name for name in names if f[name].size]


def _flip_data(path: Path, dataset: str, count: int = 1) -> None:
    """Flip `count` bytes in the middle of a dataset's stored data."""
    with h5py.File(path) as f:
        chunk = f[dataset].id.get_chunk_info(0)
    raw = bytearray(path.read_bytes())
    middle = chunk.byte_offset + chunk.size // 2
    for k in range(count):
        raw[middle - count // 2 + k] ^= 0xFF
    path.write_bytes(bytes(raw))


def _flip_text(path: Path, text: bytes) -> None:
    """Flip one byte of a piece of text the file stores (inside an attribute, so in an object header)."""
    raw = bytearray(path.read_bytes())
    at = raw.find(text)
    assert at >= 0, f"{text!r} is not in {path}"
    raw[at + len(text) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _readers(files: dict[str, Path]) -> dict[str, list]:
    """For each kind, the ways a user reads it: each a function that must raise UserError or exit 2."""
    def cli(main, *args):
        def run():
            assert main(list(args)) == 2
        return run
    return {
        "profile": [cli(analysis_main, "simulate", str(files["profile"])),
                    cli(harness_main, "show", str(files["profile"]))],
        "rank": [lambda: read_measurements(files["rank"])],
        "trace": [cli(analysis_main, "validate", str(files["trace"]), str(files["profile"]))],
        "rank-trace": [lambda: merge_traces(files["trace"].parent / "again.h5", [files["rank-trace"]],
                                            root_attrs={}, environment={}, clock={}, warmup=0, loss_ranks=[])],
        "timeline": [lambda: read_timeline(files["timeline"])],
        "collectives": [cli(analysis_main, "collectives", str(files["collectives"])),
                        cli(analysis_main, "simulate", str(files["profile"]), "--collectives",
                            str(files["collectives"]))],
    }


def _refused(reader, capsys, *words: str) -> str:
    try:
        reader()
    except UserError as exc:
        message = str(exc)
    else:
        message = capsys.readouterr().err
    assert "Traceback" not in message and all(word in message for word in words), message
    return message


KINDS = ("profile", "rank", "trace", "rank-trace", "timeline", "collectives")


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_sample_anywhere_is_found(files, capsys, kind):
    path = files[kind]
    datasets = _datasets(path)
    # the last measurement's samples: every dataset is verified at open, not only those a prediction reads
    samples = [name for name in datasets if name.endswith("samples_s")]
    _flip_data(path, (samples or datasets)[-1], count=200)
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(path), "damaged")


@pytest.mark.parametrize("kind,text", [("profile", b"spec_version"), ("rank", b"env_key"), ("trace", b"spec_version"),
                                       ("rank-trace", b"written_at"), ("timeline", b"strategy"),
                                       ("collectives", b"bus_factor")])
def test_a_flipped_byte_in_the_metadata_is_found(files, capsys, kind, text):
    _flip_text(files[kind], text)
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(files[kind]), "damaged")


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_cut_short_is_refused(files, capsys, kind):
    path = files[kind]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(path), "damaged")


@pytest.mark.parametrize("kind", KINDS)
def test_a_newer_schema_asks_for_an_upgrade(files, capsys, kind):
    with h5py.File(files[kind], "a") as f:
        f.attrs["schema_version"] = 99
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(files[kind]), "newer distsim-harness", "schema 99", "upgrade")


@pytest.mark.parametrize("kind", KINDS)
def test_foreign_and_non_hdf5_files_are_refused(files, capsys, kind):
    path = files[kind]
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(3)
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(path), "did not write")
    path.write_text("not hdf5 at all")
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(path), "not an HDF5 file")
    path.unlink()
    for reader in _readers(files)[kind]:
        _refused(reader, capsys, str(path), "no such file")


def test_a_file_of_another_kind_is_named_for_what_it_is(files, capsys):
    assert analysis_main(["simulate", str(files["rank"])]) == 2
    assert "per-rank file of `harness profile`" in capsys.readouterr().err
    assert analysis_main(["validate", str(files["profile"]), str(files["profile"])]) == 2
    err = capsys.readouterr().err
    assert "a merged profile" in err and "not a real run's trace" in err
    with pytest.raises(UserError, match="merged trace.h5"):
        read_trace(files["rank-trace"])


def test_a_damaged_rank_file_is_measured_again_not_fatal(files, capsys):
    from harness.profile.run import _stored

    _flip_data(files["rank"], "measurements/abc/samples_s")
    assert _stored(files["rank"].parent, "env") == {}
    assert "not reading" in capsys.readouterr().err


def test_text_too_long_for_a_header_is_a_checksummed_dataset(tmp_path):
    path = tmp_path / "long.h5"
    long = "x" * (LONG_TEXT_BYTES + 10)
    with create(path, PROFILE_KIND, 2) as f:
        set_attrs(f, {"spec_json": long, "short": "y", "list": [1, 2]})
    with open_file(path, PROFILE_KIND, READ_VERSIONS) as f:
        attrs = read_attrs(f, decode_json=True)
        assert LONG_ATTRS in f and "spec_json" not in f.attrs
    assert attrs["spec_json"] == long and attrs["short"] == "y" and attrs["list"] == [1, 2]
    _flip_text(path, b"xxxxxxxx")
    with pytest.raises(UserError, match="damaged"):
        with open_file(path, PROFILE_KIND, READ_VERSIONS):
            pass


def test_a_short_value_replaces_a_long_one(tmp_path):
    path = tmp_path / "long.h5"
    with create(path, PROFILE_KIND, 2) as f:
        set_attrs(f, {"spec_json": "x" * (LONG_TEXT_BYTES + 10)})
        set_attrs(f, {"spec_json": "short"})
    with open_file(path, PROFILE_KIND, READ_VERSIONS) as f:
        assert read_attrs(f)["spec_json"] == "short"


def test_a_stopped_write_leaves_no_file(tmp_path):
    path = tmp_path / "p.h5"
    with pytest.raises(RuntimeError):
        with create(path, PROFILE_KIND, 2):
            raise RuntimeError("stopped")
    assert list(tmp_path.iterdir()) == []


def test_show_reads_through_the_analysis_reader(files):
    """`harness show` on a damaged profile says what `analysis simulate` says (one reader, one message)."""
    _flip_data(files["profile"], _datasets(files["profile"])[0])
    show = subprocess.run([sys.executable, "-m", "harness", "show", str(files["profile"])], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    simulate = subprocess.run([sys.executable, "-m", "analysis", "simulate", str(files["profile"])],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert show.returncode == simulate.returncode == 2
    assert show.stderr.split("error: ", 1)[1] == simulate.stderr.split("error: ", 1)[1]
    assert json.dumps(show.stdout) == '""'


def test_an_error_of_the_readers_own_is_not_blamed_on_the_file(files, tmp_path):
    """open_file checks the file; what its caller does in the block (here: write elsewhere) keeps its own error."""
    with pytest.raises(OSError):
        with open_file(files["profile"], PROFILE_KIND, READ_VERSIONS):
            (tmp_path / "no" / "such" / "folder" / "x").write_text("")
    with pytest.raises(UserError, match="damaged or incomplete"):  # a part missing, read under `reading`
        from harness.store.hdf5_io import reading

        with open_file(files["profile"], PROFILE_KIND, READ_VERSIONS) as f, reading(files["profile"], PROFILE_KIND):
            f["no-such-group"]


@pytest.mark.parametrize("damage", ["content_json", "spec_list", "nan_sample", "no_samples", "text_number"])
def test_an_edited_profile_is_one_message(tmp_path, damage):
    """A profile whose measurement's content is no JSON, whose spec_json is a list, whose samples hold a NaN or
    none at all, or whose numeric attribute (NUMBER_ATTRS: a compute phase, a backward call) is text: UserError
    naming the file, not a traceback (nor a NaN prediction)."""
    import shutil

    import h5py

    from harness.common.errors import UserError
    from harness.store.profile_reader import load_profile

    path = shutil.copy(Path(__file__).parent / "data" / "pp2-profile.h5", tmp_path / "profile.h5")
    with h5py.File(path, "r+") as f:
        first = next(iter(f["measurements"].values()))
        if damage == "content_json":
            first.attrs["content_json"] = "{"
        elif damage == "nan_sample":
            first["samples_s"][0] = float("nan")
        elif damage == "no_samples":
            del first["samples_s"]
            first.create_dataset("samples_s", data=np.empty(0))
        elif damage == "text_number":
            first.attrs["compute_phase"] = "{junk"
        else:
            f.attrs["spec_json"] = "[1, 2]"
    with pytest.raises(UserError, match="not what docs/hdf5.md describes"):
        load_profile(path)


def test_an_edited_rank_file_is_measured_again_not_fatal(tmp_path, capsys):
    """A rank file whose numeric attribute was edited to text: read_measurements says so as bad input, and a
    resume measures what it held again (it had stopped the profile's set-up on every rerun)."""
    import shutil

    import h5py

    from harness.common.errors import UserError
    from harness.profile.run import _stored
    from harness.store.profile_store import read_measurements

    path = tmp_path / "rank-00000.h5"
    shutil.copy(Path(__file__).parent / "data" / "pp2-profile.h5", path)
    with h5py.File(path, "r+") as f:
        next(iter(f["measurements"].values())).attrs["compute_phase"] = "{junk"
    with pytest.raises(UserError, match="a measurement is not what docs/hdf5.md describes"):
        read_measurements(path)
    (tmp_path / "rank-00000.h5").rename(tmp_path / "profile.h5")
    assert _stored(tmp_path, "env") == {}
    assert "not reading profile.h5" in capsys.readouterr().err


@pytest.mark.parametrize("edit,said", [
    (lambda f: f.move("ops/allreduce", "ops/gossip"), "ops/gossip: not one of"),
    (lambda f: f.attrs.__setitem__("ranks", "[[["), "ranks must be a list"),
    (lambda f: f["ops/allreduce/samples_s"].__setitem__((0, 0), np.nan), "must be finite seconds above 0"),
    (lambda f: f["ops/allreduce/samples_s"].__setitem__((0, 0), 0.0), "must be finite seconds above 0"),
    (lambda f: f["ops/allreduce/bytes"].__setitem__(0, -8), "bytes must be 1 or more"),
    (lambda f: f["ops/allreduce/wrong"].__setitem__(0, -3), "wrong a count of 0 or more")])
def test_an_edited_collectives_file_is_refused_with_the_part_named(files, edit, said, capsys):
    """A collectives file whose parts are not what docs/hdf5.md describes (edited, its checksums kept whole): one
    message naming the part, exit 2, from the benchmark's own reader and the commands that read it."""
    path = files["collectives"]
    with h5py.File(path, "r+") as f:
        edit(f)
    assert analysis_main(["collectives", str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and str(path) in err and "Traceback" not in err
