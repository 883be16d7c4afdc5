"""The model's verbs: `teragram train | eval | sample | dense | export` (registered as index/cli.py's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from teragram.index.cli import add_cluster_args, opened_index, print_json
from teragram.model.evaluation.stream import CHUNK_TOKENS, FIT_ROWS
from teragram.model.hf.cli import add_hf_args


def cmd_train(args) -> int:
    from teragram.model.config import load
    from teragram.model.training.train import TrainConfig, train

    cfg = load(TrainConfig, args.config, args.overrides)
    r = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        loss = r.get("loss", float("nan"))
        msg = f"trained {cfg.out}: step {r['step']}" + (f", loss {loss:.4f}" if loss == loss else " (already complete)")
        if "eval" in r:
            msg += f", held-out perplexity {r['eval']['perplexity']:.3f} ({r['eval']['bits_per_byte']:.4f} bits/byte)"
        print(msg)
    return 0


def cmd_eval(args) -> int:
    from teragram.index.errors import TeragramError
    from teragram.model.evaluation.perplexity import EvalOptions
    from teragram.model.mixture import baselines
    from teragram.model.mixture.gate import Gate

    _check_eval_args(args)
    opts = EvalOptions(
        gate=Gate.load(args.gate) if args.gate else None,
        fit_gate=bool(args.fit_gate),
        baseline=args.baseline,
        params=baselines.load_params(args.lambdas, args.baseline) if args.lambdas else None,
        decontaminate=args.decontaminate,
        cont_cache=not args.no_cont_cache,
        dense=args.dense,
        workers=args.workers,
        chunk_tokens=args.chunk_tokens,
        fit_rows=args.fit_rows,
        spill=args.spill,
    )
    try:
        r, fitted, model_id = _eval_outputs(args, opts) if args.outputs else _eval_checkpoint(args, opts)
    except (MemoryError, RuntimeError) as e:  # torch's out-of-memory errors are RuntimeErrors
        if not isinstance(e, MemoryError) and "out of memory" not in str(e).lower():
            raise
        raise TeragramError(
            f"out of memory with --chunk-tokens {args.chunk_tokens:,}"
            + (f" and --fit-rows {args.fit_rows:,}" if args.fit_gate else "")
            + ": lower it"
        ) from None
    if args.fit_gate:
        from teragram.model.mixture.gate import index_digest

        fitted.fit_for = {"index": index_digest(args.index)} | ({"model": model_id} if model_id else {})
        fitted.save(args.fit_gate)
    if args.fit_lambdas:
        baselines.save_params(args.fit_lambdas, args.baseline, fitted)
    if args.gate or args.fit_gate:
        r["gate"] = args.gate or args.fit_gate
    if args.baseline:
        r["baseline"] = args.baseline
    _print_eval(args, r)
    return 0


def _check_eval_args(args) -> None:
    """Combinations of `teragram eval` options that cannot work, refused before any work."""
    from teragram.index.errors import TeragramError

    if args.baseline and not (args.fit_lambdas or args.lambdas):
        raise TeragramError("--baseline needs --fit-lambdas OUT (fit on validation text) or --lambdas FILE")
    if (args.fit_lambdas or args.lambdas) and not args.baseline:
        raise TeragramError("--fit-lambdas / --lambdas go with --baseline infini-gram|infini-gram+cache|knn")
    if args.baseline and (args.gate or args.fit_gate):
        raise TeragramError("give either the index gate (--gate / --fit-gate) or --baseline, not both")
    if args.no_cont_cache and not args.fit_gate:
        raise TeragramError("--no-cont-cache goes with --fit-gate (a fitted gate says itself whether it reads the continuous cache)")
    if args.cont_cache_from and not args.save_outputs:
        raise TeragramError("--cont-cache-from goes with --save-outputs")
    if args.outputs and (args.checkpoint or args.hf_model or args.corpus or args.save_outputs):
        raise TeragramError("--outputs replaces --checkpoint / --hf-model and --corpus (the model already ran)")
    if not args.outputs and not ((args.checkpoint or args.hf_model) and args.corpus):
        raise TeragramError("give --checkpoint (or --hf-model) and --corpus (or --outputs from an earlier --save-outputs)")


def _eval_outputs(args, opts):
    """(report, fitted, the model's digest) of saved outputs mixed with the index (--index, or
    held by a cluster's holders: --cluster, which compute the estimates)."""
    from teragram.model.evaluation.outputs import load_outputs, outputs_report

    outputs = load_outputs(args.outputs)
    model_id = outputs.manifest.get("model")  # outputs saved before it was recorded: not checked
    if opts.gate is not None:
        opts.gate.check(model=model_id, index_dir=args.index, name=args.gate)
    with opened_index(args) as idx:
        r, fitted = outputs_report(outputs, idx, opts)
    return r, fitted, model_id


def _eval_checkpoint(args, opts):
    """(report, fitted, the model's digest) of a checkpoint run over held-out text, against the
    index (local, or held by a cluster's holders: --cluster); the checkpoint is read first, so
    that one it cannot load is refused before the index is opened (a transformers model's
    tokenizer is checked against the index's before its weights are read)."""
    from teragram.index.engine import Index
    from teragram.model.checkpoint import weights_digest
    from teragram.model.hf.cli import model_of

    model, meta = model_of(args, Index(args.index) if args.hf_model else None)
    model_id = weights_digest(model)
    if opts.gate is not None:
        opts.gate.check(model=model_id, index_dir=args.index, name=args.gate)
    with opened_index(args) as idx:
        return (*_checkpoint_report(args, opts, model, meta, idx), model_id)


def _checkpoint_report(args, opts, model, meta: dict, idx):
    """(report, fitted) of the loaded model over --corpus against the opened index idx, streamed
    a chunk of documents at a time (model/evaluation/stream.py): read, run, saved (with
    --save-outputs) and mixed, the model a chunk ahead of the index's estimates."""
    from teragram.index.errors import TokenizerMismatch
    from teragram.model.evaluation import stream
    from teragram.model.evaluation.mixing import mix_stream
    from teragram.model.evaluation.perplexity import Stages, model_chunks, needs_states
    from teragram.model.mixture import cont_cache as cc

    if model.cfg.vocab_size != idx.vocab_size:
        raise TokenizerMismatch(f"checkpoint vocabulary {model.cfg.vocab_size} != index vocabulary {idx.vocab_size}")
    stages, skipped = Stages(), []
    if args.features_out:
        from teragram.index.features import FeatureConfig
        from teragram.index.heldout import compute_held_out

        with stages("features"):
            compute_held_out(idx, args.features_out, FeatureConfig("held-out", model.cfg.max_match, max(model.cfg.top_k, 1)), args.corpus)
        chunks = stream.heldout_chunks(
            args.features_out, opts.chunk_tokens, features=model.cfg.use_index, split=model.cfg.block_size * args.batch_size
        )
        total, unit = fmt_total(args.features_out), "tok"
    else:
        chunks = stream.corpus_chunks(idx, args.corpus, opts.chunk_tokens, skipped, split=model.cfg.block_size * args.batch_size)
        total, unit = (None if args.quiet or args.json else stream.text_size(args.corpus)), "B"
    knn = opts.baseline == "knn"
    hidden = "final" if knn else cc.KEY if needs_states(opts) or args.save_outputs else False
    chunks = model_chunks(model, idx, chunks, args.device, batch=args.batch_size, hidden=hidden, stages=stages)
    if args.save_outputs:
        from teragram.model.checkpoint import weights_digest
        from teragram.model.evaluation.outputs import OutputsWriter, saving

        source = args.checkpoint or args.hf_model
        w = OutputsWriter(args.save_outputs, idx, checkpoint=source, step=meta["step"], model=weights_digest(model))
        spec = cont_cache_spec(args.cont_cache_from) if args.cont_cache_from else None
        chunks = saving(chunks, w, spec, args.device, keep_hidden=knn)
    chunks = stream.progress(stream.prefetch(chunks), total, unit=unit, quiet=args.quiet or args.json)
    r, fitted = mix_stream(chunks, idx, opts, device=args.device, stages=stages)
    if skipped:
        r["skipped_records"] = len(skipped)
    return r, fitted


def fmt_total(features_dir) -> int:
    """Targets of a held-out features directory (its positions: each document's tokens + 1)."""
    from teragram.index import format as fmt

    return int(fmt.read_json(Path(features_dir) / "manifest.json")["positions"])


def _print_eval(args, r: dict) -> None:
    source = args.outputs or args.checkpoint or args.hf_model
    if args.json:
        print_json(r)
    else:
        msg = f"{source}: perplexity {r['perplexity']:.3f}, {r['bits_per_byte']:.4f} bits/byte over {r['tokens']:,} tokens ({r['bytes']:,} bytes)"
        if "gate" in r:
            msg += f" with the index gate {r['gate']}"
            if "gate_choice" in r:
                ch = r["gate_choice"]
                scores = ", ".join(f"{k} {v:.3f}" for k, v in ch["held_out_half_perplexity"].items())
                msg += f" ({ch['chosen']}, chosen on half the documents fit on the other half: {scores})"
        if "baseline" in r:
            msg += f" with the {r['baseline']} interpolation ({args.lambdas or args.fit_lambdas})"
        if "model" in r:
            msg += f"; the model alone: perplexity {r['model']['perplexity']:.3f}"
        if "decontaminated" in r:
            dc = r["decontaminated"]
            msg += f"; decontaminated: {dc['dropped_docs']} of {dc['docs']} documents dropped (>= 80% of their 13-grams in the index)"
        print(msg)


def cont_cache_spec(path: str):
    """The continuous cache's settings of a gate file or of saved outputs."""
    from teragram.index.errors import TeragramError
    from teragram.model.evaluation.outputs import load_outputs
    from teragram.model.mixture.gate import Gate

    spec = Gate.load(path).cont_cache if Path(path).is_file() else load_outputs(path).cont_cache
    spec = spec[0] if isinstance(spec, tuple) else spec
    if spec is None:
        raise TeragramError(f"{path}: no continuous cache in it (a gate fit with it, or outputs saved with it)")
    return spec


def cmd_sample(args) -> int:
    from teragram.index.engine import Index
    from teragram.model.checkpoint import weights_digest
    from teragram.model.hf.cli import model_of
    from teragram.model.mixture.gate import Gate

    model, _ = model_of(args, Index(args.index) if args.hf_model else None)
    gate = Gate.load(args.gate) if args.gate else None
    if gate is not None:
        gate.check(model=weights_digest(model), index_dir=args.index, name=args.gate)
    with opened_index(args) as idx:  # a cluster's holders keep the live lookups' state (index/cluster_scorer.py)
        return _sample(args, model, idx, gate)


def _sample(args, model, idx, gate) -> int:
    from teragram.model.generation.draft import Drafter
    from teragram.model.generation.sample import generate

    g = generate(
        model,
        idx,
        idx.tokenize(args.prompt),
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        gate=gate,
        draft=Drafter(max_tokens=args.draft),
        provenance=args.provenance,
    )
    print(idx.decode(g.ids))
    if args.provenance:
        print(provenance_table(idx, g.new_ids, g.provenance))
    if args.verbose:
        st = g.stats.to_json()
        print(f"[{len(g.new_ids)} tokens, {g.long_matches()} with an index match of >= 16 tokens; stopped: {g.stopped}]", file=sys.stderr)
        print(
            f"[{st['forward_passes']} forward passes, {st['tokens_per_forward']:.2f} tokens each; "
            f"{st['accepted']} of {st['drafted']} drafted tokens accepted; by match length: {json.dumps(st['by_match_length'])}]",
            file=sys.stderr,
        )
        if st["lookup_ms_median"] is not None:
            print(f"[index lookups per token: median {st['lookup_ms_median']:.3f} ms, mean {st['lookup_ms_mean']:.3f} ms]", file=sys.stderr)
    return 0


def positive(text: str) -> int:
    try:
        n = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: expected at least 1")
    return n


def draft_length(text: str) -> int:
    from teragram.model.generation.draft import MAX_DRAFT

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens") from None
    if not 0 <= n <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"{n}: expected 0 (no drafts) to {MAX_DRAFT} tokens")
    return n


