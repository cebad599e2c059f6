"""The output protocol: how hf_lmc writes a folder without ever losing a user's file (docs/design.md §6).

* **Marker.** Every folder hf_lmc writes (a merge, the demo, a recipe's output, a training-state
  folder, a zoo member) carries :data:`MARKER`, which lists the files hf_lmc put there.
  ``--overwrite`` replaces only such a folder, and only while it holds nothing the marker does not
  list (:func:`check_replaceable`): a user's note, sources or ``.git/`` make it refused.
* **Apart.** Every path a run reads is compared with every path it writes by resolved path and
  by ``(st_dev, st_ino)`` of the paths, their ancestors and descendants (:func:`check_apart`), so
  a symlink, a hard link or a bind mount of an input is caught like the input itself.
* **Swap.** A folder is written into a hidden sibling (:func:`staging_folder`) and moved onto the
  output at the end (:func:`move_into_place`): in one ``renameat2(RENAME_EXCHANGE)`` where the
  kernel and filesystem have it, else by two renames with signals deferred between them. At
  every point either the old or the new folder is whole at the output path, or set aside whole
  in a debris folder from which the next run restores it.
* **Debris.** Staging and set-aside folders are named ``.NAME.tmp-PID-xxxxxxxx`` and
  ``.NAME.old-PID-xxxxxxxx``, and the run that made one holds an advisory lock (``flock``) on it
  until it is done with it. A later run (:func:`clean_stale`) tidies only the folders whose lock
  it can take (their run is dead: the kernel drops a dead process's locks, in any PID namespace),
  and finds them by exact name (``os.scandir`` and a prefix, never a glob of the user's name).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from hf_lmc.config.options import OutputExistsError, ParameterError
from hf_lmc.version import __version__

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, so no debris is ever taken for dead
    fcntl = None

#: The file hf_lmc writes into every folder it writes: who wrote it, and which files are its own.
MARKER = ".hf-lmc.json"
#: What kinds of folder carry the marker.
KINDS = ("merge", "demo", "recipe", "training-state", "zoo", "moved", "adapter", "aligned")
#: Files that marked a folder as hf_lmc's before :data:`MARKER` existed (the demo's record, a
#: zoo member's training record): such a folder is replaceable while it holds only the files
#: of a checkpoint folder hf_lmc writes.
_LEGACY_MARKERS = ("hf_lmc_demo.json", "zoo.json")
_LEGACY_FILES = re.compile(
    r"config\.json|generation_config\.json|README\.md|loss_along_path\.png|loss_over_simplex\.png"
    r"|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|tokenizer(_config)?\.json|tokenizer\.model"
    r"|special_tokens_map\.json|vocab\.json|merges\.txt|added_tokens\.json|chat_template\.jinja"
    r"|preprocessor_config\.json"
)
#: What follows ``.NAME.KIND-`` in a debris folder's name: the PID (for people; liveness is the
#: lock) and ``mkdtemp``'s random part.
_DEBRIS_SUFFIX = re.compile(r"\d+-[a-z0-9_]+")
#: Debris kinds, in the order :func:`clean_stale` tidies them: a set-aside old folder first (it
#: may be all that is left of the output), then staging folders, then folders still being named.
_DEBRIS_KINDS = ("old", "tmp", "new")
#: How many entries a message lists, and how many a walk looks at before it stops.
_SHOWN = 5
_WALKED = 10_000
_DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

_held: dict[Path, int] = {}  # debris folder -> the descriptor holding its lock
_held_guard = threading.Lock()


# -- the marker ------------------------------------------------------------------------------


def mark(folder: str | Path, kind: str, moved_by: dict | None = None) -> Path:
    """Write :data:`MARKER` into ``folder``, listing every file now under it (relative paths,
    sorted), and for a model or adapter ``hf-lmc apply`` moved, the transform that moved it
    (``moved_by``, JSON); written to a temporary file and renamed, so it is whole or absent.
    Returns its path."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}; choose from {KINDS}")
    folder = Path(folder)
    files = sorted(path for path in _files_under(folder) if path not in (MARKER, _MARKER_PARTIAL))
    record = {"written_by": "hf-lmc", "version": __version__, "kind": kind, "files": files}
    if moved_by is not None:
        record["moved_by"] = moved_by
    partial = folder / _MARKER_PARTIAL
    partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, folder / MARKER)
    return folder / MARKER


