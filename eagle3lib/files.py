"""The ground floor: paths, writes readers never see half done, and reads that name the file they fail on.

Everything here is about files, not about what they hold: a relative path resolves against the repository
root; a file or folder is written beside its destination and renamed into place (`atomic_write_text`,
`staged_folder`, `staging_path`), with the permissions a plain `open()` would give it (`shareable`); an
append is one whole line or nothing (`append_line`); safetensors and weights-only torch files are read with
failures raised as the caller's own error type, naming the file; a shipped file is checked against the hash
its record holds (`check_recorded_hash`). torch and safetensors are imported where
they are used, so that the modules above can be imported without them.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str | os.PathLike | None) -> Path | None:
    """Relative paths in params are relative to the repository root, wherever the kernel runs."""
    if path is None:
        return None
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else REPO_ROOT / p


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def held(lock_file: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold `lock_file` (flock) for the block, writing this process's id in it; when another process holds it,
    raise `busy(its holder)` before anything is written. The lock goes with the process: a killed one
    leaves none behind."""
    import fcntl

    make_folder(lock_file.parent)
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise busy(handle.read().strip() or "process unknown") from None
        handle.truncate(0)
        handle.write(f"process {os.getpid()}\n")
        handle.flush()
        yield


_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> SHA-256: hash a shipped file once


def check_recorded_hash(path: Path, recorded: str, record: Path, error: type[Exception] = ValueError) -> None:
    """Refuse a file whose SHA-256 is not the one `record` (a manifest, a provenance) holds for it, naming
    the file and both hashes: a shipped file edited by hand is never used silently. `eagle3 accept-edit PATH`
    records an edited copy on purpose."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    found = _verified.get(key) or file_sha256(path)
    if found != recorded:
        raise error(f"{path}: SHA-256 {found} is not the {recorded} recorded in {record}: the file changed "
                    f"since it was made; restore it, or accept the edited copy: eagle3 accept-edit {path}")
    _verified[key] = found


def accept_edit(path: Path, record_file: Path, set_hash: Callable[[dict, str], str]) -> str:
    """Record the file `path`'s present SHA-256 in the JSON record `record_file` (`set_hash(record, new)`
    puts it in place and returns the hash it replaced), keeping the history of accepted edits beside it.
    Returns a sentence saying what changed."""
    record = json.loads(record_file.read_text())
    found = file_sha256(path)
    previous = set_hash(record, found)
    if previous == found:
        return f"{path}: its SHA-256 {found} is already the one {record_file} records; nothing changed"
    record.setdefault("edits_accepted", []).append(
        {"file": path.name, "previous_sha256": previous, "sha256": found,
         "accepted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    atomic_write_text(record_file, json.dumps(record, indent=2) + "\n")
    return f"{record_file}: {path.name} accepted as edited ({previous} -> {found})"


# ---------------------------------------------------------------- permissions and staging


def shareable(path: str | os.PathLike) -> Path:
    """Give a file or folder made by mkstemp/mkdtemp (private: 0600/0700) the permissions a plain open() or
    mkdir() would have under this process's umask, so that reports and checkpoints can be shared."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)
    return Path(path)


def shareable_tree(folder: str | os.PathLike) -> Path:
    """`shareable` for a folder and everything under it, before it is renamed into place: safetensors (0.8)
    writes each file privately (0600), as mkstemp does, and a checkpoint or data folder is meant to be read by
    others."""
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            if not os.path.islink(os.path.join(parent, name)):  # a link's target is not ours to change
                shareable(os.path.join(parent, name))
    return shareable(folder)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def clear_stale_staging(path: Path) -> None:
    """Remove what killed saves of `path` left beside it: staging of processes that no longer run on this
    machine. Leftovers whose writer cannot be told (named without a process id, by an older eagle3lib) are
    kept and named in a warning."""
    # `.NAME.PID.RANDOM.tmp` (`.old`: a replaced folder on its way out); older saves wrote `.NAME.RANDOM.tmp`
    staging = re.compile(rf"\.{re.escape(path.name)}\.(?:(?P<pid>[0-9]+)\.)?[^.]+\.(?:tmp|old)")
    unknown = []
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*"):
        match = staging.fullmatch(leftover.name)
        if not match:
            continue
        if match["pid"] is None:
            unknown.append(leftover)
        elif not _running(int(match["pid"])):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
    if unknown:
        warnings.warn(
            f"{path.parent}: {', '.join(sorted(p.name for p in unknown))} left by an interrupted save of "
            f"{path.name}; remove them once no other process is writing {path}", stacklevel=3,
        )


def staging_path(path: Path, folder: bool, suffix: str = ".tmp") -> Path:
    """A new empty folder (or file) beside `path` to fill and then rename onto it, named after this process,
    with the umask's permissions; stale staging from killed saves is cleared first."""
    make_folder(path.parent)
    clear_stale_staging(path)
    prefix = f".{path.name}.{os.getpid()}."
    if folder:
        return shareable(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=suffix))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
    os.close(fd)
    return shareable(tmp)


def describe_occupant(path: Path) -> str:
    """Why `path` is taken, for a refusal: a dangling symbolic link is taken too (a rename onto it fails)."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return f"{path} exists"


def make_folder(path: Path) -> Path:
    """`path` as a folder, made with its parents where missing; one of them that is a file or a dangling
    symbolic link is named."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir()), path)
        raise FileExistsError(f"{describe_occupant(blocker)}, not a folder: cannot write {path}") from err
    return path


