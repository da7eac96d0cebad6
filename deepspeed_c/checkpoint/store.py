"""Crash-safe checkpoint files with a verified manifest.

A checkpoint tag directory is written under a temporary name and renamed into place only after
every file is fsynced and the manifest (name/shape/dtype/sha256 of every tensor, sha256 of every
file) is written; `latest` is replaced last. A crash at any point therefore leaves the previous
checkpoint and `latest` untouched. Imports only torch and the standard library (no runtime/)."""
from __future__ import annotations

import contextlib
import contextvars
import enum
import errno
import hashlib
import json
import os
import shutil
import warnings
from typing import Any, Callable

import torch

from deepspeed_c.checkpoint import digests, ds_pickle, safe_load

FORMAT_VERSION = 1
MANIFEST_NAME = "dsc_manifest.json"
LATEST_NAME = "latest"
_SCALARS = (str, int, float, bool, type(None), torch.Size, torch.dtype)


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file or tensor is missing, truncated or does not match its manifest."""


# a user's CheckpointEngine (DeepSpeed's interface: save(obj, path), load(path, map_location)) that the files
# of the running save or load go through instead of this module's own writes and verified reads
_ENGINE: contextvars.ContextVar[Any] = contextvars.ContextVar("dsc_checkpoint_engine", default=None)


@contextlib.contextmanager
def through_engine(checkpoint_engine: Any) -> Any:
    """Within: save_file hands each file to engine.save(obj, path) (and returns None: the engine, not a
    manifest, answers for the file), and load_file / load_file_mapped read with engine.load(path, "cpu"),
    unverified. Set on the saving or loading thread only."""
    token = _ENGINE.set(checkpoint_engine)
    try:
        yield
    finally:
        _ENGINE.reset(token)


def check_plain(obj: Any, where: str = "state") -> None:
    """Only tensors, dicts, lists/tuples, strings and numbers go into a pickle (loaded weights_only)."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _SCALARS):
        return
    if isinstance(obj, ds_pickle.STAND_IN_TYPES):  # DeepSpeed's own objects, allow-listed on load
        if not isinstance(obj, enum.Enum):  # an enum member pickles as its value
            check_plain(dict(vars(obj)), where)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint {where}: key {k!r} has type {type(k).__name__}; use str or int keys")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"checkpoint {where} has type {type(obj).__name__}; checkpoints hold only tensors, dicts, "
                    "lists, strings and numbers")


def tensor_entries(obj: Any, prefix: str = "", digest: bool = True) -> dict[str, dict[str, Any]]:
    """name -> shape, dtype (and sha256 unless digest=False) of every tensor in `obj` (hashed on threads)."""
    if prefix:
        return {f"{prefix}.{k}" if k != "<root>" else prefix: v for k, v in digests.tensor_entries(obj, digest).items()}
    return digests.tensor_entries(obj, digest)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_HASH_SLICE = 32 << 20  # bytes of a large record hashed on the side while the next slice is written


class _WriteRecorder:
    """The file object torch.save writes through, remembering the OSError of a failed write: torch's zip
    writer swallows it and raises its own "[enforce fail at inline_container.cc:...] unexpected pos ..."
    instead, which says neither that the disk is full nor which file was being written."""

    def __init__(self, f: Any, hasher: Any = None) -> None:
        self._f = f
        self._hasher = hasher  # the file's sha256, fed the bytes as they are written (no second read)
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        if self._hasher is None or len(memoryview(data).cast("B")) < _HASH_SLICE:
            n = self._write(data)
            if self._hasher is not None:
                self._hasher.update(data)
            return n
        # a large record (a tensor's storage, gigabytes in a ZeRO file): hashed on a thread, slice by slice,
        # while the same slices are written, so hashing costs no wall time next to the write. Every slice's
        # update is done before write() returns: torch may reuse the buffer after that.
        view = memoryview(data).cast("B")
        pending = []
        try:
            for off in range(0, len(view), _HASH_SLICE):
                piece = view[off:off + _HASH_SLICE]
                pending.append(digests.submit(digests.hash_thread(), self._hasher.update, piece))
                self._write(piece)
        finally:
            for fut in pending:
                fut.result()
        return len(view)

    def _write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            if self.error is None:
                self.error = e
            raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _disk_full(path: str) -> bool:
    try:
        return os.statvfs(os.path.dirname(os.path.abspath(path))).f_bavail == 0
    except OSError:
        return False


