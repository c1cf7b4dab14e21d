"""The run directory `$ONBOX_HOME/runs/<name>/`: the files a run leaves behind and every tool reads.

  config.json         the resolved RunConfig: the exact re-launch record
  state.json          the supervisor's state (atomic): run, state, attempt, child_pid, attempts, last_exit, ...,
                      warnings [{code, severity, message, hint, at}] and requeue {ok, job_id, detail} (notes.py)
  events.jsonl        append-only lifecycle events, one JSON object a line: {time, type, run, attempt, ...}.
                      Types: state {old, new, reason}, exit {code, signal, signal_name, classification, message,
                      hint}, preemption_notice {source, detail, grace}, notice_ignored, signal_forwarded {signal,
                      pgid}, escalated {signal}, final_checkpoint {summary}, requeue {job_id, ok},
                      attempt_leftovers_signal {signal, pids, commands}, attempt_leftovers_stopped {sid, pids,
                      commands, killed, survived}, adopted {pid, start_time, ended, keeper}, log_rotated, hook_error {hook,
                      error}, thread_died {thread, what, error, hint}, stop_grace_ignored {grace, reason},
                      run_dir_unwritable {errno, error, what, path, hint}, run_dir_writable {after_s, errno,
                      dropped_events} (records.py: while the disk refuses writes, events wait in memory);
                      plus whatever the hooks emit through RunContext.emit (metrics_unrecognised {lines, minutes,
                      message, hint} and metrics_recognised from the heartbeat, requeue_skipped {job_id, reason})
  output.log          the child's stdout+stderr, written by the child itself (O_APPEND), rotated by copy-truncate
  training_status.md  a human summary (runsummary.py), regenerated on each state change, commit and progress change
  lock                flock(2) held by the live agent (detach.py)
  child-exit.json     the current attempt's keeper: how its child ended {pid, start_time, boot_id, code, signal},
                      for an agent that adopts the run after the one that started it died (shim.py)
  PREEMPTED           exists once a preemption is under way (ONBOX_PREEMPT_FILE)
  metrics.jsonl       the trainer may append {"step":..,"loss":..} lines (ONBOX_METRICS_FILE)
  stop.request        written by `onbox stop`; the agent acts on it at its next tick (a disk that refuses it:
                      `onbox stop` sends preempt.STOP_SIGNAL instead)
"""
from __future__ import annotations

import collections
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

from onbox import fsutil, paths, untrusted

if TYPE_CHECKING:
    from onbox.config import RunConfig

TAIL_LINES = 200  # lines of output kept for exit classification (U10)


