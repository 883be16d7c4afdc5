"""`teragram eval` end to end as a user runs it, on held-out text of growing size: tokens per second
and peak memory of `eval --gate` and `--fit-gate`, each stage's seconds, and the figures checked
against the library before streaming (issue 66).

    python -m benchmarks.eval_speed data --data DATA --index IDX --out CORPORA          # here
    python -m benchmarks.eval_speed run --run RUN --index IDX --corpora CORPORA \\
        [--sizes 1m 5m 20m] [--fit 10m] [--docs] [--alone 20m] [--device cpu] [--workers 2] [--baseline COMMIT] \\
        [--name eval_speed_cpu] [--out OUT]                                               # here or on a GPU

`data` writes held-out text no index here holds, nested by size: test-{1m,5m,20m}.jsonl.zst
(the first documents of one order of DATA/extra/gcc-12-source up to that many targets, counted
with IDX's tokenizer), valid-{1m,10m}.jsonl.zst (other documents of the same package), and
docs-18mb.jsonl.zst: 18 MB of plain-text documentation and a dictionary (linux-doc-6.1, then
dict-gcide), the corpus that was OOM-killed before streaming.

`run`: first `eval --fit-gate` on valid-1m (the gate every --gate row applies), then `eval
--gate` on each test size and the docs corpus, then `--fit-gate` on valid-{--fit} (its gate
applied to test-1m too: same choice, and test perplexity within 0.2% of the in-memory fit's),
and with --alone a plain `eval` (the model's stage alone) on test-SIZE: a gated row's wall time
over it is the "wall / model alone" column.
Each command runs in a fresh process, timed from its start (imports, the index's opening and
the numba kernels' cache included), its peak resident memory taken from the kernel (ru_maxrss:
the index's mapped pages included) and its anonymous memory sampled every 0.1 s (RssAnon: what
the run holds itself; the index's pages are the page cache's). --baseline COMMIT runs the 1m
rows with that commit's library as well (a `git archive` of it): the figures must agree within
0.2% (and the choice be the same) before anything is saved. Writes NAME.{json,md,png} under
benchmarks/results/, or with --out only OUT/NAME.json (from the GPU machine, merged here by
`report`).

    python -m benchmarks.eval_speed save --json OUT/eval_speed_gpu.json --name eval_speed_gpu    # here
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import SMOKE_HELP, library_at, library_env, save, smoke_context, smoke_index, smoke_model, table

SIZES = {"1m": 1_000_000, "5m": 5_000_000, "10m": 10_000_000, "20m": 20_000_000}
DOCS_BYTES = 18_000_000
TOLERANCE = 0.002  # the streamed figures against the library before it, and the sampled fit against the whole


# ---- data (here) --------------------------------------------------------------------------------


def _records(folder: Path):
    from benchmarks.common import read_jsonl

    for f in sorted(folder.glob("*.jsonl.zst")):
        yield from read_jsonl(f)


def data(data_dir: Path, index: Path, out: Path, sizes: dict[str, int] = SIZES, docs_bytes: int = DOCS_BYTES) -> dict:
    """The held-out corpora of `run` under out (see the module's docstring)."""
    from teragram.index import tokenizer

    from benchmarks.common import write_jsonl

    tok = tokenizer.load(index / "tokenizer.model")
    out.mkdir(parents=True, exist_ok=True)
    want = {"test": max(v for k, v in sizes.items() if k != "10m"), "valid": sizes.get("10m", max(sizes.values()))}
    got: dict[str, list] = {"test": [], "valid": []}
    n = {"test": 0, "valid": 0}
    for i, rec in enumerate(_records(data_dir / "extra" / "gcc-12-source")):
        half = "valid" if i % 3 == 2 else "test"  # one document in three is validation text
        if n[half] >= want[half]:
            if all(n[h] >= want[h] for h in n):
                break
            continue
        got[half].append(rec | {"targets": len(tok.encode(rec["text"])) + 1})
        n[half] += got[half][-1]["targets"]
    info = {}
    for name, size in sizes.items():
        for half in ("test", "valid") if name in ("1m",) else ("valid",) if name == "10m" else ("test",):
            recs, total = [], 0
            for r in got[half]:
                if total >= size:
                    break
                recs.append({k: v for k, v in r.items() if k != "targets"})
                total += r["targets"]
            info[f"{half}-{name}"] = write_jsonl(out / f"{half}-{name}.jsonl.zst", recs) | {"targets": total}
    recs, size = [], 0
    for folder in ("linux-doc-6.1", "dict-gcide"):
        for r in _records(data_dir / "extra" / folder):
            if size >= docs_bytes:
                break
            recs.append(r)
            size += len(r["text"].encode())
    info["docs-18mb"] = write_jsonl(out / "docs-18mb.jsonl.zst", recs) | {"text_bytes": size}
    (out / "corpora.json").write_text(json.dumps(info, indent=1))
    return info


# ---- run (here, or on the GPU machine) ---------------------------------------------------------


def _anon_peak(pid: int, stop: threading.Event, out: list) -> None:
    peak = 0
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            break
        stop.wait(0.1)
    out.append(peak / 1024)


def measured(cmd: list, env: dict | None = None) -> dict:
    """Run `teragram eval ... --json`: its report, wall seconds, peak RSS (MiB, ru_maxrss) and
    peak anonymous memory (MiB, sampled)."""
    t = time.time()
    with tempfile.TemporaryFile() as so:
        p = subprocess.Popen([str(c) for c in cmd], stdout=so, stderr=subprocess.PIPE, env=env, text=True)
        stop, anon = threading.Event(), []
        th = threading.Thread(target=_anon_peak, args=(p.pid, stop, anon))
        th.start()
        err = p.stderr.read()
        _, status, ru = os.wait4(p.pid, 0)
        stop.set()
        th.join()
        code = os.waitstatus_to_exitcode(status)
        so.seek(0)
        text = so.read().decode()
    if code != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))}: exit {code}\n{err[-3000:]}")
    return {
        "report": json.loads(text),
        "wall_s": time.time() - t,
        "peak_rss_mb": ru.ru_maxrss / 1024,
        "peak_anon_mb": anon[0] if anon else None,
    }


