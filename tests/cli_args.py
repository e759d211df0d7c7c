"""Command lines of the tests' pretrain_gpt.py runs, built from dicts of flags."""


def flags_to_argv(flags: dict) -> list[str]:
    """`{"--flag": value}` as argv: True is a switch, None or False leaves the flag out, the rest `--flag str(v)`."""
    argv = []
    for k, v in flags.items():
        if v is True:
            argv.append(k)
        elif v is not None and v is not False:
            argv += [k, str(v)]
    return argv
