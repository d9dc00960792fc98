"""Small text helpers: the progress line on stderr, thousands separators, an exception in one line."""

import sys


def progress(msg):
    """One status line on stderr, rewritten in place, only on a terminal."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[Kpeers: " + msg if msg else "\r\033[K")
        sys.stderr.flush()


def commas(n):
    return f"{n:,}"


def first_lines(e, limit=300):
    s = f"{type(e).__name__}: {e}".strip()
    s = " ".join(s.split())
    return s if len(s) <= limit else s[:limit - 3] + "..."