def _row(kind: str, corpus: str, m: dict) -> dict:
    rep = m["report"]
    st = rep.get("stages_s", {})
    slowest = max(st, key=st.get) if st else None
    return {
        "kind": kind,
        "corpus": corpus,
        "tokens": rep["tokens"] if "decontaminated" not in rep else rep["tokens"],
        "tokens_per_s": rep["tokens"] / m["wall_s"],
        "wall_s": m["wall_s"],
        "peak_rss_mb": m["peak_rss_mb"],
        "peak_anon_mb": m["peak_anon_mb"],
        "perplexity": rep["perplexity"],
        "model_perplexity": rep.get("model", rep)["perplexity"],
        "stages_s": st,
        "slowest_stage": slowest,
        "wall_over_slowest": m["wall_s"] / st[slowest] if slowest else None,
        "gate_choice": rep.get("gate_choice", {}).get("chosen"),
        "gate_fit_rows": rep.get("gate_fit_rows"),
    }


def run(args) -> dict:
    corpora, work = Path(args.corpora), Path(tempfile.mkdtemp(prefix="eval-speed-"))
    cli = ["benchmarks.eval_speed", "short-fits"] if args.smoke else ["teragram.serve.main"]  # the smoke's gate fits: 15 iterations
    base = [sys.executable, "-m", *cli, "eval", "--checkpoint", args.run, "--index", args.index]
    base += ["--json", "--quiet", "--device", args.device, "--workers", str(args.workers)]
    libs = {"now": None} | ({"before": library_at(args.baseline, work / "lib")} if args.baseline else {})
    rows = []
    for lib, path in libs.items():
        env = library_env(path)
        gate = work / f"gate-{lib}.json"
        rows.append(
            _row("fit-gate", "valid-1m", measured([*base, "--corpus", corpora / "valid-1m.jsonl.zst", "--fit-gate", gate], env))
            | {"library": lib}
        )
        rows.append(
            _row("gate", "test-1m", measured([*base, "--corpus", corpora / "test-1m.jsonl.zst", "--gate", gate], env)) | {"library": lib}
        )
        if lib == "now" and args.scaling_gate == "t":  # the scaling rows with the gate over the exact-match estimates alone
            gate = work / "gate-t.json"
            fit = measured([*base, "--corpus", corpora / "valid-1m.jsonl.zst", "--fit-gate", gate, "--no-cont-cache"], env)
            rows.append(_row("fit-gate (t)", "valid-1m", fit) | {"library": lib})
        for size in args.sizes if lib == "now" else []:
            if size != "1m" or args.scaling_gate == "t":
                m = measured([*base, "--corpus", corpora / f"test-{size}.jsonl.zst", "--gate", gate], env)
                rows.append(_row("gate" if args.scaling_gate == "product" else "gate (t)", f"test-{size}", m) | {"library": lib})
            print(json.dumps(rows[-1]), flush=True)
        if lib == "now" and args.docs:
            m = measured([*base, "--corpus", corpora / "docs-18mb.jsonl.zst", "--gate", gate], env)
            rows.append(_row("gate" if args.scaling_gate == "product" else "gate (t)", "docs-18mb", m) | {"library": lib})
    for size in args.alone or []:  # the model's stage alone: a plain eval
        m = measured([*base, "--corpus", corpora / f"test-{size}.jsonl.zst"])
        rows.append(_row("model alone", f"test-{size}", m) | {"library": "now"})
        print(json.dumps(rows[-1]), flush=True)
    if args.fit:
        big = work / "gate-big.json"
        rows.append(
            _row("fit-gate", f"valid-{args.fit}", measured([*base, "--corpus", corpora / f"valid-{args.fit}.jsonl.zst", "--fit-gate", big]))
            | {"library": "now"}
        )
        rows.append(
            _row("gate", "test-1m", measured([*base, "--corpus", corpora / "test-1m.jsonl.zst", "--gate", big]))
            | {"library": "now", "gate_from": f"valid-{args.fit}"}
        )
    checks = checks_of(rows, args.baseline)
    from benchmarks.common import commit, machine

    return {
        "run_on": {"commit": commit(), "machine": machine(), "command": " ".join(sys.argv)},
        "rows": rows,
        "checks": checks,
        "device": args.device,
        "workers": args.workers,
        "baseline": args.baseline,
        "run": args.run,
        "index": args.index,
    }