class RunDir:
    """Paths and writers of one run directory."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.name = os.path.basename(self.path)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def state_path(self) -> str:
        return self.file(paths.STATE_FILE)

    @property
    def events_path(self) -> str:
        return self.file(paths.EVENTS_FILE)

    @property
    def log_path(self) -> str:
        return self.file(paths.OUTPUT_LOG)

    @property
    def config_path(self) -> str:
        return self.file(paths.CONFIG_FILE)

    @property
    def preempt_file(self) -> str:
        return self.file(paths.PREEMPT_FILE)

    @property
    def metrics_file(self) -> str:
        return self.file(paths.METRICS_FILE)

    @property
    def stop_request(self) -> str:
        return self.file(paths.STOP_REQUEST)

    @property
    def lock_path(self) -> str:
        return self.file(paths.LOCK_FILE)

    def exists(self) -> bool:
        return os.path.isfile(self.config_path)

    def make_private(self) -> None:
        """Create the run dir 0700 (and its runs/ parent) and take group/other access off what an older agent
        left 0755/0644: a run's command line, output and configuration are its owner's. The default checkpoint
        dir (checkpoints/) holds the trainer's files, written with its own umask: left as it is."""
        fsutil.make_private_dir(os.path.dirname(self.path))
        fsutil.make_private_dir(self.path)
        for dirpath, dirnames, filenames in os.walk(self.path):
            if dirpath == self.path and paths.CHECKPOINTS_DIR in dirnames:
                dirnames.remove(paths.CHECKPOINTS_DIR)
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                    continue
                os.chmod(path, fsutil.PRIVATE_DIR if stat.S_ISDIR(st.st_mode) else fsutil.PRIVATE_FILE)

    def read_state(self) -> Optional[Dict[str, Any]]:
        """state.json, or None when absent or unreadable (a run that never started)."""
        doc, _problem = self.load_state()
        return doc

    def load_state(self) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """(state.json, None), (None, None) when there is none yet, or (None, why) when it is corrupt: not JSON,
        not an object, or no known `state`. The agent writes it atomically, so corruption means a damaged disk
        or a hand edit; readers must say so instead of showing a run as "unknown"."""
        from onbox.supervisor.state import RunState

        try:
            raw = untrusted.read_bytes(self.state_path, untrusted.CONFIG_MAX_BYTES, "state file")
        except FileNotFoundError:
            return None, None
        except untrusted.UntrustedInput as e:  # a FIFO would hang `onbox status`, /dev/zero would fill the memory
            return None, "it " + e.reason
        except OSError as e:
            return None, "cannot read it: %s" % (e.strerror or e)
        try:
            doc = untrusted.loads_json(raw, paths.STATE_FILE)
        except untrusted.UntrustedInput as e:
            return None, "it " + e.reason
        except ValueError as e:  # UnicodeDecodeError included
            return None, "not valid JSON (%s)" % e
        if not isinstance(doc, dict):
            return None, "not a JSON object"
        if doc.get("state") not in {s.value for s in RunState}:
            return None, "no known run state in it (state: %r)" % (doc.get("state"),)
        return doc, None

    def write_state(self, state: Dict[str, Any]) -> None:
        # the summary first: once state.json says X, training_status.md already says X too
        self.write_status(state)
        fsutil.atomic_write_json(self.state_path, state)

    def write_status(self, state: Dict[str, Any]) -> None:
        """training_status.md from `state` and what the subsystems recorded beside it, now."""
        # imported by writers only: readers (`onbox status`) skip it
        from onbox.supervisor.runsummary import render_status

        fsutil.atomic_write(self.file(paths.SUMMARY_FILE), render_status(
            state, self.side_doc(paths.CHECKPOINT_STATUS_FILE), self._disk_risks(state),
            self.side_doc(paths.PROGRESS_FILE)))

    def side_doc(self, name: str) -> Dict[str, Any]:
        """A subsystem's JSON file beside state.json (checkpoint_status.json, progress.json), or {}."""
        try:
            doc = fsutil.read_json(self.file(name), untrusted.CONFIG_MAX_BYTES)
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _disk_risks(self, state: Dict[str, Any]) -> List[str]:
        """U6/U7: a checkpoint disk low on bytes or inodes kills torch.save mid-run."""
        ckpt = state.get("ckpt_dir")
        if not ckpt:
            return []
        try:
            fs = fsutil.free_space(ckpt)
        except OSError:
            return []
        risks = []
        if fs.total_bytes and fs.free_bytes < 0.05 * fs.total_bytes:
            risks.append("checkpoint disk %s has %.1f GB free (<5%%): U6, torch.save dies on a full disk"
                         % (fs.path, fs.free_bytes / 1e9))
        if fs.has_inode_limit and fs.free_inodes < 0.05 * fs.total_inodes:
            risks.append("checkpoint disk %s has %d inodes free (<5%%): U7, disks die on inodes before bytes"
                         % (fs.path, fs.free_inodes))
        return risks

    def append_event(self, event: Dict[str, Any]) -> None:
        fsutil.append_jsonl(self.events_path, event)

    def load_config(self) -> Dict[str, Any]:
        """config.json, the run's re-launch record: the one reader of it (`run`, `adopt`, `stop`, `sync`, the
        queue). A regular file only, at most untrusted.CONFIG_MAX_BYTES, nested at most untrusted.MAX_DEPTH: a
        record that is a FIFO or /dev/zero is refused, never waited on or read without end. Raises
        FileNotFoundError when the run has none, another OSError when it cannot be read, ValueError (an
        UntrustedInput for a refusal) when it is not JSON, TypeError when its JSON is not an object; each
        caller words the refusal for its own command."""
        doc = fsutil.read_json(self.config_path, untrusted.CONFIG_MAX_BYTES, "config")
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        return doc

    def run_config(self, validate: bool = True, source: str = paths.CONFIG_FILE) -> "RunConfig":
        """config.json as the RunConfig it records, validated unless told not to: load_config's refusals, and
        a UsageError (a ConfigError) when it is no valid configuration; `source` names it in the messages."""
        from onbox.config import RunConfig  # when asked: `onbox status` stays light

        cfg = RunConfig.from_dict(self.load_config(), source)
        return cfg.validate() if validate else cfg

    def write_config(self, config: Dict[str, Any]) -> None:
        fsutil.atomic_write_json(self.config_path, config)

    def log_line(self, text: str) -> None:
        """A line of the agent's own into the output log (attempt separators), with one O_APPEND write."""
        fd = fsutil.open_private_append(self.log_path)
        try:
            os.write(fd, ("[onbox %s] %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), text)).encode("utf-8"))
        finally:
            os.close(fd)

    def rotate_log(self, max_bytes: int, backups: int) -> bool:
        """Copy-truncate rotation when output.log exceeds max_bytes.

        The child holds output.log open with O_APPEND: renaming would keep it writing into the renamed file, so
        the content is copied to output.log.1 and the file truncated; the child's next write lands at offset 0.
        A few lines written during the copy can be lost; that is the price of never touching the child's fds.
        """
        try:
            size = os.path.getsize(self.log_path)
        except OSError:
            return False
        if max_bytes <= 0 or size <= max_bytes:
            return False
        if backups <= 0:
            os.truncate(self.log_path, 0)
            return True
        for i in range(backups - 1, 0, -1):
            src = "%s.%d" % (self.log_path, i)
            if os.path.exists(src):
                os.replace(src, "%s.%d" % (self.log_path, i + 1))
        import shutil  # the agent's only: shutil pulls in bz2 and lzma, and `onbox status` reads run dirs too

        shutil.copyfile(self.log_path, self.log_path + ".1")
        os.truncate(self.log_path, 0)
        return True


class LogTailer:
    """Follows output.log from an offset, yielding whole new lines; survives copy-truncate rotation."""

    def __init__(self, path: str, from_end: bool = True, keep: int = TAIL_LINES) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""
        self.tail: Deque[str] = collections.deque(maxlen=keep)
        if from_end:
            try:
                self.offset = os.path.getsize(path)
            except OSError:
                self.offset = 0

    def read_new(self, limit: int = 4 * 1024 * 1024) -> List[str]:
        """New complete lines since the last call (at most `limit` bytes a call, so a flood cannot stall the loop)."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size < self.offset:  # truncated by rotation
            self.offset = 0
            self._partial = b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(min(limit, size - self.offset))
        self.offset += len(chunk)
        data = self._partial + chunk
        parts = data.split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > 64 * 1024:  # a line without end: hand it over in pieces
            parts.append(self._partial)
            self._partial = b""
        lines = [p.decode("utf-8", "replace").rstrip("\r") for p in parts]
        self.tail.extend(lines)
        return lines

    def flush_partial(self) -> List[str]:
        """The unterminated last line (after the child has exited)."""
        if not self._partial:
            return []
        line = self._partial.decode("utf-8", "replace")
        self._partial = b""
        self.tail.append(line)
        return [line]

    def reset_tail(self) -> None:
        self.tail.clear()


def tail_lines(path: str, n: int) -> List[str]:
    """The last n lines of a file (reads from the end; fine for big logs)."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            block = 64 * 1024
            data = b""
            pos = end
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:]
