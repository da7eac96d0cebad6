"""DeepNVMe's aio_handle over the C async I/O core. Every round trip is checked against the
file's bytes as plain Python reads and writes them (the independent reference)."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading

import pytest
import torch

from deepspeed_c.ops.op_builder import AsyncIOBuilder, GDSBuilder

aio = AsyncIOBuilder().load()
BS = 64 * 1024  # a small block size keeps block_size +- 1 cheap


def _rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _disk_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _accepts_o_direct(directory: str) -> bool:
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


SIZES = [0, 1, 4095, 4096, 4097, BS - 1, BS, BS + 1, 3 * BS + 4096 * 5 + 7]


@pytest.mark.parametrize("engine", ["io_uring", "pread"])
@pytest.mark.parametrize("where", ["disk", "shm", "page_cache_only"])
def test_round_trips_bit_exact(tmp_path, where, engine, monkeypatch):
    monkeypatch.setenv("DSC_AIO_ENGINE", engine)
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm here")
        directory = f"/dev/shm/dsc_aio_test_{os.getpid()}"
        os.makedirs(directory, exist_ok=True)
    else:
        directory = str(tmp_path)
    if where == "page_cache_only":  # the fallback when a filesystem refuses O_DIRECT
        monkeypatch.setenv("DSC_AIO_DIRECT", "0")
    h = aio.aio_handle(block_size=BS, queue_depth=4, intra_op_parallelism=3)
    locked = h.new_cpu_locked_tensor(max(SIZES) + 1, torch.empty(0, dtype=torch.uint8))
    try:
        for i, n in enumerate(SIZES):
            x = _rand_bytes(n, i)
            path = os.path.join(directory, f"f{n}")
            assert h.sync_pwrite(x, path) == 1
            assert _disk_bytes(path) == x.numpy().tobytes(), n  # exact size, no padding
            y = torch.full((n,), 7, dtype=torch.uint8)
            assert h.sync_pread(y, path) == 1
            assert torch.equal(x, y), n
            # an unaligned view (bounce path) and a page-aligned locked buffer (zero copy)
            y_off = torch.zeros(n + 3, dtype=torch.uint8)[3:]
            assert h.sync_pread(y_off, path) == 1 and torch.equal(x, y_off), n
            buf = locked[:n]
            buf.zero_()
            assert h.sync_pread(buf, path) == 1 and torch.equal(x, buf), n
            # a file written by plain Python reads back through the handle
            with open(path, "wb") as f:
                f.write(bytes(reversed(x.numpy().tobytes())))
            assert h.sync_pread(y, path) == 1 and torch.equal(y, x.flip(0)), n
        stats = h.stats()
        # io_uring where the kernel lets this process have it (each worker its own ring), never when told not to
        assert stats["uring_workers"] in ((0, 3) if engine == "io_uring" else (0,))
        if where == "page_cache_only" or not _accepts_o_direct(directory):
            assert stats["blocks_direct"] == 0
        else:
            assert stats["blocks_direct"] > 0 and stats["blocks_bounced"] < stats["blocks_direct"]
    finally:
        h.free_cpu_locked_tensor(locked)
        if where == "shm":
            for name in os.listdir(directory):
                os.unlink(os.path.join(directory, name))
            os.rmdir(directory)


@pytest.mark.skipif(os.environ.get("DSC_TEST_AIO_LARGE") != "1", reason="1 GiB round trip: set DSC_TEST_AIO_LARGE=1")
def test_round_trip_one_gib(tmp_path):
    h = aio.aio_handle(intra_op_parallelism=2)
    x = h.new_cpu_locked_tensor(1 << 30, torch.empty(0, dtype=torch.uint8))
    x.copy_(_rand_bytes(1 << 30, 1))
    path = str(tmp_path / "big")
    assert h.sync_pwrite(x, path) == 1
    y = torch.empty_like(x)
    assert h.sync_pread(y, path) == 1 and torch.equal(x, y)


def test_dtypes_shapes_offsets_and_api_returns(tmp_path):
    h = aio.aio_handle(block_size=BS, queue_depth=8, single_submit=True, overlap_events=True, intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (BS, 8, True, True, 2, 2 * 4096)
    path = str(tmp_path / "t")
    x = torch.randn(33, 65, dtype=torch.float32)
    assert h.write(x, path, True) == 1  # legacy write, validated, from a pageable tensor
    assert _disk_bytes(path) == x.numpy().tobytes()
    y = torch.empty(33, 65)
    assert h.read(y, path, True) == 1 and torch.equal(x, y)
    # DeepSpeed's positional pread(buffer, filename, validate, async, file_offset)
    half = torch.empty(65 * 16)
    assert h.pread(half, path, False, False, 65 * 17 * 4) == 1
    assert torch.equal(half, x.reshape(-1)[65 * 17:65 * 33])
    assert h.pread(half, path, False, True, 0) == 0 and h.wait() == 1
    assert torch.equal(half, x.reshape(-1)[:65 * 16])
    assert h.pwrite(x.to(torch.bfloat16), path, False, **{"async": True}) == 0 and h.wait() == 1
    assert _disk_bytes(path) == x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    # an in-place write at an offset keeps the rest of the file
    before = bytearray(_disk_bytes(path))
    patch = _rand_bytes(5000, 3)
    assert h.sync_pwrite(patch, path, 4097) == 1
    before[4097:4097 + 5000] = patch.numpy().tobytes()
    assert _disk_bytes(path) == bytes(before)
    # replacing a longer file leaves exactly the new bytes (no stale tail)
    small = _rand_bytes(10, 4)
    assert h.sync_pwrite(small, path) == 1 and _disk_bytes(path) == small.numpy().tobytes()
    # an open descriptor (DeepSpeed's async_pwrite(buffer, fd, file_offset)) is written in place
    fd = os.open(path, os.O_WRONLY)
    try:
        assert h.async_pwrite(_rand_bytes(4, 5), fd, 2) == 0 and h.wait() == 1
    finally:
        os.close(fd)
    assert _disk_bytes(path) == small.numpy().tobytes()[:2] + _rand_bytes(4, 5).numpy().tobytes() + \
        small.numpy().tobytes()[6:]


def test_wait_counts_are_exact(tmp_path):
    h = aio.aio_handle(block_size=BS, intra_op_parallelism=2)
    assert h.wait() == 0  # DeepSpeed aborts the process here
    xs = [_rand_bytes(n, n) for n in (1, 4096, BS + 1, 3 * BS, 0)]
    for i, x in enumerate(xs):
        assert h.async_pwrite(x, str(tmp_path / f"a{i}")) == 0
    # a synchronous call in between completes its own op only
    assert h.sync_pwrite(_rand_bytes(100, 9), str(tmp_path / "s")) == 1
    assert h.pending() == len(xs)
    assert h.wait() == len(xs)
    assert h.wait() == 0
    ys = [torch.empty_like(x) for x in xs]
    for i, y in enumerate(ys):
        assert h.async_pread(y, str(tmp_path / f"a{i}")) == 0
    assert h.wait() == len(xs)
    assert all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_errors_name_the_file_and_leave_no_partial_file(tmp_path):
    h = aio.aio_handle(block_size=BS)
    x = _rand_bytes(10000, 0)
    missing = str(tmp_path / "no_such_dir" / "f")
    with pytest.raises(OSError, match="no_such_dir/f"):
        h.sync_pwrite(x, missing)
    with pytest.raises(OSError, match="no_such_dir/f"):
        h.async_pwrite(x, missing)
    assert h.wait() == 0
    with pytest.raises(OSError, match="no_such_dir/f"):
        h.sync_pread(x, missing)
    path = str(tmp_path / "short")
    h.sync_pwrite(x[:5000], path)
    with pytest.raises(OSError, match=r"read past the end of .*short: the file has 5000 bytes"):
        h.sync_pread(x, path)
    with pytest.raises(OSError, match="short"):
        h.sync_pread(x[:10], path, 4995)
    nc = torch.zeros(64, 64)[:, ::2]
    with pytest.raises(ValueError, match="short.*not contiguous"):
        h.sync_pwrite(nc, path)
    with pytest.raises(ValueError, match="short.*not contiguous"):
        h.async_pread(nc, path)
    with pytest.raises(TypeError):
        h.sync_pwrite([1, 2, 3], path)
    assert _disk_bytes(path) == x[:5000].numpy().tobytes()
    assert sorted(os.listdir(tmp_path)) == ["short"]  # no temporaries left behind
    with pytest.raises(ValueError, match="block_size"):
        aio.aio_handle(block_size=1000)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        aio.aio_handle(intra_op_parallelism=0)
    with pytest.raises(ValueError, match="queue_depth"):
        aio.aio_handle(queue_depth=0)


def test_a_write_that_does_not_fit_keeps_the_old_file(tmp_path):
    """A full filesystem, without root: a file-size limit makes the space reservation fail."""
    h = aio.aio_handle(block_size=BS)
    path = str(tmp_path / "state")
    old = _rand_bytes(4096, 1)
    h.sync_pwrite(old, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    prev = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError, match=r"state"):
            h.sync_pwrite(_rand_bytes(3 << 20, 2), path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, prev)
    assert _disk_bytes(path) == old.numpy().tobytes()
    assert os.listdir(tmp_path) == ["state"]


def test_a_full_filesystem_raises_and_keeps_the_old_file(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    try:
        h = aio.aio_handle(block_size=BS)
        path = str(mnt / "state")
        old = _rand_bytes(100 * 1024, 1)
        h.sync_pwrite(old, path)
        with pytest.raises(OSError, match=r"no room to write 204800 bytes to .*state"):
            h.sync_pwrite(_rand_bytes(200 * 1024, 2), path)
        assert _disk_bytes(path) == old.numpy().tobytes() and os.listdir(mnt) == ["state"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_gil_is_released_during_io(tmp_path):
    """Opening a FIFO blocks until a writer opens it: if the handle held the GIL while opening,
    this thread could never open the writer end and the reader would never return."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    h = aio.aio_handle()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            h.sync_pread(torch.empty(10, dtype=torch.uint8), fifo)
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    fd = os.open(fifo, os.O_WRONLY)  # needs the GIL while the reader sits in open()
    os.close(fd)
    t.join(timeout=30)
    assert not t.is_alive()
    assert errors and "not a regular file" in str(errors[0])