def checks_of(rows: list[dict], baseline: str | None) -> dict[str, bool]:
    """What the figures rest on: the gate fit on the big validation text (streamed, on a sample
    of --fit-rows tokens) makes the choice the 1m fit makes and is no worse on test-1m than it by
    more than TOLERANCE (more validation text may make it better); and the library before
    streaming (baseline) gives the same figures within TOLERANCE, the model's to 1e-6."""
    checks = {}
    now = [r for r in rows if r["library"] == "now"]
    big = [r for r in now if r.get("gate_from")]
    if big:
        fit = next(r for r in now if r["kind"] == "fit-gate" and r["corpus"] == big[0]["gate_from"])
        ref = next(r for r in now if r["kind"] == "fit-gate" and r["corpus"] == "valid-1m")
        small = next(r for r in now if r["kind"] == "gate" and r["corpus"] == "test-1m" and not r.get("gate_from"))
        checks[f"--fit-gate on {fit['corpus']}: the choice of the fit on valid-1m"] = fit["gate_choice"] == ref["gate_choice"]
        checks[f"--fit-gate on {fit['corpus']}: test-1m perplexity at most {TOLERANCE:.1%} above valid-1m's gate's"] = big[0][
            "perplexity"
        ] <= small["perplexity"] * (1 + TOLERANCE)
    for r in rows:
        if r["library"] == "before":
            x = next(x for x in now if x["kind"] == r["kind"] and x["corpus"] == r["corpus"] and not x.get("gate_from"))
            checks[f"{r['kind']} {r['corpus']}: perplexity within {TOLERANCE:.1%} of {baseline}'s"] = (
                abs(x["perplexity"] / r["perplexity"] - 1) <= TOLERANCE
            )
            checks[f"{r['kind']} {r['corpus']}: the model's perplexity as {baseline}'s"] = (
                abs(x["model_perplexity"] / r["model_perplexity"] - 1) <= 1e-6
            )
            checks[f"{r['kind']} {r['corpus']}: the choice of {baseline}"] = x["gate_choice"] == r["gate_choice"]
    return checks


def _over_alone(r: dict, rows: list[dict]) -> str:
    """A gated row's wall time over the model alone's on the same text (a plain eval's), if run."""
    alone = [x for x in rows if x["kind"] == "model alone" and x["corpus"] == r["corpus"]]
    return f"{r['wall_s'] / alone[0]['wall_s']:.2f}" if alone and r["kind"].startswith("gate") and not r.get("gate_from") else ""


def markdown(res: dict) -> str:
    rows = [
        {
            "command": r["kind"],
            "text": r["corpus"] + (f" (gate of {r['gate_from']})" if r.get("gate_from") else ""),
            "library": r["library"],
            "tokens": f"{r['tokens']:,}",
            "tokens/s": f"{r['tokens_per_s']:,.0f}",
            "wall s": f"{r['wall_s']:.1f}",
            "peak RSS MiB": f"{r['peak_rss_mb']:,.0f}",
            "peak anon MiB": f"{r['peak_anon_mb']:,.0f}" if r["peak_anon_mb"] else "",
            "perplexity": f"{r['perplexity']:.4f}",
            "choice": r["gate_choice"] or "",
            "wall / model alone": _over_alone(r, res["rows"]),
            "slowest stage (s)": f"{r['slowest_stage']} ({r['stages_s'][r['slowest_stage']]:.1f})" if r["slowest_stage"] else "",
            "stages (s)": ", ".join(f"{k} {v:.1f}" for k, v in r["stages_s"].items()),
        }
        for r in res["rows"]
    ]
    cols = list(rows[0]) if rows else []
    checks = "\n".join(f"- {'ok' if ok else 'FAILED'}: {k}" for k, ok in res["checks"].items())
    on = res.get("run_on") or {}
    where = f"Run as `{on.get('command')}` at commit `{on.get('commit')}` on {on.get('machine')}; " if on else ""
    return (
        f"{where}device {res['device']}, {res['workers']} estimate workers\n\n"
        + table(rows, cols)
        + ("\n\nChecks:\n" + checks if checks else "")
    )


