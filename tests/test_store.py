"""The read pipeline: scattered preadv, ordering, merging, page-cache modes, errors."""

import os
import sys

import numpy as np
import pytest

from llm_mlx_streaming.experts import store as store_mod
from llm_mlx_streaming.experts.residency import resident_pages
from llm_mlx_streaming.experts.store import ChecksumError, ExpertStore


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return path, data


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_one_read_scatters_a_range_into_several_buffers(data_file, threads):
    path, data = data_file
    store = ExpertStore(threads)
    a, b, c = np.empty(100, np.uint8), np.empty(3000, np.uint8), np.empty(7, np.uint8)
    far = np.empty(5000, np.uint8)
    result = store.read([(path, 900_000, [far]), (path, 1234, [a, b, c])])
    assert result.nbytes == 8107 and result.reads == 2 and result.seconds >= 0
    assert a.tobytes() + b.tobytes() + c.tobytes() == data[1234:1234 + 3107].tobytes()
    assert far.tobytes() == data[900_000:905_000].tobytes()
    store.close()


def test_touching_jobs_merge_into_one_read_up_to_a_bound(data_file, monkeypatch):
    path, data = data_file
    store = ExpertStore(4)
    bufs = [np.empty(4096, np.uint8) for _ in range(8)]
    jobs = [(path, 8192 + i * 4096, [b]) for i, b in enumerate(bufs)]
    calls = []
    real = os.preadv

    def spy(fd, buffers, offset):
        calls.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(store_mod.os, "preadv", spy)
    assert store.read(jobs[::-1]).reads == 1  # given in any order: sorted, then merged
    assert calls == [(8192, 8 * 4096)]
    assert b"".join(b.tobytes() for b in bufs) == data[8192:8192 + 8 * 4096].tobytes()
    monkeypatch.setattr(store_mod, "MAX_MERGED_BYTES", 3 * 4096)
    calls.clear()
    assert store.read(jobs).reads == 3
    assert sorted(calls) == [(8192, 3 * 4096), (8192 + 3 * 4096, 3 * 4096), (8192 + 6 * 4096, 2 * 4096)]
    store.close()


def test_reads_are_issued_in_ascending_offset_with_bounded_concurrency(data_file, monkeypatch):
    import threading

    path, _ = data_file
    store = ExpertStore(3)
    order, live, peak, readers = [], [0], [0], set()
    lock = threading.Lock()
    real = os.preadv

    first = threading.Barrier(3, timeout=60)  # the first three reads meet: they run at once

    def slow(fd, buffers, offset):
        with lock:
            readers.add(threading.current_thread())
            order.append(offset)
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            meet = len(order) <= 3
        if meet:
            first.wait()
        n = real(fd, buffers, offset)
        with lock:
            live[0] -= 1
        return n

    monkeypatch.setattr(store_mod.os, "preadv", slow)
    offsets = [50_000 * i for i in (7, 2, 9, 4, 1, 3, 8, 5)]
    store.read([(path, o, [np.empty(100, np.uint8)]) for o in offsets])
    assert peak[0] == 3
    assert threading.current_thread() in readers  # the caller reads too, not only waits
    # issued in ascending order (the first `threads` may start in any order)
    assert sorted(order[:3]) == sorted(offsets)[:3] and order[3:] == sorted(offsets)[3:]
    store.close()


def test_a_short_read_or_bad_checksum_raises(data_file):
    path, _ = data_file
    store = ExpertStore(2)
    with pytest.raises(OSError, match="short read"):
        store.read([(path, (1 << 20) - 10, [np.empty(100, np.uint8)])])
    jobs = [(path, 0, [np.empty(10, np.uint8)]), (path, 5000, [np.empty(10, np.uint8)])]
    with pytest.raises(ChecksumError):
        store.read(jobs, verify=lambda job: job[1] != 5000)
    assert store.read(jobs, verify=lambda job: True).nbytes == 20
    store.close()