@pytest.mark.parametrize("engine", ["io_uring", "pread"])
def test_many_handles_and_threads_at_once(tmp_path, engine, monkeypatch):
    monkeypatch.setenv("DSC_AIO_ENGINE", engine)
    shared = aio.aio_handle(block_size=BS, intra_op_parallelism=2)
    failures: list[str] = []

    def work(tid: int) -> None:
        own = aio.aio_handle(block_size=BS, intra_op_parallelism=1 + tid % 3)
        for rep in range(6):
            for h in (own, shared):
                n = (tid * 7919 + rep * 104729) % (3 * BS) + 1
                x = _rand_bytes(n, tid * 100 + rep)
                path = str(tmp_path / f"t{tid}_{rep}_{h is shared}")
                h.sync_pwrite(x, path)
                y = torch.empty_like(x)
                h.sync_pread(y, path)
                if not torch.equal(x, y) or _disk_bytes(path) != x.numpy().tobytes():
                    failures.append(path)
        xs = [_rand_bytes(1000 + i, i) for i in range(5)]
        for i, x in enumerate(xs):
            own.async_pwrite(x, str(tmp_path / f"as{tid}_{i}"))
        if own.wait() != len(xs):
            failures.append(f"wait count in thread {tid}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures
    assert shared.wait() == 0


def test_locked_tensors_and_builders():
    h = aio.aio_handle()
    t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float16))
    assert t.dtype == torch.float16 and t.numel() == 1000 and t.data_ptr() % 4096 == 0
    assert h.is_pinned(t) and not h.is_pinned(torch.empty(10))
    # freed: the handle forgets it; where CUDA is present the block is torch-pinned memory, page-locked until
    # torch releases it, so only the CPU path's munlock makes it pageable at once
    assert h.free_cpu_locked_tensor(t) and (torch.cuda.is_available() or not h.is_pinned(t))
    assert not h.free_cpu_locked_tensor(t)  # a second free is refused
    assert AsyncIOBuilder().is_compatible()
    assert not GDSBuilder().is_compatible()
    assert "GPUDirect Storage" in GDSBuilder().incompatible_reason()
    with pytest.raises(RuntimeError, match="GPUDirect"):
        GDSBuilder().load()
    import deepspeed_c.ops.op_builder as ob

    assert ob.AsyncIOBuilder is AsyncIOBuilder and "pread" in aio.backend()