_MARKER_PARTIAL = MARKER + ".partial"


def read_marker(folder: str | Path) -> dict | None:
    """The marker of ``folder`` (``None`` when it has none, or one hf_lmc did not write)."""
    try:
        record = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or record.get("written_by") != "hf-lmc"
        or not isinstance(record.get("files"), list)
    ):
        return None
    return record


def check_replaceable(folder: str | Path, what: str, *, kinds: Collection[str] | None = None) -> None:
    """Return if ``folder`` may be replaced: it does not exist, is an empty folder, or is a folder
    hf_lmc wrote (of one of ``kinds``, any by default) holding no file its marker does not list.
    Else raise :class:`OutputExistsError` naming ``folder`` and the entries that are not hf_lmc's;
    ``what`` is the parameter that names the folder."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        return
    if folder.is_symlink() or not folder.is_dir():
        thing = _what_is(folder)
        raise OutputExistsError(
            f"{{}} {_given(folder)} is {thing}, not a folder hf-lmc wrote; name another folder", what
        )
    record = read_marker(folder)
    if record is not None and kinds is not None and record.get("kind") not in kinds:
        found, wanted = _given(str(record.get("kind")), 40), " or ".join(kinds)
        raise OutputExistsError(
            f"{{}} {_given(folder)} holds a {found} hf-lmc wrote, not a {wanted} folder; name another one", what
        )
    legacy = kinds is None or bool(
        {"demo", "zoo"} & set(kinds)
    )  # the kinds whose folders an older hf_lmc marked its own way
    foreign = _foreign_entries(folder, record, legacy=legacy)
    if not foreign:
        return
    listed = ", ".join(_given(name, 80) for name in foreign[:_SHOWN]) + (
        f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
    )
    why = "holds files hf-lmc did not write" if record is not None else "is not a folder hf-lmc wrote"
    raise OutputExistsError(f"{{}} {_given(folder)} {why} ({listed}); move them away or name another folder", what)


def is_empty_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder (not a link to one) with nothing in it: an output may be one
    without ``--overwrite``, as ``save_pretrained`` and mergekit take one. The new folder is
    renamed onto it only while it is still empty (:func:`move_into_place`), and a run that fails
    leaves it as it was."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _what_is(path: Path) -> str:
    """What an existing path that is no plain folder is, for a message."""
    if path.is_symlink():
        return "a symbolic link" if path.exists() else "a dangling symbolic link"
    return "a file" if path.is_file() else "not a folder"


def check_output_folder(
    output: str | Path,
    read: Iterable[str | Path],
    what: str = "output",
    *,
    overwrite: bool = False,
    kinds: Collection[str] | None = None,
) -> Path:
    """The output protocol's checks of a folder to write, before any work (docs/design.md §6):
    a path that can be replaced at all (:func:`check_output_path`), what a dead run set aside put
    back first (:func:`clean_stale`: it is the user's folder, and judged as such), an existing
    folder only with ``overwrite`` and only one hf_lmc wrote (of ``kinds``), or an empty folder
    (:func:`is_empty_folder`, taken as ``save_pretrained`` takes one), and apart from every path
    the command ``read``s (:func:`check_apart`). Returns ``output`` as a path."""
    output = Path(output)
    check_output_path(output, what)
    clean_stale(output)
    if os.path.lexists(output) and not overwrite and not is_empty_folder(output):
        raise OutputExistsError(f"{_given(output)} already exists; pass {{}} to replace it", "overwrite")
    check_apart(output, read, what)
    if overwrite:
        check_replaceable(output, what, kinds=kinds)
    return output


# -- single files: text, plots ---------------------------------------------------------------


def write_new_text(path: str | Path, text: str, what: str) -> bool:
    """Write ``text`` (UTF-8) as a new file at ``path``, whole or not at all (a hidden sibling
    linked into place), with the umask's permissions. A file already there holding exactly
    ``text`` is left as it is (returns ``False``); any other entry there is refused
    (:class:`OutputExistsError` naming ``what``), never replaced. Returns whether it wrote."""
    path = Path(path)
    data = text.encode("utf-8")
    if os.path.lexists(path):
        if _plain_file(path) and path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
        raise OutputExistsError(f"{{}} {_given(path)} already exists; move it away or name another folder", what)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    partial = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        _as_umask_allows(partial, 0o666)
        try:
            os.link(partial, path)  # fails where path appeared meanwhile: nothing is replaced
        except FileExistsError:
            raise OutputExistsError(
                f"{{}} {_given(path)} was written by another program meanwhile; move it away or name another folder",
                what,
            ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return True


#: What a figure hf_lmc saves says wrote it, in the metadata its format keeps (PNG ``Software``,
#: PDF and SVG ``Creator``): ``--overwrite`` replaces a file only if it carries this.
FIGURE_SIGNATURE = "hf-lmc figure"
#: The figure formats a plot is written in, by file suffix, and the metadata key that signs it.
FIGURE_FORMATS = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}
_SIGNATURE_WINDOW = 1 << 16  # bytes: the metadata sits near a figure file's start (PNG, SVG) or end (PDF)


def check_figure_path(path: str | Path, read: Iterable[str | Path], what: str, *, overwrite: bool = False) -> Path:
    """Refuse, before any work, a figure path the command could not write when it is done: a
    format :data:`FIGURE_FORMATS` lacks, a folder that does not exist, an existing file that is
    not a figure hf_lmc wrote (any existing file without ``overwrite``), or a path that is or
    lies inside one of the inputs the command ``read``s."""
    path = Path(path)
    if path.suffix.lower() not in FIGURE_FORMATS:
        formats = ", ".join(FIGURE_FORMATS)
        raise ParameterError(f"{{}} {_given(path)}: a figure is written as {formats}; end the name with one", what)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ParameterError(f"{{}} {_given(path)}: no folder {_given(folder)} to write it in", what)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ParameterError(f"{{}} {_given(path)}: the folder {_given(folder)} is not writable", what)
    if os.path.lexists(path):
        if path.is_symlink() or not path.is_file():
            raise ParameterError(f"{{}} {_given(path)} is {_what_is(path)}; name a file to write", what)
        if not overwrite:
            raise OutputExistsError(f"{_given(path)} already exists; pass {{}} to replace it", "overwrite")
        if not is_hf_lmc_figure(path):
            raise OutputExistsError(
                f"{{}} {_given(path)} is not a figure hf-lmc wrote; move it away or name another file", what
            )
    check_apart(path, read, what)
    return path


def is_hf_lmc_figure(path: str | Path) -> bool:
    """Whether the file at ``path`` is a figure hf_lmc saved (it carries :data:`FIGURE_SIGNATURE`)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SIGNATURE_WINDOW)
            f.seek(max(0, os.fstat(f.fileno()).st_size - _SIGNATURE_WINDOW))
            tail = f.read(_SIGNATURE_WINDOW)
    except OSError:
        return False
    signature = FIGURE_SIGNATURE.encode()
    return signature in head or signature in tail


