"""The options that run a transformers model where a native checkpoint runs (`--hf-model`,
`--dtype`, `--context`), and the `teragram export` verb (registered by model/cli.py)."""

from __future__ import annotations

import argparse

from teragram.model.hf import DTYPES


def add_hf_args(p: argparse.ArgumentParser) -> None:
    """--hf-model, --dtype, --context: a transformers causal LM instead of --checkpoint."""
    p.add_argument(
        "--hf-model",
        metavar="DIR",
        help="a transformers causal LM (a local directory, or a hub name where the hub is reachable) instead of --checkpoint;"
        " its tokenizer must be the index's",
    )
    p.add_argument("--dtype", choices=DTYPES, help="with --hf-model: its weights' dtype (default bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--context", type=int, metavar="N", help="with --hf-model: read at most N tokens at a time (default: its positions)")


def model_of(args, index=None):
    """(model, meta) of a verb's --checkpoint or --hf-model (checkpoint.load_lm)."""
    from teragram.model.checkpoint import load_lm

    if args.hf_model:
        _no_progress_bars()
    return load_lm(args.checkpoint, args.hf_model, index=index, device=args.device, dtype=args.dtype, context=args.context)


def _no_progress_bars() -> None:
    """transformers' bars for loading and writing weights (a verb prints its own lines)."""
    from teragram.model.hf.adapter import _transformers

    _transformers().utils.logging.disable_progress_bar()


def cmd_export(args) -> int:
    from teragram.model.hf.export import export_hf

    _no_progress_bars()
    r = export_hf(args.checkpoint, args.hf, index=args.index)
    print(
        f"exported {args.checkpoint} as {r['architecture']} ({r['params']:,} parameters, tokenizer checked on {r['texts_checked']} texts) -> {r['out']}"
    )
    return 0


def register(sub) -> None:
    ex = sub.add_parser("export", help="write a native checkpoint as a transformers model (config, safetensors, fast tokenizer)")
    ex.add_argument("--hf", required=True, metavar="OUT", help="the transformers model's directory")
    ex.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory (a plain model of the gpt2 block)")
    ex.add_argument("--index", help="the index whose tokenizer the model reads (default: the one the run trained on)")
    ex.set_defaults(run=cmd_export)
