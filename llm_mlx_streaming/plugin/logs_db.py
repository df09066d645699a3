"""llm's log database, created and migrated once, under a lock, before any command runs.

llm creates and migrates ``logs.db`` at the start of every prompt, without a lock, so
prompts started together on a fresh user directory race inside llm's migrations
(``table "schemas" already exists``, ``UNIQUE constraint failed: _llm_migrations.name``)
and can leave the database unusable. Every llm process imports this plugin first, so the
plugin makes the database here: built under a temporary name while holding a file lock,
migrated with llm's own migrations, then renamed into place. A process that sees
``logs.db`` therefore sees it complete, and llm's own migration finds nothing to do.
"""

from __future__ import annotations

import os
from pathlib import Path


def prepare_logs_db() -> None:
    """Create and migrate llm's logs.db if it does not exist; never fails a command
    (llm's own behaviour is the fallback)."""
    try:
        import fcntl

        import llm
        import sqlite_utils
        from llm.migrations import migrate
    except ImportError:  # no fcntl (Windows), or an llm without these
        return
    try:
        folder = llm.user_dir()
        path = folder / "logs.db"
        if path.exists():
            return
        with open(folder / ".logs.db.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():  # another process made it while we waited
                return
            tmp = folder / f".logs.db.tmp-{os.getpid()}"
            _remove(tmp)
            db = sqlite_utils.Database(tmp)
            try:
                migrate(db)
            finally:
                db.close()
            os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - llm runs as it would without the plugin
        return


def _remove(db: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
