"""A disk that fails on demand: a FUSE passthrough of one folder that returns EIO, ENOSPC or short writes.

SQLite tests its I/O-error handling through a VFS that fails chosen calls;
Python code does its I/O through the kernel, so here the failing layer is
a file system: a passthrough of a backing folder (fusepy, over libfuse 2),
mounted with direct_io so that every read and write reaches it (no page
cache answers for it), whose faults a test switches on and off through a
small JSON control file beside the mount:

    {"read_eio": ["*.kvc"], "write_eio": ["sessions/*"], "enospc_after": 4096, "short_writes": true}

    read_eio      reads of files whose path (relative to the mount) matches a glob fail with EIO
    write_eio     writes, and the creation of files, whose path matches fail with EIO
    enospc_after  after this many more bytes written (from the moment it is set), every write fails
                  with ENOSPC, and so do new files
    short_writes  each write takes at most half of what it is given (a caller must loop)

The control file is read again whenever it changes (its mtime). FaultFS
starts the file system in a process of its own (`python -m
kvsession.testing.faultfs BACKING MOUNT CONTROL`) and unmounts it when it
stops; available() says why it cannot run here (no /dev/fuse, no libfuse,
mounting refused). Nothing here imports the rest of kvsession.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import wait_until


class FaultFS:
    """The fault file system over `backing`, mounted at `mount`, in a process of its own (a context manager).

    set(**faults) replaces the faults (the control file's keys above); clear() removes them all."""

    def __init__(self, backing: Path, mount: Path):
        self.backing, self.mount = Path(backing), Path(mount)
        self.control = self.mount.with_name(self.mount.name + ".faults.json")
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> str | None:
        """None when a FUSE file system can be mounted here, else why not (a test's skip message)."""
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse on this machine (a container without FUSE)"
        try:
            import fuse  # noqa: F401  (fusepy: loads libfuse.so.2 at import)
        except (ImportError, OSError, EnvironmentError) as e:
            return f"fusepy or libfuse 2 is missing (pip install fusepy; apt-get install libfuse2): {e}"
        if os.geteuid() != 0 and not any(os.access(os.path.join(d, "fusermount"), os.X_OK)
                                         for d in os.environ.get("PATH", "").split(os.pathsep)):
            return "not root, and no fusermount to mount as a user"
        return None

    def set(self, **faults) -> None:
        tmp = self.control.with_name(self.control.name + ".tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, self.control)
        time.sleep(0.01)  # a distinct mtime on coarse clocks: the file system reads it again
        os.utime(self.control)

    def clear(self) -> None:
        self.set()

    def __enter__(self) -> "FaultFS":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        self.set()
        self.log = open(self.mount.with_name(self.mount.name + ".log"), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvsession.testing.faultfs", str(self.backing),
                                      str(self.mount), str(self.control)], stdout=self.log, stderr=subprocess.STDOUT)

        def mounted() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fault file system exited: {Path(self.log.name).read_text()[-2000:]}")
            return os.path.ismount(self.mount)

        wait_until(mounted, 60, "the fault file system did not mount")
        return self

    def __exit__(self, *exc) -> None:
        for attempt in range(50):
            if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def serve(backing: str, mount: str, control: str) -> None:
    """Run the passthrough (in the foreground) until it is unmounted."""
    from fuse import FUSE, FuseOSError, Operations

    class Faults:
        """The control file's faults, read again when it changes."""

        def __init__(self):
            self.mtime = None
            self.lock = threading.Lock()
            self.d: dict = {}
            self.written = 0  # bytes written since enospc_after was set

        def now(self) -> dict:
            try:
                mtime = os.stat(control).st_mtime_ns
            except FileNotFoundError:
                mtime = None
            with self.lock:
                if mtime != self.mtime:
                    self.mtime = mtime
                    try:
                        self.d = json.loads(Path(control).read_text()) if mtime is not None else {}
                    except ValueError:
                        self.d = {}
                    self.written = 0
                return self.d

        def full(self) -> bool:
            d = self.now()
            with self.lock:
                return d.get("enospc_after") is not None and self.written >= d["enospc_after"]

        def charge(self, n: int) -> int:
            """How many of n bytes may be written before the disk is full (ENOSPC when none)."""
            d = self.now()
            with self.lock:
                if d.get("enospc_after") is not None:
                    room = d["enospc_after"] - self.written
                    if room <= 0:
                        raise FuseOSError(errno.ENOSPC)
                    n = min(n, room)
                if d.get("short_writes") and n > 1:
                    n //= 2
                self.written += n
                return n

    faults = Faults()

    def matches(path: str, key: str) -> bool:
        rel = path.lstrip("/")
        return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(os.path.basename(rel), g)
                   for g in faults.now().get(key, ()))

    class Passthrough(Operations):
        def __init__(self, root: str):
            self.root = root

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def __call__(self, op, path, *args):
            try:
                return super().__call__(op, path, *args)
            except OSError as e:
                if isinstance(e, FuseOSError):
                    raise
                raise FuseOSError(e.errno or errno.EIO) from None

        def access(self, path, mode):
            if not os.access(self._full(path), mode):
                raise FuseOSError(errno.EACCES)

        def chmod(self, path, mode):
            return os.chmod(self._full(path), mode)

        def chown(self, path, uid, gid):
            return os.chown(self._full(path), uid, gid)

        def getattr(self, path, fh=None):
            st = os.lstat(self._full(path))
            return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                                "st_size", "st_uid", "st_blocks")}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._full(path))

        def readlink(self, path):
            return os.readlink(self._full(path))

        def mknod(self, path, mode, dev):
            return os.mknod(self._full(path), mode, dev)

        def rmdir(self, path):
            return os.rmdir(self._full(path))

        def mkdir(self, path, mode):
            return os.mkdir(self._full(path), mode)

        def statfs(self, path):
            sv = os.statvfs(self._full(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                "f_files", "f_flag", "f_frsize", "f_namemax")}

        def unlink(self, path):
            return os.unlink(self._full(path))

        def symlink(self, name, target):
            return os.symlink(target, self._full(name))

        def rename(self, old, new):
            return os.rename(self._full(old), self._full(new))

        def link(self, target, name):
            return os.link(self._full(name), self._full(target))

        def utimens(self, path, times=None):
            return os.utime(self._full(path), times)

        def open(self, path, flags):
            return os.open(self._full(path), flags)

        def create(self, path, mode, fi=None):
            if matches(path, "write_eio"):
                raise FuseOSError(errno.EIO)
            if faults.full():
                raise FuseOSError(errno.ENOSPC)
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, length, offset, fh):
            if matches(path, "read_eio"):
                raise FuseOSError(errno.EIO)
            return os.pread(fh, length, offset)

        def write(self, path, data, offset, fh):
            if matches(path, "write_eio"):
                raise FuseOSError(errno.EIO)
            n = faults.charge(len(data))
            return os.pwrite(fh, data[:n], offset)

        def truncate(self, path, length, fh=None):
            with open(self._full(path), "r+b") as f:
                f.truncate(length)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            return os.close(fh)

        def fsync(self, path, fdatasync, fh):
            if matches(path, "write_eio"):
                raise FuseOSError(errno.EIO)
            return os.fsync(fh)

    FUSE(Passthrough(backing), mount, foreground=True, nothreads=False, direct_io=True, attr_timeout=0,
         entry_timeout=0, allow_other=True)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
