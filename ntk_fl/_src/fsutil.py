"""Files of a run directory that survive kills, power loss, planted links and a second run.

* :func:`write_atomic` -- replace a file in one step: the new text goes to a
  temporary file created exclusively in the same directory (``O_CREAT | O_EXCL |
  O_NOFOLLOW``: a planted ``<name>.tmp`` link is never followed, and no two
  writers share a temporary), which is ``fsync``\\ ed, renamed over the target,
  and the directory is ``fsync``\\ ed so the rename itself survives a power loss.
* :func:`open_append` -- open a log for appending without following a link.
* :class:`WorkdirLock` -- one run per workdir: an ``fcntl.flock`` on
  ``<workdir>/run.lock`` held for the whole run, with the holder's pid, host and
  boot written in the file. The kernel drops a ``flock`` when its holder dies, so
  a lock is never held by a dead process; a *record* left by one (the file still
  names a process, nobody holds the lock) is a run that was killed, reported when
  the next run takes the lock over (see :meth:`WorkdirLock.acquire`).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import tempfile

__all__ = ["LOCK_FILE", "WorkdirBusy", "WorkdirLock", "fsync_dir", "open_append", "write_atomic"]

LOCK_FILE = "run.lock"
"""The lock file of a run directory (kept between runs; empty while no run holds it)."""


def fsync_dir(path: str) -> None:
  """Makes the entries of directory ``path`` (a rename, a new file) durable."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path: str, data: str | bytes) -> None:
  """Replaces ``path`` by ``data`` in one step (complete or absent, never half written).

  The temporary file is made by :func:`tempfile.mkstemp` in ``path``'s directory
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, a random name): a link planted where a
  temporary file would go is never followed. A link *at* ``path`` is replaced by
  the file (``rename`` replaces the link, not its target).
  """
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.lexists(tmp):
      os.unlink(tmp)
    raise
  fsync_dir(directory)


def open_append(path: str, encoding: str = "utf-8"):
  """``open(path, "a")`` that refuses a symbolic link at ``path`` (``OSError`` ELOOP names it)."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise OSError(
        errno.ELOOP, "is a symbolic link; a run writes only its own files (remove the link)", path
      ) from None
    raise
  return os.fdopen(fd, "a", encoding=encoding)


class WorkdirBusy(ValueError):
  """Another run holds the workdir's lock, or a lock record cannot be proven stale."""


def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _parse(text: str) -> dict:
  record = {}
  for line in text.splitlines():
    key, sep, value = line.partition("=")
    if sep:
      record[key.strip()] = value.strip()
  return record


class WorkdirLock:
  """An exclusive lock on a run directory, held until :meth:`release` (or the holder's death).

  Args:
    workdir: the run directory (created if missing).
    fd: an already locked descriptor of the lock file inherited from the local
      launcher of a multi-process run (its workers share the launcher's lock).
  """

  def __init__(self, workdir: str, *, fd: int | None = None):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self.fd = fd
    self.inherited = fd is not None
    self.taken_over: dict | None = None  # the record of a killed run this lock replaced

  def acquire(self) -> WorkdirLock:
    """Takes the lock or raises :class:`WorkdirBusy` naming the holder.

    The record of a killed run (the file names a process, nobody holds the lock)
    is taken over, and ``taken_over`` says so, when that process is provably
    dead: it ran on this host and either the host has rebooted since or no
    process with its pid exists. Otherwise (another host, or its pid is in use
    again) the run refuses, naming the file to delete once that run is known to be
    over: no lock is taken on a guess.
    """
    if self.fd is not None:  # inherited from the launcher: the same open file, already locked
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return self
    fd = self._lock_the_file()
    record = _parse(os.pread(fd, 4096, 0).decode(errors="replace"))
    if record.get("pid"):
      try:
        same_host = record.get("host") == socket.gethostname()
        rebooted = same_host and record.get("boot", "") != _boot_id()
        dead = same_host and (rebooted or not _alive(int(record["pid"])))
      except ValueError:
        dead = False
      if not dead:
        os.close(fd)
        here = record.get("host") == socket.gethostname()
        where = "this host" if here else f"host {record.get('host', '?')}"
        raise WorkdirBusy(
          f"workdir {self.workdir} was locked by pid {record.get('pid')} on {where} (started "
          f"{record.get('started', '?')}), which holds no lock now but cannot be shown to have "
          f"ended {'(its pid is in use)' if here else '(another host)'}; if that run is over, "
          f"delete {self.path} and start again"
        )
      self.taken_over = record
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = f"pid={os.getpid()}\nhost={socket.gethostname()}\nboot={_boot_id()}\nstarted={started}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)
    self.fd = fd
    return self

  def _lock_the_file(self, tries: int = 10) -> int:
    """A descriptor of the lock file, locked; the file is the one at ``self.path`` now.

    A start that failed removes the lock file (and the workdir) it created; a run
    that opened the file just before that would lock a file no longer there, so the
    lock counts only once the path still names the locked file (else it is tried again).
    """
    for _ in range(tries):
      os.makedirs(self.workdir, exist_ok=True)
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
      except FileNotFoundError:  # the workdir was removed between the two calls
        continue
      except OSError as e:
        if e.errno == errno.ELOOP:
          raise WorkdirBusy(
            f"{self.path} is a symbolic link; remove it (a run writes only its own files)"
          ) from None
        raise
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        record = _parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        os.close(fd)
        pid, host, started = (record.get(k, "?") for k in ("pid", "host", "started"))
        raise WorkdirBusy(
          f"workdir {self.workdir} is in use by another run (pid {pid} on host "
          f"{host}, started {started}); wait for it to finish or stop it, or choose "
          "another --workdir"
        ) from None
      locked = os.fstat(fd)
      try:
        now = os.stat(self.path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino):
          return fd
      except FileNotFoundError:
        pass
      os.close(fd)  # the file was removed (or replaced) after it was opened: lock the new one
    raise WorkdirBusy(f"{self.path} keeps being removed while this run locks it; try again")

  def release(self) -> None:
    """Empties the record and drops the lock.

    The file stays: unlinking it could let two runs lock two different files (the command
    removes one only after a start that failed; :meth:`acquire` then locks the new file).
    """
    if self.fd is None:
      return
    if self.inherited:  # the launcher's lock: it empties and drops it once its workers ended
      os.close(self.fd)
      self.fd = None
      return
    try:
      os.ftruncate(self.fd, 0)
    except OSError:
      pass
    fcntl.flock(self.fd, fcntl.LOCK_UN)
    os.close(self.fd)
    self.fd = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