def test_in_place_writes_for_scratch_files(tmp_path):
    """atomic_writes=False (the swappers' handles): the file is rewritten in place, same inode, and
    truncated to exactly the buffer's bytes."""
    h = aio.aio_handle(block_size=BS, intra_op_parallelism=2, atomic_writes=False)
    path = str(tmp_path / "swap")
    big = _rand_bytes(3 * BS + 5, 1)
    assert h.sync_pwrite(big, path) == 1 and _disk_bytes(path) == big.numpy().tobytes()
    inode = os.stat(path).st_ino
    small = _rand_bytes(BS + 1, 2)
    assert h.async_pwrite(small, path) == 0 and h.wait() == 1
    assert _disk_bytes(path) == small.numpy().tobytes() and os.stat(path).st_ino == inode
    y = torch.empty_like(small)
    assert h.sync_pread(y, path) == 1 and torch.equal(y, small)
    atomic = aio.aio_handle(block_size=BS)
    assert atomic.sync_pwrite(big, path) == 1 and os.stat(path).st_ino != inode  # a new file renamed over


def test_engine_matches_the_env_report(monkeypatch):
    """The env report's io_uring probe (ctypes, Python) and the C core's rings agree."""
    from deepspeed_c.ops.op_builder.async_io import engine_description, io_uring_available

    monkeypatch.delenv("DSC_AIO_ENGINE", raising=False)
    h = aio.aio_handle(queue_depth=4, intra_op_parallelism=3)
    assert h.stats()["uring_workers"] == (3 if io_uring_available() else 0)
    assert ("io_uring per worker" in engine_description()) == io_uring_available()
    assert aio.aio_handle(queue_depth=1).stats()["uring_workers"] == 0  # one request at a time: no ring