def report(res: dict, name: str, out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
        print(markdown(res))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    gate = [
        r
        for r in res["rows"]
        if r["kind"].startswith("gate") and r["library"] == "now" and r["corpus"].startswith("test") and not r.get("gate_from")
    ]
    x = [r["tokens"] / 1e6 for r in gate]
    ax[0].plot(x, [r["tokens_per_s"] for r in gate], "o-")
    ax[0].set(xlabel="held-out tokens (M)", ylabel="tokens/s, end to end", title="eval --gate", xscale="log")
    ax[1].plot(x, [r["peak_rss_mb"] for r in gate], "o-", label="peak RSS (index pages included)")
    ax[1].plot(x, [r["peak_anon_mb"] or 0 for r in gate], "s-", label="peak anonymous memory")
    ax[1].set(xlabel="held-out tokens (M)", ylabel="MiB", xscale="log", title="memory")
    ax[1].legend()
    save(name, res, markdown(res), fig, checks=res["checks"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    sub = ap.add_subparsers(dest="cmd")
    d = sub.add_parser("data")
    d.add_argument("--data", required=True)
    d.add_argument("--index", required=True)
    d.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--run", required=True)
    r.add_argument("--index", required=True)
    r.add_argument("--corpora", required=True)
    r.add_argument("--sizes", nargs="+", default=["1m", "5m", "20m"])
    r.add_argument("--fit", help="also --fit-gate on valid-FIT (e.g. 10m)")
    r.add_argument("--docs", action="store_true", help="also eval --gate on docs-18mb")
    r.add_argument("--alone", nargs="*", default=[], metavar="SIZE", help="also a plain eval (the model alone) on test-SIZE")
    r.add_argument(
        "--scaling-gate",
        choices=["product", "t"],
        default="product",
        help="the gate of the rows past test-1m: the product's (--fit-gate's choice), or (t), the exact-match estimates alone",
    )
    r.add_argument("--device", default="cpu")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--baseline", help="a commit whose library runs the 1m rows too")
    r.add_argument("--name", default="eval_speed_cpu")
    r.add_argument("--out", help="write only OUT/NAME.json (the GPU machine's)")
    sv = sub.add_parser("save")
    sv.add_argument("--json", required=True, help="OUT/NAME.json of `run --out` (the GPU machine's)")
    sv.add_argument("--name", required=True)
    sv.add_argument("--run-commit", help="the commit the run measured (a JSON that does not record it)")
    sv.add_argument("--run-machine", help="the machine it ran on, in words (a JSON that does not record it)")
    sv.add_argument("--run-command", help="the command that made it there")
    if argv is None and sys.argv[1:2] == ["short-fits"]:  # a smoke run's child: `teragram` with short gate fits
        from teragram.serve.main import main as teragram

        from benchmarks.common import smoke_short_fits

        smoke_short_fits()
        sys.exit(teragram(sys.argv[2:]))
    args = ap.parse_args(argv)
    with smoke_context(args.smoke) as tmp:
        if args.smoke:
            idx = smoke_index(tmp)
            corpora = tmp / "corpora"
            corpora.mkdir()
            from benchmarks.common import smoke_jsonl

            for name in ("test-1m", "valid-1m", "valid-2m"):
                (corpora / f"{name}.jsonl.zst").write_bytes(smoke_jsonl(tmp, heldout=True).read_bytes())
            ns = argparse.Namespace(
                run=str(smoke_model(tmp)), index=str(idx), corpora=str(corpora), sizes=["1m"], fit="2m", docs=False, device="cpu", workers=1
            )
            ns.alone = ["1m"]
            ns.baseline, ns.smoke, ns.scaling_gate = None, True, "product"
            report(run(ns), "eval_speed_smoke", None)
        elif args.cmd == "data":
            print(json.dumps(data(Path(args.data), Path(args.index), Path(args.out)), indent=1))
        elif args.cmd == "run":
            report(run(args), args.name, Path(args.out) if args.out else None)
        elif args.cmd == "save":  # a run's JSON from the GPU machine, saved here with its checks made again
            res = json.loads(Path(args.json).read_text())
            res["checks"] = checks_of(res["rows"], res.get("baseline"))
            given = {"commit": args.run_commit, "machine": args.run_machine, "command": args.run_command}
            res["run_on"] = res.get("run_on", {}) | {k: v for k, v in given.items() if v}  # a copy without .git records "unknown"
            report(res, args.name, None)
        else:
            ap.error("give data, run or --smoke")


if __name__ == "__main__":
    main()
