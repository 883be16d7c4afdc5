"""The serve verb: `teragram serve` (HTTP: index queries, completions, scoring)."""

from __future__ import annotations

import argparse
import os

from teragram.model.hf.cli import add_hf_args

API_KEY_ENV = "TERAGRAM_API_KEY"  # (here, not in guard.py: registering the verb must not import fastapi)


def cmd_serve(args) -> int:
    from .app import ServeConfig, serve

    serve(
        ServeConfig(
            index=args.index,
            checkpoint=args.checkpoint,
            hf_model=args.hf_model,
            dtype=args.dtype,
            context=args.context,
            gate=args.gate,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            device=args.device,
            cluster=args.cluster,
            replicas=args.replicas,
        )
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    se = sub.add_parser("serve", help="HTTP server: index queries, completions, scoring")
    se.add_argument("--index", required=True)
    se.add_argument("--checkpoint", help="model run or checkpoint (without it or --hf-model: index queries only)")
    add_hf_args(se)
    se.add_argument("--gate", help="index gate (teragram eval --fit-gate) mixed into completions and /v1/score")
    se.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    se.add_argument("--port", type=int, default=8080)
    se.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require Authorization: Bearer KEY on every request (default ${API_KEY_ENV}); needed to bind a public address",
    )
    se.add_argument("--device", default="cpu")
    se.add_argument("--cluster", metavar="ADDRESS", help="the index's shards held by actors on this Ray cluster (every endpoint)")
    se.add_argument("--replicas", type=int, default=1, help="with --cluster: holders of each group of shards, each on another node")
    se.set_defaults(run=cmd_serve)
