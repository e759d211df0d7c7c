"""Errors that mean "the user gave us something wrong".

Entry points catch `UserError` and print its message as one line (no traceback): the message must name
the offending flag, file or value and the rule it breaks. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: a flag combination, a file, a topology. The message is shown to the user as is."""


class ConfigError(UserError):
    """An invalid flag or combination of flags."""


class DataError(UserError):
    """A missing, corrupt or inconsistent data file (index, binary, tokenizer model)."""


class RankError(UserError):
    """A stop that only this rank sees (the others are stopped through the watchdog): printed here, not
    only on rank 0 as errors every rank raises alike are."""


def run_cli(body, *args) -> int:
    """Run a command-line tool's body: bad input prints one `error: ...` line to stderr and gives exit
    code 2; anything else is a bug and keeps its traceback."""
    import sys
    try:
        body(*args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


class SaveError(Exception):
    """Writing a checkpoint failed in the environment (disk full, read-only mount, I/O error). Not bad
    input, so not a UserError: entry points print its message as one line and exit with code 1. Every
    rank raises it with the same message (the ranks agree on the failure), after the failed save's
    `.partial` directory was removed; the last good checkpoint is untouched."""