def _queue_many_small_files(directory: str, headroom: int) -> str:
    """In a child process: 400 async writes then reads of 4 KiB files queued at once, under a descriptor
    limit `headroom` above what the process holds, with a handle made before the limit was lowered (its
    bound is from the old limit: opens hit EMFILE and wait for its own ops) and one made after. "" or
    what went wrong."""
    early = aio.aio_handle(block_size=BS, queue_depth=64, intra_op_parallelism=2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
    late = aio.aio_handle(block_size=BS, queue_depth=64, intra_op_parallelism=2)
    for name, h in (("early", early), ("late", late)):
        xs = [torch.full((4096,), i % 251, dtype=torch.uint8) for i in range(400)]
        for i, x in enumerate(xs):
            h.async_pwrite(x, os.path.join(directory, f"{name}{i}"))
        if h.wait() != len(xs):
            return f"{name}: write count"
        ys = [torch.empty_like(x) for x in xs]
        for i, y in enumerate(ys):
            h.async_pread(y, os.path.join(directory, f"{name}{i}"))
        if h.wait() != len(ys) or not all(torch.equal(x, y) for x, y in zip(xs, ys)):
            return f"{name}: read back differs"
    return ""


def test_queued_files_stay_under_the_descriptor_limit(tmp_path):
    """Each op holds its file's descriptors until it finishes: queueing thousands of small files (a
    swapper's sub-groups read for a checkpoint) once failed with 'Too many open files'. A handle keeps
    at most a 16th of the limit's descriptors in flight, and an open that still finds none waits for
    the handle's own ops to finish; in a fresh child process, as the limit is per process (a fork of a
    test worker with live threads can deadlock in the child)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; from tests.unit.test_aio_handle import _queue_many_small_files as q; "
            "r = q(sys.argv[1], headroom=24); print(r); sys.exit(1 if r else 0)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert len(os.listdir(tmp_path)) == 800  # every file written once, no temporaries left