def save_figure(figure, path: str | Path, *, overwrite: bool = False, what: str = "plot", **options) -> Path:
    """Save a matplotlib ``figure`` at ``path``, signed as hf_lmc's (:data:`FIGURE_SIGNATURE`):
    drawn into a hidden sibling first, then moved into place, so ``path`` is never half-written
    and, without ``overwrite``, a file that appeared meanwhile is kept and this save refused."""
    path = Path(path)
    suffix = path.suffix.lower()
    partial = Path(tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", suffix=suffix, dir=path.parent)[1])
    try:
        figure.savefig(partial, format=suffix[1:], metadata={FIGURE_FORMATS[suffix]: FIGURE_SIGNATURE}, **options)
        _as_umask_allows(partial, 0o666)
        if overwrite:
            if os.path.lexists(path) and not is_hf_lmc_figure(path):
                raise OutputExistsError(f"{{}} {_given(path)} is not a figure hf-lmc wrote; name another file", what)
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)  # fails where path exists: nothing is replaced
            except FileExistsError:
                raise OutputExistsError(
                    f"{_given(path)} was written by another program meanwhile; pass {{}} to replace it", "overwrite"
                ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return path


def _foreign_entries(folder: Path, record: dict | None, *, legacy: bool) -> list[str]:
    """The entries under ``folder`` that its marker does not account for, at most :data:`_WALKED`
    of them. Without a marker: every top-level entry, unless (``legacy``) the folder has the
    record an older hf_lmc left, which accounts for the files such a folder had."""
    if record is None:
        names = _names(folder)
        if not legacy or not any(name in _LEGACY_MARKERS for name in names):
            return names
        return [
            name
            for name in names
            if not (name in _LEGACY_MARKERS or _LEGACY_FILES.fullmatch(name)) or not _plain_file(folder / name)
        ]
    listed = {str(name) for name in record["files"]}
    allowed = listed | {MARKER, _MARKER_PARTIAL}
    allowed |= {parent.as_posix() for name in listed for parent in Path(name).parents if parent != Path(".")}
    return [name for name in itertools.islice(_entries_under(folder), _WALKED) if name not in allowed]


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _entries_under(folder: Path) -> Iterator[str]:
    """Every entry under ``folder`` (folders, files, links; links not followed), as relative paths."""
    for root, dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        for name in sorted(dirs) + sorted(files):
            yield (here / name).as_posix()


def _files_under(folder: Path) -> Iterator[str]:
    for root, _dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        for name in files:
            yield (here / name).as_posix()


def _names(folder: Path) -> list[str]:
    """The names in ``folder`` (at most :data:`_WALKED`), sorted."""
    with os.scandir(folder) as entries:
        return sorted(entry.name for entry in itertools.islice(entries, _WALKED))


def _shown(text: str | Path, limit: int = 200) -> str:
    """A path or name for a one-line message, shortened in the middle when it is very long."""
    text = str(text)
    return text if len(text) <= limit else text[: limit // 2] + "…" + text[-limit // 2 :]


def _given(text: str | Path, limit: int = 200) -> str:
    """:func:`_shown`, for a message template whose ``{}`` names the parameter (braces doubled)."""
    return _shown(text, limit).replace("{", "{{").replace("}", "}}")


# -- reading apart from writing --------------------------------------------------------------


def check_apart(
    output: str | Path,
    inputs: Iterable[str | Path],
    what: str = "output",
    *,
    role: str = "the input",
    missing: bool = False,
) -> None:
    """Refuse an ``output`` (a folder to write, or to replace) that is, contains or lies inside
    one of the ``inputs`` (files or folders): replacing it would delete an input, writing into it
    would change one. Paths are compared resolved (links followed), and by ``(st_dev, st_ino)``
    of each path, its existing ancestors and its descendants, so a hard link, a symlink or a bind
    mount of an input counts as the input. Inputs that do not exist here (Hub ids not yet
    downloaded) are skipped, unless ``missing`` (paths still to be written: compared by path).
    ``what`` is the parameter that names ``output``, ``role`` says what the inputs are."""
    given_output = output
    output = Path(output).absolute()
    out = output.resolve()
    out_up = _identities_up(output)  # the output (if it exists) and every existing folder above it
    out_self = _identity(output)
    out_down: set[tuple[int, int]] | None = None  # the output's descendants, read on first need
    for given in inputs:
        path = Path(given)
        if not os.path.lexists(path) and not missing:
            continue
        folder = path.resolve()
        here = _identity(path)
        where = None
        if out == folder or (here is not None and here == out_self):
            where = "is"
        elif folder.is_relative_to(out) or (out_self is not None and out_self in _identities_up(path)):
            where = "contains"
        elif out.is_relative_to(folder) or (here is not None and here in out_up):
            where = "lies inside"
        else:
            if out_down is None:
                out_down = _identities_down(output)
            if here is not None and here in out_down:
                where = "contains"
            elif out_self is not None and path.is_dir() and out_self in _identities_down(path):
                where = "lies inside"
        if where is not None:
            raise ParameterError(
                f"{{}} {_given(given_output)} {where} {role} {_given(given)}; write to a folder of its own", what
            )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities_up(path: Path) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of ``path`` and of each existing folder above it, as written (so a
    bind mount's own identity is seen, not just the resolved path's)."""
    found = set()
    for here in [Path(path).absolute(), *Path(path).absolute().parents]:
        identity = _identity(here)
        if identity is not None:
            found.add(identity)
        resolved = _identity(here.resolve()) if here.is_symlink() else None
        if resolved is not None:
            found.add(resolved)
    return found


def _identities_down(path: Path) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of what lies under ``path`` (links not followed; at most :data:`_WALKED` entries)."""
    if not path.is_dir():
        return set()
    found = set()
    for name in itertools.islice(_entries_under(path), _WALKED):
        try:
            st = (path / name).stat(follow_symlinks=False)
        except OSError:
            continue
        found.add((st.st_dev, st.st_ino))
        if (path / name).is_symlink():
            target = _identity(path / name)
            if target is not None:
                found.add(target)
    return found


def check_output_path(output: str | Path, what: str = "output") -> None:
    """Refuse, before any work, an output path that can never be replaced: ``.``, the working
    folder or a folder above it (it cannot be renamed away), or an existing file."""
    path = Path(output)
    absolute = path.absolute()
    if path.name in ("", ".", "..") or Path.cwd().resolve().is_relative_to(absolute.resolve()):
        raise ParameterError(
            f"{{}} {_given(output)} is the working folder or a folder above it; name a new folder, e.g. ./merged", what
        )
    if os.path.lexists(path) and not path.is_dir():
        thing = _what_is(path)
        raise ParameterError(f"{{}} {_given(output)} is {thing}; name a folder to write", what)
    if ".." in path.parts[:-1] and not path.parent.is_dir():  # "m/../m": its parent would be made as "m"
        raise ParameterError(
            f"{{}} {_given(output)} climbs out of {_given(path.parent)} with '..', which does not exist; "
            "name the folder without '..'",
            what,
        )
    if len(os.fsencode(absolute.name)) > _LONGEST_NAME:  # its hidden siblings (".NAME.tmp-PID-xxxxxxxx") must fit too
        raise ParameterError(
            f"{{}} {_given(absolute.name, 60)}: the folder name is over {_LONGEST_NAME} bytes; name a shorter folder",
            what,
        )


#: The longest output folder name: its debris folders add ``.``, ``.tmp-``, a PID and eight
#: random characters, and a file system's names stop at 255 bytes.
_LONGEST_NAME = 200


# -- staging, swap and debris ----------------------------------------------------------------


def staging_folder(output: str | Path) -> Path:
    """A fresh hidden sibling of ``output`` to write into before :func:`move_into_place`, locked
    by this process until it is moved or discarded; what dead runs left beside ``output`` is
    tidied first (:func:`clean_stale`)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(output)
    return _locked_folder(output, "tmp")


def move_into_place(
    staging: Path,
    output: Path,
    *,
    kind: str,
    overwrite: bool = True,
    what: str = "output",
    moved_by: dict | None = None,
) -> None:
    """Mark a finished ``staging`` folder as hf_lmc's ``kind`` and move it onto ``output``.

    Without ``overwrite`` the move only succeeds while ``output`` does not exist: a concurrent
    run that got there first keeps its folder, and this one fails with :class:`OutputExistsError`
    (its staging folder is removed by the caller). With ``overwrite`` the old folder must be one
    hf_lmc wrote (:func:`check_replaceable`; ``what`` names the parameter in the message), and it
    is exchanged with the new one in one step where the system can; elsewhere it is set aside
    (``.NAME.old-PID-xxxxxxxx``) and the new one renamed in, with signals deferred in between, so
    an exception puts it back and a killed run leaves it for the next run to restore. The old
    folder is removed only once the new one is in place. The folder and every file in it get the
    permissions the umask gives a new folder or file (``mkdtemp`` made it private, and
    safetensors writes its files private too: :func:`honour_umask`); an empty folder at ``output``
    is replaced without ``overwrite``, by a rename that fails if anything appeared in it
    meanwhile; ``moved_by`` goes into its marker (:func:`mark`)."""
    staging, output = Path(staging), Path(output)
    try:
        honour_umask(staging)
        mark(staging, kind, moved_by)
        if overwrite and os.path.lexists(output):
            check_replaceable(output, what)
            _swap(staging, output)
            return
        try:
            if is_empty_folder(output):  # the user's empty folder: replaced only while it stays empty
                os.rename(staging, output)
            else:
                _rename_new(staging, output)
        except OSError as err:
            if os.path.lexists(output):
                raise OutputExistsError(
                    f"{_given(output)} was written by another run meanwhile; pass {{}} to replace it", "overwrite"
                ) from err
            raise
    finally:
        release(staging)


def discard(folder: Path) -> None:
    """Remove a staging folder this run made, then give up its lock (whatever stops the removal:
    the next run removes the rest)."""
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        release(folder)


def release(folder: Path) -> None:
    """Give up the lock this process holds on a debris folder (if it holds one)."""
    with _held_guard:
        fd = _held.pop(Path(folder), None)
    if fd is not None:
        os.close(fd)


def clean_stale(output: str | Path) -> list[Path]:
    """Tidy what dead runs left beside ``output``: their staging folders are removed, and an old
    folder set aside by an interrupted ``--overwrite`` goes back to ``output`` when it is missing
    (and is removed when not). A folder whose run still holds its lock is left alone. Returns the
    folders it removed or restored."""
    output = Path(output)
    parent = output.parent if str(output.parent) else Path(".")
    found = []
    try:
        with os.scandir(parent) as entries:
            for entry in entries:
                kind = _debris_kind(entry.name, output.name)
                if kind is not None and entry.is_dir(follow_symlinks=False):
                    found.append((_DEBRIS_KINDS.index(kind), entry.name, kind))
    except FileNotFoundError:
        return []
    tidied = []
    for _, name, kind in sorted(found):
        folder = parent / name
        fd = _try_lock(folder)
        if fd is None:  # its run is alive (or another run is tidying it)
            continue
        try:
            kept = folder / output.name
            if kind == "old" and kept.is_dir() and not kept.is_symlink() and not os.path.lexists(output):
                with contextlib.suppress(OSError):  # another run restored it first
                    _rename_new(kept, output)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
        tidied.append(folder)
    return tidied


def _debris_kind(name: str, output_name: str) -> str | None:
    """``"old"``, ``"tmp"`` or ``"new"`` when ``name`` is a debris folder of ``output_name`` (exact prefix)."""
    for kind in _DEBRIS_KINDS:
        prefix = f".{output_name}.{kind}-"
        if name.startswith(prefix) and _DEBRIS_SUFFIX.fullmatch(name[len(prefix) :]):
            return kind
    return None


def _locked_folder(output: Path, kind: str) -> Path:
    """A new debris folder ``.NAME.KIND-PID-xxxxxxxx`` beside ``output``, locked by this process.

    It is made under a ``.new-`` name, locked, then renamed (the lock stays with the folder), so
    no run ever sees an unlocked ``tmp`` or ``old`` folder of a live run; one that a cleaner
    removed in the moment before the lock is simply made again."""
    parent = output.parent
    if fcntl is None:  # no locks to hold: the folder is never taken for dead
        return Path(tempfile.mkdtemp(prefix=f".{output.name}.{kind}-{os.getpid()}-", dir=parent))
    fresh_prefix = f".{output.name}.new-{os.getpid()}-"
    for _ in range(100):
        fresh = Path(tempfile.mkdtemp(prefix=fresh_prefix, dir=parent))
        fd = _try_lock(fresh)
        if fd is None:
            continue
        folder = parent / f".{output.name}.{kind}-{fresh.name.removeprefix(f'.{output.name}.new-')}"
        try:
            os.rename(fresh, folder)
        except FileNotFoundError:  # a cleaner removed it before the lock
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        with _held_guard:
            _held[folder] = fd
        return folder
    raise OSError(f"cannot make a staging folder beside {_shown(output)}: each one made was removed at once")


def _try_lock(folder: Path) -> int | None:
    """A descriptor holding the exclusive lock of ``folder``, or ``None`` when another holds it
    (or the folder is gone). Without advisory locks, every folder counts as held."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as err:
        os.close(fd)
        if isinstance(err, OSError) and err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _swap(staging: Path, output: Path) -> None:
    """Put ``staging`` at ``output`` and remove the old ``output``, never leaving neither whole."""
    if _exchange(staging, output):  # one atomic step: staging now holds the old folder
        shutil.rmtree(staging, ignore_errors=True)
        return
    retired = _locked_folder(output, "old")
    aside = retired / output.name
    try:
        with _signals_deferred():
            try:
                os.rename(output, aside)
                os.rename(staging, output)
            except BaseException:
                if not os.path.lexists(output) and os.path.lexists(aside):  # put the old folder back
                    os.rename(aside, output)
                raise
    except BaseException:
        if not os.path.lexists(aside):
            with contextlib.suppress(OSError):
                retired.rmdir()
        release(retired)
        raise
    discard(retired)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block is done, then deliver them: Python runs
    signal handlers in the main thread only, so elsewhere nothing needs holding."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    try:
        for signum in _DEFERRED_SIGNALS:
            handler = signal.getsignal(signum)
            if handler is None:  # installed outside Python: cannot be put back
                continue
            previous[signum] = signal.signal(signum, lambda number, frame: caught.append(number))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in caught:
            signal.raise_signal(signum)


# renameat2(2): Linux 3.15+, glibc 2.28+; a filesystem without it answers EINVAL.
_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _load_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _rename2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``; ``False`` where the system or filesystem lacks it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))