def provenance_table(idx, ids: list[int], prov: list) -> str:
    """Runs of generated tokens whose longest index match lies in one document, one line each."""
    lines = ["provenance (tokens whose context matches >= 8 tokens of an indexed document):"]
    run: list[int] = []
    for j, p in enumerate(prov + [None]):
        prev = prov[j - 1] if j else None
        if run and (p is None or prev is None or p.doc_id != prev.doc_id):
            q = prov[run[-1]]
            text = idx.decode([ids[k] for k in run]).replace("\n", "\\n")
            lines.append(f"  {text[:60]!r:64} {q.source}#{q.record} token {q.offset} (match {q.length})")
            run = []
        if p is not None:
            run.append(j)
    return "\n".join(lines)


def cmd_evals(args) -> int:
    from teragram.index.engine import Index
    from teragram.index.errors import TeragramError
    from teragram.model.checkpoint import load_model, weights_digest
    from teragram.model.evaluation.tasks import TASKS, run_task
    from teragram.model.mixture.gate import Gate
    from tqdm import tqdm

    tasks = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    if (args.checkpoint is None) == (args.outputs is None):
        raise TeragramError("give --checkpoint (run the model) or --outputs (its saved outputs), not both")
    model = load_model(args.checkpoint, args.device)[0] if args.checkpoint else None
    idx = Index(args.index)
    gate = Gate.load(args.gate) if args.gate else None
    if gate is not None:
        gate.check(model=weights_digest(model) if model is not None else None, index_dir=args.index, name=args.gate)
    rows = []
    for name in tqdm(tasks, desc="tasks", disable=args.quiet):
        kw = dict(gate=gate, limit=args.limit, device=args.device, batch=args.batch, threads=args.workers)
        kw |= dict(save_dir=args.save_outputs, outputs_dir=args.outputs, index_side=not args.model_only)
        rows.append(run_task(model, idx, name, **kw))
    if args.model_only:
        for r in rows:
            print(f"{r['task']}: {r['examples']} examples, acc {r['model']['acc']:.4f}, acc_norm {r['model']['acc_norm']:.4f}")
        return 0
    if args.out:
        Path(args.out).write_text(
            json.dumps({"checkpoint": args.checkpoint, "index": args.index, "gate": args.gate, "tasks": rows}, indent=1)
        )
    if args.json:
        print_json(rows)
        return 0
    cols = ["model"] + (["gated"] if gate is not None else [])
    print(
        "| task | examples | "
        + " | ".join(f"{c} acc | {c} acc_norm" for c in cols)
        + " | contaminated | "
        + " | ".join(f"{c} acc_norm (clean)" for c in cols)
        + " |"
    )
    print("|---" * (3 + 3 * len(cols)) + "|")
    for r in rows:
        accs = " | ".join(f"{r[c]['acc']:.4f} | {r[c]['acc_norm']:.4f}" for c in cols)
        clean = " | ".join(f"{r[c + '_clean']['acc_norm']:.4f}" for c in cols)
        print(f"| {r['task']} | {r['examples']} | {accs} | {r['contaminated_share']:.1%} | {clean} |")
    return 0


