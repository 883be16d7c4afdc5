"""`teragram VERB ...`: the one entry point, collecting every subsystem's verbs.

Each subsystem registers its own verbs, parser and handler side by side: index/cli.py
(verify, stats, tokenize, query), builder/cli.py (build, features), model/cli.py (train, eval,
sample, dense) and this module (serve). The entry point is the one place that composes them: it
names their CLI modules in VERB_MODULES and imports each when the parser is built, so no module
of serve/ imports builder/ (dependencies flow builder -> index <- model <- serve; see
tests/test_layering.py). Library errors (TeragramError) are printed as one line,
`teragram: error: ...`, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from teragram.index.errors import TeragramError, os_error_line

VERB_MODULES = ("teragram.builder.cli", "teragram.index.cli", "teragram.model.cli", "teragram.serve.cli")


def cmd_serve(args) -> int:
    from .app import ServeConfig, serve

    serve(
        ServeConfig(
            index=args.index,
            checkpoint=args.checkpoint,
            gate=args.gate,
            joint_gate=args.joint_gate,
            knn_keys=args.knn_keys,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            device=args.device,
        )
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    se = sub.add_parser("serve", help="HTTP server: index queries, completions, scoring")
    se.add_argument("--index", required=True)
    se.add_argument("--checkpoint", help="model run or checkpoint (without: index queries only)")
    se.add_argument("--gate", help="index gate (teragram eval --fit-gate) mixed into completions and /v1/score")
    se.add_argument("--joint-gate", metavar="FILE", help="a jointly trained model: this refit gate (eval --refit-gate) instead of its own")
    se.add_argument(
        "--knn-keys",
        metavar="RUN",
        help="a joint model whose gate reads dense_knn: the run whose hidden states key its kNN store (rebuilt at start)",
    )
    se.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    se.add_argument("--port", type=int, default=8080)
    se.add_argument("--api-key", help="require Authorization: Bearer KEY on every request")
    se.add_argument("--device", default="cpu")
    se.set_defaults(run=cmd_serve)


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
