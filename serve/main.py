"""`teragram VERB ...`: the one entry point, collecting every subsystem's verbs.

Each subsystem registers its own verbs, parser and handler side by side: index/cli.py
(verify, warm, stats, tokenize, query), builder/cli.py (build, features), model/cli.py (train, eval,
evals, sample, dense) and serve/cli.py (serve). This module only composes them: it names their
CLI modules in VERB_MODULES and imports each when the parser is built, so no module of serve/
imports builder/ (dependencies flow builder -> index <- model <- serve; see
tests/test_layering.py). Library errors (TeragramError) are printed as one line,
`teragram: error: ...`, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from teragram.index.errors import TeragramError, os_error_line

VERB_MODULES = ("teragram.builder.cli", "teragram.index.cli", "teragram.model.cli", "teragram.serve.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="teragram", description="Exact-match retrieval-augmented language modelling.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "overrides_ok", False):
        parser.parse_args(argv)  # reports the unknown arguments and exits
    args.overrides = extra
    try:
        return args.run(args)
    except TeragramError as e:
        print(f"teragram: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # a full disk, an unwritable file: what completed stays, a rerun resumes
        print(f"teragram: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