def cmd_dense(args) -> int:
    from teragram.model.mixture.dense import build_store

    info = build_store(
        args.index, args.checkpoint, features_dir=args.features, n_positions=args.positions, device=args.device, out=args.out
    )
    print(
        f"dense store of {info['count']:,} keys ({info['dims']} dims, IVF{info['nlist']},PQ{info['m']}) -> {args.out or args.index + '/dense'}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """The model's verbs, each parser beside its handler."""
    from teragram.model.hf.cli import register as register_export

    _register_train(sub)
    _register_eval(sub)
    _register_evals(sub)
    _register_sample(sub)
    _register_dense(sub)
    register_export(sub)


def _register_train(sub) -> None:
    tr = sub.add_parser("train", help="train a GPT (with or without index inputs); extra --key=value override the config")
    tr.add_argument("--config", help="TOML file with TrainConfig fields")
    tr.set_defaults(run=cmd_train, overrides_ok=True)


def _register_eval(sub) -> None:
    ev = sub.add_parser("eval", help="held-out perplexity and bits per byte of a checkpoint")
    ev.add_argument("--checkpoint", help="run directory or checkpoint directory (or --hf-model, or --outputs)")
    add_hf_args(ev)
    ev.add_argument(
        "--batch-size", type=positive, default=16, metavar="N", help="windows of the model's context run at a time (default 16)"
    )
    ev.add_argument("--index", required=True)
    ev.add_argument("--corpus", nargs="+", help="held-out text (with --checkpoint)")
    ev.add_argument("--save-outputs", metavar="OUT", help="also save the model's per-token outputs here, to mix with any index later")
    ev.add_argument("--outputs", metavar="OUT", help="mix saved outputs (--save-outputs) with --index instead of running a model")
    ev.add_argument("--features-out", help="keep the held-out features here")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--gate", help="mix the model with the index's and the document cache's estimates by this gate (from --fit-gate)")
    ev.add_argument(
        "--fit-gate",
        metavar="OUT",
        help="fit the gate on this (validation) text and save it: the index gate (t) and the same gate with the continuous"
        " cache (t+cc), each fit on half the documents and scored on the other half; the better one is kept",
    )
    ev.add_argument("--no-cont-cache", action="store_true", help="with --fit-gate: the index gate alone, without the continuous cache")
    ev.add_argument(
        "--cont-cache-from",
        metavar="PATH",
        help="with --save-outputs: the continuous cache's scale of this gate (--fit-gate) or of these validation outputs"
        " (default: fit on this text, which should then be validation text)",
    )
    ev.add_argument(
        "--baseline",
        choices=["infini-gram", "infini-gram+cache", "knn"],
        help="a peer's interpolation instead of the gate: infini-gram's 2 λ; those plus the document cache's longest match"
        " (weights per group, by EM); or kNN-LM over IDX/dense",
    )
    ev.add_argument(
        "--fit-lambdas", metavar="OUT", help="fit the baseline's λ (and kNN temperature) on this (validation) text and save them"
    )
    ev.add_argument("--lambdas", metavar="FILE", help="apply the baseline's parameters from --fit-lambdas")
    ev.add_argument("--dense", help="the kNN baseline's dense store (default IDX/dense, from teragram dense)")
    ev.add_argument("--decontaminate", action="store_true", help="drop documents with >= 80%% of their 13-grams in the index")
    ev.add_argument(
        "--workers", type=int, default=1, help="threads for the index estimates (from 4 on, several chunks looked up at once: more memory)"
    )
    ev.add_argument(
        "--chunk-tokens",
        type=positive,
        default=CHUNK_TOKENS,
        metavar="N",
        help="tokens read, run and mixed at a time (a longer document in pieces); peak memory follows it (default %(default)s)",
    )
    ev.add_argument(
        "--fit-rows",
        type=positive,
        default=FIT_ROWS,
        metavar="N",
        help="with --fit-gate: each candidate gate is fit on a fixed random sample of at most N validation tokens (default %(default)s)",
    )
    ev.add_argument("--spill", metavar="DIR", help="where a fit's per-token inputs are spilled (default: the system's temporary directory)")
    add_cluster_args(ev)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--quiet", action="store_true")
    ev.set_defaults(run=cmd_eval)


def _register_evals(sub) -> None:
    es = sub.add_parser("evals", help="multiple-choice accuracy (HellaSwag, ARC, ...) with and without the index")
    es.add_argument("--checkpoint", help="the model (or --outputs)")
    es.add_argument("--outputs", metavar="DIR", help="the model's outputs saved by --save-outputs, instead of a model")
    es.add_argument("--save-outputs", metavar="DIR", help="save the model's per-candidate outputs here (for the index side elsewhere)")
    es.add_argument("--model-only", action="store_true", help="only the model's accuracy: no contamination check, no gate")
    es.add_argument(
        "--index",
        required=True,
        help="its tokenizer reads the tasks; its estimates feed --gate; contamination is checked against it",
    )
    es.add_argument("--gate", help="also score through the gated mixture (eval --fit-gate)")
    es.add_argument(
        "--tasks",
        default="hellaswag",
        help="comma-separated, or all: " + "hellaswag, arc_easy, arc_challenge, piqa, winogrande, sciq, openbookqa, boolq, social_iqa",
    )
    es.add_argument("--limit", type=int, help="the first N examples of each task")
    es.add_argument("--device", default="cpu")
    es.add_argument("--batch", type=int, default=32)
    es.add_argument("--workers", type=int, default=1, help="threads for the index estimates")
    es.add_argument("--out", help="write the results as JSON here")
    es.add_argument("--json", action="store_true")
    es.add_argument("--quiet", action="store_true")
    es.set_defaults(run=cmd_evals)


def _register_sample(sub) -> None:
    sa = sub.add_parser("sample", help="generate text with live index lookups")
    sa.add_argument("--checkpoint", help="run directory or checkpoint directory (or --hf-model)")
    add_hf_args(sa)
    sa.add_argument("--index", required=True)
    sa.add_argument("prompt")
    sa.add_argument("--max-tokens", type=int, default=100)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=0)
    sa.add_argument("--top-p", type=float, default=0.95)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--device", default="cpu")
    sa.add_argument("--gate", help="mix in the index's and the document cache's estimates with this gate (eval --fit-gate)")
    sa.add_argument(
        "--draft", type=draft_length, default=0, metavar="N", help="draft up to N tokens from exact matches, verified in one forward pass"
    )
    sa.add_argument("--provenance", action="store_true", help="list the indexed documents the generated text matches")
    sa.add_argument("--verbose", action="store_true", help="match and draft statistics")
    add_cluster_args(sa)
    sa.set_defaults(run=cmd_sample)


def _register_dense(sub) -> None:
    de = sub.add_parser("dense", help="kNN-LM datastore (FAISS IVF-PQ) of a model's hidden states at training positions")
    de.add_argument("index")
    de.add_argument("--checkpoint", required=True)
    de.add_argument("--features", help="training features (for a model with index inputs)")
    de.add_argument("--positions", type=int, default=1_000_000, help="training positions stored (a sample of whole windows)")
    de.add_argument("--out", help="default IDX/dense")
    de.add_argument("--device", default="cpu")
    de.set_defaults(run=cmd_dense)
