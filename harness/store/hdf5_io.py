"""One way to write and read every HDF5 file of the project (layouts: docs/hdf5.md, docs/train.md,
docs/timeline.md). h5py and numpy only: the analysis reads with it offline.

Writing (`create`): a file is built in memory, then written whole under a temporary name beside its target
and renamed into place, so a reader never sees half a file and a stopped run keeps every file it finished.
HDF5 never writes to the disk itself: a full disk or a read-only folder is one UserError naming the folder,
the bytes the file needs and the bytes free (harness.common.output.write_failure), and no temporary is left. Every
file is written so that HDF5 itself detects damage:
- HDF5 1.10's file format, whose metadata (object headers, indexes) carries checksums, and which HDF5 1.10
  and later read;
- every dataset chunked with the fletcher32 checksum (`write_dataset`), text as fixed-length UTF-8
  (variable-length text lives in a heap without checksums and takes no filter);
- attributes kept in their object's header (checksummed), text as fixed-length UTF-8; text longer than
  LONG_TEXT_BYTES (an object header holds 64 KiB) goes to a checksummed dataset of the same name in the
  object's subgroup LONG_ATTRS, which `read_attrs` returns as the attribute.
Reading (`open_file`): the file's `kind` and `schema_version` are checked and, by default, every dataset
is read once, so that damage anywhere is found before any number is used. A missing, foreign, newer,
damaged or cut-short file is one UserError naming the file and what to do. The caller's reads in the block
are its own; `reading(path, kind)` around them turns a part that is missing (an incomplete file of the right
kind) into the same message, and should wrap reads only: an error in anything else it wraps would be blamed
on the file.
"""
from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from harness.common.errors import UserError
from harness.common.output import free_bytes, write_failure
from harness.store.hdf5_schema import HDF5_SIGNATURE, KIND_DESCRIPTIONS, MERGED_FILE_HINTS, MERGED_KINDS, REMEDIES

