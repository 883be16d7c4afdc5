"""Exceptions raised by teragram's library code.

The CLI prints any of these as one line (``teragram: error: ...``) and exits non-zero;
``serve/`` maps them to 4xx responses. Anything else escaping is a bug.
"""


class TeragramError(Exception):
    """Base class: an error the user can act on, with a one-line message."""


class IndexFormatError(TeragramError):
    """A file of the index is missing, truncated, corrupt or of another format version."""


class QueryError(TeragramError):
    """A query is malformed: unknown op, ids outside the vocabulary, empty where not allowed."""


class ClusterError(TeragramError):
    """Some shards of an index held by a Ray cluster (index/cluster.py) have no live holder left."""


class TokenizerMismatch(TeragramError):
    """The tokenizer given does not match the one the index was built with."""


class Cancelled(TeragramError):
    """A query stopped before its end because whoever asked for it cancelled it (index/cancel.py):
    a server's client that went away."""


class BuildError(TeragramError):
    """The build cannot proceed (missing input, output holds another index, bad tokenizer)."""


def os_error_line(e: OSError) -> str:
    """One line for an operating-system error (a full disk, a file that cannot be written): its
    cause and the file, for the CLIs. Everything the builder writes goes to a temporary name
    and is marked complete only after, so what completed before the error stays and a rerun of
    the same command resumes from it."""
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where} (completed work is kept: rerun the same command to resume)"