@contextmanager
def staged_folder(path: Path, replace: bool = False) -> Iterator[Path]:
    """A temporary folder beside `path` to fill: renamed to `path` when the block ends without an error (with
    the umask's permissions for all it holds), removed otherwise, so `path` never holds a half-written
    folder. An existing `path` is refused, or with `replace` moved aside first, so that the rename itself
    stays atomic."""
    staging = staging_path(path, folder=True)
    try:
        yield staging
        shareable_tree(staging)
        if not os.path.lexists(path):
            os.replace(staging, path)
        elif replace:
            old = staging_path(path, folder=True, suffix=".old")
            os.replace(path, old / path.name)
            os.replace(staging, path)
            shutil.rmtree(old)
        else:
            raise FileExistsError(f"{describe_occupant(path)}; refusing to replace it")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---------------------------------------------------------------- writing


class WriteError(OSError):
    """A file that could not be written; the message names it and the system's reason."""


def write_failure(path: str | os.PathLike, err: BaseException) -> WriteError:
    """`err`, raised while writing `path`, as "writing PATH: REASON" (e.g. No space left on device). The
    reason is the OSError behind it: its own, the one a failed write left as its context (torch.save into a
    file object), or the "os error N" in a safetensors message."""
    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    code = cause.errno if cause is not None else None
    if code is None and (found := re.search(r"os error ([0-9]+)", str(err))):
        code = int(found[1])
    failure = WriteError(f"writing {path}: {os.strerror(code) if code else err}")
    failure.errno = code
    return failure


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, with a failure named by `write_failure`."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as err:  # safetensors raises its own error type for I/O errors
        raise write_failure(path, err) from err


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    tmp = staging_path(path, folder=False)
    try:
        try:
            with open(tmp, "w") as handle:
                handle.write(text)
        except OSError as err:
            raise write_failure(path, err) from err
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to `path` in one write, so that readers see whole lines; a write the disk
    cuts short is taken back. A symbolic link is refused: a run appends to its own files only."""
    data = (line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise WriteError(f"{path} is a symbolic link; a run appends only to files of its own") from err
        raise write_failure(path, err) from err
    try:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as err:
            os.ftruncate(fd, size)
            raise write_failure(path, err) from err
    finally:
        os.close(fd)


# ---------------------------------------------------------------- reading


class ReadError(ValueError):
    """A file that cannot be read as what it should be; modules raise their own subclass of ValueError."""


def json_line(line: str, path: Path, number: int) -> Any:
    """Line `number` of the JSON-lines file `path`, parsed; a line that does not parse is refused by name."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {number}: not valid JSON ({err})") from err


def read_json_lines(path: Path) -> list:
    """Every entry of a JSON-lines file (such as an arm's metrics.jsonl)."""
    return [json_line(line, path, number) for number, line in enumerate(path.read_text().splitlines(), 1)]


@dataclass
class SafetensorsHeader:
    """What a safetensors file holds, without reading its tensors."""

    tensors: dict[str, tuple[list[int], str]]  # key -> (shape, safetensors dtype name such as "BF16")
    metadata: dict[str, str]


def _unreadable_safetensors(file: Path, err: Exception, error: type[Exception]) -> Exception:
    # safetensors raises its own error types for truncated or corrupt headers and data
    return error(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}")


def read_safetensors_header(file: str | os.PathLike, error: type[Exception] = ReadError) -> SafetensorsHeader:
    """The keys, shapes, dtypes and metadata of a safetensors file; an unreadable one raises `error`."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            tensors = {
                k: (handle.get_slice(k).get_shape(), handle.get_slice(k).get_dtype()) for k in handle.keys()
            }
            return SafetensorsHeader(tensors, handle.metadata() or {})
    except Exception as err:
        raise _unreadable_safetensors(Path(file), err, error) from err


def read_safetensors(
    file: str | os.PathLike, keys: Iterable[str] | None = None, error: type[Exception] = ReadError
) -> dict:
    """The tensors `keys` (default: all) of a safetensors file; an unreadable file, or one without a key
    asked for, raises `error` naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return {k: handle.get_tensor(k) for k in (handle.keys() if keys is None else keys)}
    except Exception as err:
        raise _unreadable_safetensors(Path(file), err, error) from err


def load_weights_only(file: str | os.PathLike, error: type[Exception] = ReadError, allow: tuple = ()) -> Any:
    """A `torch.save` file read by a weights-only load: tensors, containers, numbers and strings (and the
    classes in `allow`), never the code a pickle can carry. A file that needs more, or that is damaged,
    raises `error` naming the file."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found is None:  # torch's own text advises an unsafe reload: never passed on
            detail = re.search(r"WeightsUnpickler error: ([^\n]+)", str(err))
            why = detail[1] if detail else "unreadable"
            raise error(f"{file}: not a torch.save file of tensors ({why}); it is not loaded") from None
        raise error(
            f"{file}: refused, it needs {found[1]}, which only an unsafe unpickler rebuilds (running code "
            "from the file), so it is not loaded"
        ) from None
    except Exception as err:  # a damaged file: torch raises several types
        raise error(f"{file}: not readable as a weights-only torch file ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else 'damaged'})") from err