LONG_ATTRS = "long_attrs"
LONG_TEXT_BYTES = 60_000
# attributes stay in the (checksummed) object header up to this many per object, instead of HDF5's default
# of 8, beyond which they move to dense storage, where larger values have no checksum
MAX_COMPACT_ATTRIBUTES = 4096
CORE_BLOCK_BYTES = 1 << 20  # the in-memory file grows by this much at a time


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (a hidden name in the same folder)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries that writers killed mid-write left in `folder` (call it holding the folder's lock,
    harness.store.folder_lock, so that no live writer's is among them); returns those removed."""
    removed = []
    for tmp in folder.glob(".*.tmp-*"):
        if tmp.is_file() and tmp.name.rsplit(".tmp-", 1)[1].isdigit():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _creation_properties(plist_class) -> Any:
    plist = h5py.h5p.create(plist_class)
    plist.set_attr_phase_change(MAX_COMPACT_ATTRIBUTES, MAX_COMPACT_ATTRIBUTES - 1)
    return plist


@contextmanager
def create(path: str | Path, kind: str, version: int, attrs: Mapping[str, Any] | None = None
           ) -> Iterator[h5py.File]:
    """A new file of `kind` and schema `version` at `path`, built in memory and written into place when the block
    ends without an error (nothing is written if it raises)."""
    path = Path(path)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_V110)  # checksummed metadata, readable by 1.10+
    fapl.set_fapl_core(CORE_BLOCK_BYTES, False)  # in memory only: HDF5 cannot fail half-way on a full disk
    fid = h5py.h5f.create(str(path).encode(), h5py.h5f.ACC_TRUNC,
                          fcpl=_creation_properties(h5py.h5p.FILE_CREATE), fapl=fapl)
    with h5py.File(fid) as f:
        set_attrs(f, {"schema_version": version, "kind": kind, **(attrs or {})})
        yield f
        f.flush()
        image = fid.get_file_image()
    write_bytes_atomically(path, image)


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """`data` written to a temporary beside `path` (its folders made where missing, as every writer here makes
    them), then renamed into place; checked against the free space first. A failure removes the temporary and is
    a UserError (harness.common.output.write_failure)."""
    tmp = temporary_path(path)
    free = free_bytes(path.parent)
    if free is not None and free < len(data):
        raise write_failure(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), needed=len(data), free=free)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_failure(path, exc, needed=len(data)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


GROUP_CREATION = _creation_properties(h5py.h5p.GROUP_CREATE)


def create_group(parent: h5py.Group, name: str) -> h5py.Group:
    """A subgroup whose attributes stay in its checksummed header."""
    h5py.h5g.create(parent.id, name.encode(), gcpl=GROUP_CREATION)
    return parent[name]


def _is_text(values: np.ndarray) -> bool:
    return values.dtype.kind in "OUS"


def _fixed_text(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    encoded = [str(v if not isinstance(v, bytes) else v.decode()).encode() for v in np.ravel(values)]
    width = max([1] + [len(e) for e in encoded])
    return np.array(encoded, dtype=h5py.string_dtype("utf-8", width)).reshape(np.shape(values))


def write_dataset(group: h5py.Group, name: str, values: Any, dtype: Any = None) -> h5py.Dataset:
    """A numeric dataset (one-element for a scalar: scalar datasets take no checksum), chunked with the
    fletcher32 checksum."""
    data = np.asarray(values, dtype=dtype)
    if _is_text(data):
        raise TypeError(f"{name}: text goes through write_text")
    return group.create_dataset(name, data=data.reshape(1) if data.ndim == 0 else data, fletcher32=True)


def write_text(group: h5py.Group, name: str, values: Sequence[Any] | np.ndarray) -> h5py.Dataset:
    """A text column (every value as str), fixed-length UTF-8, chunked with the fletcher32 checksum."""
    return group.create_dataset(name, data=_fixed_text(np.asarray(values, dtype=object).reshape(-1)),
                                fletcher32=True)


def _attribute_value(value: Any) -> Any:
    """What HDF5 stores for one attribute: numbers as they are, booleans as 0/1, text (and JSON of lists and
    dicts) as fixed-length UTF-8."""
    if isinstance(value, (bool, np.bool_)):
        return np.int64(int(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value
    if not isinstance(value, (str, bytes)):
        value = json.dumps(value)
    return _fixed_text(value)


def set_attrs(obj: h5py.Group | h5py.Dataset, values: Mapping[str, Any]) -> None:
    """Set attributes (rules in the module docstring); text too long for the header becomes a dataset."""
    for key, value in values.items():
        stored = _attribute_value(value)
        if isinstance(stored, np.ndarray) and stored.dtype.kind == "S" and stored.dtype.itemsize > LONG_TEXT_BYTES:
            long = obj[LONG_ATTRS] if LONG_ATTRS in obj else create_group(obj, LONG_ATTRS)
            if key in long:
                del long[key]
            long.create_dataset(key, data=stored.reshape(1), fletcher32=True)
            if key in obj.attrs:
                del obj.attrs[key]
            continue
        if isinstance(obj, h5py.Group) and LONG_ATTRS in obj and key in obj[LONG_ATTRS]:
            del obj[LONG_ATTRS][key]  # else read_attrs would return the old long value
        obj.attrs[key] = stored


def plain(value: Any) -> Any:
    """An attribute or dataset element as plain Python: bytes decoded, numpy scalars unwrapped."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_attrs(obj: h5py.Group | h5py.Dataset, decode_json: bool = False) -> dict[str, Any]:
    """An object's attributes as plain data (and the long ones kept as datasets); with `decode_json`, text
    that is a JSON list or object is decoded."""
    out = {key: plain(value) for key, value in obj.attrs.items()}
    if isinstance(obj, h5py.Group) and LONG_ATTRS in obj:
        for key, ds in obj[LONG_ATTRS].items():
            out[key] = plain(ds[0])
    if decode_json:
        for key, value in out.items():
            if isinstance(value, str) and value[:1] in "[{":
                try:
                    out[key] = json.loads(value)
                except ValueError:
                    pass
    return out


def read_attr(obj: h5py.Group, key: str) -> Any:
    """One attribute as plain data, whether in the header or (long text) in LONG_ATTRS; KeyError if absent."""
    if key in obj.attrs:
        return plain(obj.attrs[key])
    return plain(obj[LONG_ATTRS][key][0])


def read_environment(f: h5py.File) -> dict[str, Any]:
    """A profile's or trace's /environment attributes as plain data, JSON values decoded; {} without it."""
    return read_attrs(f["environment"], decode_json=True) if "environment" in f else {}


def read_column(ds: h5py.Dataset) -> np.ndarray:
    """A dataset's values; text as an object array of str."""
    if h5py.check_string_dtype(ds.dtype) is not None:
        return ds.asstr()[()].astype(object)
    return ds[()]


def read_text(ds: h5py.Dataset) -> list[str]:
    return [str(s) for s in ds.asstr()[()]]


def verify(f: h5py.File) -> None:
    """Read every dataset once: HDF5 checks each chunk's checksum (and, opening each object, its header's)."""
    def visit(_: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            obj[()]
        else:
            obj.attrs.keys()
    f.visititems(visit)


def _damage(exc: BaseException) -> bool:
    """Whether an exception is h5py reporting a file it cannot read (raised inside h5py; not a bug of ours)."""
    if isinstance(exc, OSError):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("h5py")


@contextmanager
def reading(path: Path, kind: str) -> Iterator[None]:
    """Turn h5py's errors while reading `path`, a file of `kind`, into one message naming the file and what
    to do."""
    remedy = REMEDIES[kind]
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not _damage(exc):
            raise
        reason = str(exc).strip().strip("'\"") or type(exc).__name__
        raise UserError(f"{path}: damaged or incomplete: {reason} (a checksum failed, the file was cut short, "
                        f"or a part is missing); {remedy}") from None


def check_replaceable(path: str | Path, kind: str, option: str) -> None:
    """UserError where writing a file of `kind` at `path` would replace something else: an existing file that is
    not one of this project's HDF5 files of that kind (a run's trace, a spec, another tool's data). A missing
    path, or a file of `kind` (the same command's earlier output), may be written."""
    path = Path(path)
    if not path.is_file():
        return
    found = "a file that is not HDF5"
    try:
        with path.open("rb") as raw:
            if raw.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                with h5py.File(path, "r") as f:
                    other = f.attrs.get("kind")
                other = other.decode() if isinstance(other, bytes) else other
                if other == kind:
                    return
                found = describe_kind(str(other)) if other else "an HDF5 file of another tool"
    except (OSError, ValueError):
        found = "a file that cannot be read"
    raise UserError(f"{option} {path}: exists and is {found}; writing {describe_kind(kind)} there would replace "
                    "it: give another name")


def describe_kind(kind: str) -> str:
    return KIND_DESCRIPTIONS.get(kind, f"a file of kind {kind!r}")


@contextmanager
def open_file(path: str | Path, kinds: str | Sequence[str], versions: Sequence[int], *, verify_all: bool = True
              ) -> Iterator[h5py.File]:
    """Open `path` for reading as one of `kinds` of one of schema `versions`; every problem is a UserError
    naming the file and what to do (harness.store.hdf5_schema.REMEDIES; module docstring)."""
    path = Path(path)
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    remedy = REMEDIES[kinds[0]]
    wanted = " or ".join(describe_kind(k) for k in kinds)
    if not path.exists():
        raise UserError(f"{path}: no such file; {remedy}")
    if path.is_dir():
        raise UserError(f"{path} is a folder, not {wanted}; {remedy}")
    try:
        with path.open("rb") as raw:
            head = raw.read(len(HDF5_SIGNATURE))
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror}); {remedy}") from None
    if head != HDF5_SIGNATURE:
        raise UserError(f"{path}: not an HDF5 file, so not {wanted}; {remedy}")
    with reading(path, kinds[0]):
        f = h5py.File(path, "r")
    with f:
        with reading(path, kinds[0]):
            _check(f, path, kinds, versions, wanted, remedy, verify_all)
        yield f  # the caller's own errors are its own: wrap its reads in `reading` where a part may be missing


def _check(f: h5py.File, path: Path, kinds: tuple[str, ...], versions: Sequence[int], wanted: str, remedy: str,
           verify_all: bool) -> None:
    """open_file's checks of an open file: its kind and schema version, and (verify_all) every dataset."""
    attrs = read_attrs(f)
    kind = attrs.get("kind")
    if kind is None:
        raise UserError(f"{path}: an HDF5 file that distsim-harness did not write (no `kind`), not {wanted}; "
                        f"{remedy}")
    if kind not in kinds:
        hint = (MERGED_FILE_HINTS[kind] if MERGED_KINDS.get(kind) in kinds  # a rank's file where its merged one goes
                else "check which file goes where (--help)")
        raise UserError(f"{path} is {describe_kind(kind)}, not {wanted}; {hint}")
    version = attrs.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise UserError(f"{path}: schema_version {version!r} is not a version number; {remedy}")
    if version > max(versions):
        raise UserError(f"{path}: written by a newer distsim-harness ({describe_kind(kind)} schema {version}; "
                        f"this version reads {', '.join(map(str, versions))}); upgrade distsim-harness to read it")
    if version not in versions:
        raise UserError(f"{path}: schema {version} of {describe_kind(kind)} is no longer read (this version reads "
                        f"{', '.join(map(str, versions))}); {remedy}")
    if verify_all:
        verify(f)