def _exchange(staging: Path, output: Path) -> bool:
    return _rename2(staging, output, _RENAME_EXCHANGE)


def _rename_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, failing if ``target`` exists (even as an empty folder,
    which a plain rename would replace), where the system can tell."""
    if not _rename2(source, target, _RENAME_NOREPLACE):
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
        os.rename(source, target)


def honour_umask(path: str | Path) -> None:
    """Give ``path`` the permissions a new file (``open``: 0o666) or folder (``mkdir``: 0o777)
    gets under the process's umask, and for a folder everything under it too (links are left
    alone): ``mkdtemp``, ``mkstemp`` and safetensors' ``save_file`` make theirs private (0600),
    where every file hf_lmc writes follows the umask, as ``save_pretrained``'s shards do."""
    path = Path(path)
    if path.is_symlink():
        return
    if not path.is_dir():
        _as_umask_allows(path, 0o666)
        return
    _as_umask_allows(path)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(root) / name
            if not entry.is_symlink():
                _as_umask_allows(entry, 0o777 if name in dirs else 0o666)


def _as_umask_allows(path: Path, mode: int = 0o777) -> None:
    """Give a staging folder or file (``mkdtemp`` and ``mkstemp`` make them private) the
    permissions ``mkdir`` (``mode`` 0o777) or ``open`` (0o666) would give under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)