def _write_failed(target: str, written: str, error: BaseException, recorded: OSError | None) -> BaseException:
    """The error a failed write of `target` (through the file `written`) raises: an OSError with the errno of
    the write, flush or fsync that failed, naming the file; other errors as they are."""
    cause = recorded if recorded is not None else error
    if not (isinstance(cause, OSError) and cause.errno is not None):
        if not (isinstance(error, RuntimeError) and "inline_container" in str(error)):
            return error
        if not _disk_full(written):  # torch's writer failed without saying why
            return RuntimeError(f"writing checkpoint file {target} failed: {error}")
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    via = "" if written == target else f" (through its temporary {os.path.basename(written)}, removed)"
    hint = ("; free space or save to another directory (checkpoints saved before this one are untouched)"
            if cause.errno in (errno.ENOSPC, errno.EDQUOT) else "")
    # str() appends the file: "[Errno 28] No space left on device while writing checkpoint file...: '<path>'"
    reason = cause.strerror or os.strerror(cause.errno)
    return OSError(cause.errno, f"{reason} while writing checkpoint file{via}{hint}", target)


def _write_new(path: str, write: Callable[[Any], None], target: str | None = None, hasher: Any = None) -> None:
    """`write(file)` into a new file at `path`, flushed and fsynced (the bytes fed to `hasher` as written;
    `write` must write sequentially, as torch.save does). On failure the partial file is removed and, for a
    failed write (a full disk above all), an OSError with its errno names `target` (default `path`), the
    file the caller meant to write."""
    recorder: _WriteRecorder | None = None
    try:
        with open(path, "wb") as f:
            recorder = _WriteRecorder(f, hasher)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        _remove_quietly(path)
        raised = _write_failed(target or path, path, e, recorder.error if recorder is not None else None)
        if raised is e:
            raise
        raise raised from e


_TEMP_INFIX = ".tmp"  # a temporary of `name` is `name.tmp<pid>`, beside it