def test_page_cache_bypass_drops_the_pages_read_on_linux(data_file, monkeypatch):
    path, data = data_file
    advice = []
    monkeypatch.setattr(store_mod.sys, "platform", "linux")
    monkeypatch.setattr(store_mod.os, "posix_fadvise",
                        lambda fd, off, n, how: advice.append((off, n, how)), raising=False)
    dest = np.empty(10_000, np.uint8)
    store = ExpertStore(2, page_cache="bypass")
    store.read([(path, 5000, [dest])])
    assert dest.tobytes() == data[5000:15000].tobytes()
    # no readahead, then the read range widened to whole pages is dropped
    assert advice == [(0, 0, os.POSIX_FADV_RANDOM), (4096, 16384 - 4096, os.POSIX_FADV_DONTNEED)]
    store.close()
    advice.clear()
    keep = ExpertStore(2, page_cache="keep")
    keep.read([(path, 5000, [dest])])
    assert advice == []
    keep.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_page_cache_bypass_reads_page_aligned_records_around_the_page_cache(data_file):
    """On Linux `bypass` reads a record that starts on a page with O_DIRECT: the device
    fills a page-aligned buffer, the slots (of any address and size) get their bytes
    from it, and none of the file's pages enter the page cache."""
    path, data = data_file
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system has no direct I/O")
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)  # written pages leave the page cache only once clean
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if (before := resident_pages(fd, 0, 1 << 20)) is not None and before.any():
            pytest.skip("the page cache keeps this file's pages")
        a, b = np.empty(5001, np.uint8), np.empty(123_457, np.uint8)
        store = ExpertStore(2, page_cache="bypass")
        assert store.read([(path, 8192, [a, b])]).nbytes == 128_458
        assert a.tobytes() + b.tobytes() == data[8192:8192 + 128_458].tobytes()
        assert store._direct[path] is not None
        store.close()
        resident = resident_pages(fd, 0, 1 << 20)
        if resident is not None:
            assert not resident.any()
    finally:
        os.close(fd)


def test_page_cache_bypass_sets_f_nocache_on_macos(data_file, monkeypatch):
    import fcntl

    path, _ = data_file
    calls = []
    monkeypatch.setattr(store_mod.sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, cmd, arg: calls.append((cmd, arg)))
    store = ExpertStore(2, page_cache="bypass")
    store.read([(path, 0, [np.empty(10, np.uint8)])])
    assert calls == [(getattr(fcntl, "F_NOCACHE", 48), 1)]
    store.close()


def test_other_platforms_read_the_portable_way(data_file, monkeypatch):
    path, data = data_file
    monkeypatch.setattr(store_mod.sys, "platform", "win32")
    monkeypatch.setattr(store_mod.os, "posix_fadvise", None, raising=False)
    store = ExpertStore(2, page_cache="bypass")
    dest = np.empty(64, np.uint8)
    store.read([(path, 64, [dest])])
    assert dest.tobytes() == data[64:128].tobytes()
    store.close()


def test_unknown_page_cache_mode_is_refused():
    with pytest.raises(ValueError, match="page_cache"):
        ExpertStore(2, page_cache="sometimes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_bypass_really_leaves_the_range_out_of_the_page_cache(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    store = ExpertStore(2, page_cache="bypass")
    store.read([(path, 1 << 20, [np.empty(1 << 20, np.uint8)])])
    store.close()
    resident = resident_pages(fd, 0, 4 << 20)
    os.close(fd)
    assert resident[256:512].sum() == 0  # the 1 MiB just read is not cached
    keep = ExpertStore(2, page_cache="keep")
    keep.read([(path, 1 << 20, [np.empty(1 << 20, np.uint8)])])
    assert keep.uncached_share([(path, 1 << 20, 1 << 20)]) == 0.0  # what mincore says
    assert keep.uncached_share([(path, 3 << 20, 1 << 20)]) == 1.0
    keep.close()