def _temporary(path: str) -> str:
    return f"{path}{_TEMP_INFIX}{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporaries of `path` (`path.tmp<pid>`) that processes killed while replacing it left
    behind: those of a process that no longer runs on this host, or of this process (it writes one
    temporary at a time, so an old one with its pid is a dead predecessor's that had the same pid).
    Only names of exactly that form are touched. Returns the removed paths."""
    folder, base = os.path.split(os.path.abspath(path))
    prefix = base + _TEMP_INFIX
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            stale = os.path.join(folder, name)
            if os.path.isfile(stale) and not os.path.islink(stale):
                _remove_quietly(stale)
                removed.append(stale)
    return removed


def _replace_atomic(path: str, write: Callable[[Any], None]) -> None:
    """`write(file)` into a temporary beside `path`, fsynced, then renamed over it: a crash leaves
    the old file or the new one, never a truncated one (and a failed write removes its temporary;
    one a killed process left is removed by the next replacement of the same file)."""
    remove_stale_temporaries(path)
    tmp = _temporary(path)
    _write_new(tmp, write, target=path)
    try:
        os.replace(tmp, path)
    except OSError as e:
        _remove_quietly(tmp)
        raise OSError(e.errno, f"{e.strerror} while moving checkpoint file {path} into place", path) from e
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_bytes_atomic(path: str, data: bytes) -> None:
    _replace_atomic(path, lambda f: f.write(data))


def torch_save_atomic(obj: Any, path: str) -> None:
    """torch.save `obj` to `path`, atomically (see _replace_atomic)."""
    _replace_atomic(path, lambda f: torch.save(obj, f))


def save_file(obj: dict, path: str) -> dict[str, Any]:
    """torch.save `obj` to `path` (fsynced) and return its manifest entry. A failed write (a full disk)
    raises OSError naming `path`, with the errno of the failure, and removes the partial file."""
    engine = _ENGINE.get()
    if engine is not None:
        engine.save(obj, path)
        return None  # type: ignore[return-value]
    check_plain(obj, os.path.basename(path))
    # DeepSpeed's objects need the pickler that writes them under DeepSpeed's names (slower: only then)
    pickler = {"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(obj) else {}
    tensors = digests.tensor_entries_async(obj)  # hashed on threads while torch.save writes
    file_sha = hashlib.sha256()
    try:
        _write_new(path, lambda f: torch.save(obj, f, **pickler), hasher=file_sha)
    finally:
        entries = tensors()
    return {"size": os.path.getsize(path), "sha256": file_sha.hexdigest(), "tensors": entries}


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


_STAGING_PREFIX, _STAGING_SUFFIX = ".", ".partial"


def begin(save_dir: str, tag: str) -> str:
    """A fresh, empty staging directory for `tag` (leftovers of a crashed save are discarded)."""
    os.makedirs(save_dir, exist_ok=True)
    stage = staging_dir(save_dir, tag)
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    return stage


def abort(save_dir: str, tag: str) -> None:
    """Discard the staging directory of a save that failed (its files hold space and will never be
    committed). Committed tags and `latest` are not touched. Call it once no rank writes into it."""
    shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)


def remove_stale_staging(save_dir: str, keep: str | tuple[str, ...] | None = None) -> list[str]:
    """Remove the staging directories (`.<tag>.partial`) that killed saves left in `save_dir`, except
    `keep`'s (a tag, or the tags one save stages there when its ranks name different tags). For the
    writers of this save, before they stage it: no other save is in flight there. A tag directory and the
    previous copy of a re-saved tag (`.<tag>.old`) are never touched."""
    kept = {staging_dir(save_dir, t) for t in ((keep,) if isinstance(keep, str) else (keep or ()))}
    removed = []
    try:
        names = os.listdir(save_dir)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(save_dir, name)
        if (name.startswith(_STAGING_PREFIX) and name.endswith(_STAGING_SUFFIX)
                and len(name) > len(_STAGING_PREFIX) + len(_STAGING_SUFFIX)
                and path not in kept
                and os.path.isdir(path) and not os.path.islink(path)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def commit(save_dir: str, tag: str, files: dict[str, dict[str, Any]], save_latest: bool) -> str:
    """Write the manifest, move the staging directory into place, then point `latest` at it."""
    stage = staging_dir(save_dir, tag)
    manifest = {"format_version": FORMAT_VERSION, "tag": tag, "files": files}
    write_bytes_atomic(os.path.join(stage, MANIFEST_NAME), json.dumps(manifest, indent=1).encode())
    _fsync_dir(stage)
    final = os.path.join(save_dir, tag)
    if os.path.exists(final):
        # Re-saving a tag: the old copy stays whole until the new one is complete beside it.
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(stage, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, final)
    _fsync_dir(save_dir)
    if save_latest:
        write_bytes_atomic(os.path.join(save_dir, LATEST_NAME), tag.encode())
    return final


def read_latest(load_dir: str) -> str | None:
    """The tag `latest` names; None when there is no `latest` file (DeepSpeed's loader then warns and
    loads nothing). An empty one (a crash or a full disk truncated it) raises ValueError naming it."""
    path = os.path.join(load_dir, LATEST_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise ValueError(f"load_checkpoint: {path} is empty (expected the name of a checkpoint tag directory; was it "
                         f"truncated by a crash or a full disk?); {load_dir} holds: {listing(load_dir)}. Pass the tag "
                         f"to load explicitly (load_checkpoint(load_dir, tag=...)) or write its name into {path}")
    return tag


def listing(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"<cannot list {path}: {e.strerror}>"
    return ", ".join(names) if names else "<empty>"


def read_manifest(tag_dir: str) -> dict[str, Any] | None:
    path = os.path.join(tag_dir, MANIFEST_NAME)
    if not os.path.isfile(path) and _ENGINE.get() is not None:
        return None  # a user's checkpoint engine wrote the files: it answers for them
    if not os.path.isfile(path):
        warnings.warn(f"checkpoint {tag_dir} has no {MANIFEST_NAME}; loading without integrity checks")
        return None
    with open(path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointIntegrityError(f"checkpoint manifest {path} is corrupted: {e}") from None
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointIntegrityError(f"checkpoint {tag_dir} has format_version {version!r}; this deepspeed_c "
                                       f"reads format_version <= {FORMAT_VERSION}: upgrade deepspeed_c")
    return manifest


def _manifest_entry(tag_dir: str, name: str, manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The file's manifest entry (None without a manifest), after checking it exists with its size."""
    path = os.path.join(tag_dir, name)
    entry = None
    if manifest is not None:
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointIntegrityError(f"checkpoint file {path} is not listed in the manifest")
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(f"checkpoint file {path} is missing (directory holds: {listing(tag_dir)})")
    if entry is not None and os.path.getsize(path) != entry["size"]:
        raise CheckpointIntegrityError(f"checkpoint file {path} is truncated or altered: {os.path.getsize(path)} "
                                       f"bytes, manifest says {entry['size']}")
    return entry


def _unpickle(path: str, mmap: bool = False) -> Any:
    try:
        return safe_load.load(path, mmap=mmap)
    except safe_load.UntrustedPickleError:
        raise
    except Exception as e:  # noqa: BLE001 (any other unpickling failure is corruption here)
        raise CheckpointIntegrityError(f"checkpoint file {path} cannot be read (corrupted?): {e}") from None


def load_file(tag_dir: str, name: str, manifest: dict[str, Any] | None) -> dict:
    """Load one checkpoint file (weights_only) and verify it against the manifest."""
    path = os.path.join(tag_dir, name)
    engine = _ENGINE.get()
    if engine is not None:
        return engine.load(path, map_location="cpu")
    entry = _manifest_entry(tag_dir, name, manifest)
    obj = _unpickle(path)
    if entry is None:
        return obj
    _check_tensors(path, entry, tensor_entries(obj))
    if _file_sha(path) != entry["sha256"]:
        raise CheckpointIntegrityError(f"checkpoint file {path} is corrupted: sha256 does not match the manifest")
    return obj


def load_file_mapped(tag_dir: str, name: str, manifest: dict[str, Any] | None) -> tuple[dict, bool]:
    """Like load_file, but the tensors map the file (torch.load mmap=True): only the byte ranges a caller
    reads are paged in. The file is verified by its sha256, streamed before unpickling, and by the
    manifest's tensor names, shapes and dtypes; per-tensor digests are computed only to name the damaged
    tensor when the file's does not match. Returns (obj, mapped); mapped is False when the file's format
    cannot be mapped (torch's legacy, non-zip format) and it was read whole by load_file."""
    if _ENGINE.get() is not None:
        return load_file(tag_dir, name, manifest), False
    path = os.path.join(tag_dir, name)
    entry = _manifest_entry(tag_dir, name, manifest)
    if entry is not None and _file_sha(path) != entry["sha256"]:
        load_file(tag_dir, name, manifest)  # raises, naming the damaged tensor where it can
        raise CheckpointIntegrityError(f"checkpoint file {path} is corrupted: sha256 does not match the manifest")
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
    except OSError as e:
        raise CheckpointIntegrityError(f"checkpoint file {path} cannot be read: {e.strerror}") from None
    if not zipped:
        return load_file(tag_dir, name, manifest), False
    obj = _unpickle(path, mmap=True)
    if entry is not None:
        shapes = {k: {f: v[f] for f in ("shape", "dtype")} for k, v in entry["tensors"].items()}
        _check_tensors(path, {"tensors": shapes}, tensor_entries(obj, digest=False))
    return obj, True


def _check_tensors(path: str, entry: dict[str, Any], got: dict[str, dict[str, Any]]) -> None:
    for tname, want in entry["tensors"].items():
        have = got.get(tname)
        if have is None:
            raise CheckpointIntegrityError(f"checkpoint file {path}: tensor {tname!r} is missing")
        if have != want:
            def show(e: dict[str, Any]) -> str:
                return f"{e['dtype']}{e['shape']}" + (f" sha256 {e['sha256'][:12]}" if "sha256" in e else "")

            raise CheckpointIntegrityError(f"checkpoint file {path}: tensor {tname!r} does not match the manifest "
                                           f"(saved {show(want)}, found {show(have)})")
    extra = sorted(set(got) - set(entry["tensors"]))
    if extra:
        raise CheckpointIntegrityError(f"checkpoint file {path}: tensors {extra} are not in the manifest")
