"""Faster generation from exact matches: decoding at batch 1, greedy or sampled (--temperature,
--top-p), with drafts read off the index's longest match and the document cache
(model/generation/draft.py), against plain decoding.

    python -m benchmarks.generation prepare --data DATA --carry .carry19            # here
    python -m benchmarks.generation setup --carry .carry19 --work W --out OUT        # GPU: index, 125M, tiny
    python -m benchmarks.generation tune --work W --carry .carry19 --device cuda     # validation prompts
    python -m benchmarks.generation run --work W --carry .carry19 --device cuda --modes plain,ours
    python -m benchmarks.generation report --parts P... --name generation_gpu
    python -m benchmarks.generation replay --parts P --index IDX --name generation_policies  # here

Prompts: 128 tokens from a hash-chosen place in held-out documents, 100 test and 30 validation
documents per set: `code` (kernel files new in linux-source-6.12, absent from the indexed 6.1)
and `english` (prose from a source no index holds); DATA is benchmarks/index_size_data.py's.
Models: the perplexity benchmark's 125M (a) (no index inputs, 1,500 steps on the ~47M tokens
of DATA/ppl/train-*), and a tiny model for CPU runs; the index is that training text.
Modes, each 256 new tokens per prompt: plain (no drafts), ours (index + document cache), pld
(document cache only: prompt-lookup decoding, the peer), prov (ours with per-token provenance).
The draft length and threshold are chosen on the validation prompts (`tune`); the test
prompts are only reported. Every mode's tokens are compared with plain's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import commit, read_jsonl, save, sh, smoke_context, smoke_data, smoke_index, smoke_model, table

SETS = {"code": "timeshift", "english": "prose"}
PROMPT_TOKENS = 128
MODES = {
    "plain": dict(max_tokens=0),
    "ours": dict(),
    "pld": dict(sources=("cache",)),
    "prov": dict(),
}
GRID = [dict(max_tokens=n, min_prob=p) for n in (8, 16, 32) for p in (0.03, 0.1, 0.3)]


def _hash(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "big")


def stage_prepare(data: Path, carry: Path, n_test: int, n_valid: int) -> None:
    """Prompts (token ids) and what the GPU machine needs to rebuild index and models."""
    from teragram.index.tokenizer import load

    carry.mkdir(parents=True, exist_ok=True)
    for name in ("train-code.jsonl.zst", "train-english.jsonl.zst"):
        shutil.copyfile(data / "ppl" / name, carry / name)
    shutil.copyfile(data / "idx-050m" / "tokenizer.model", carry / "tokenizer.model")
    sp = load(carry / "tokenizer.model")
    prompts: dict = {}
    for name, held in SETS.items():
        for half, n in (("valid", n_valid), ("test", n_test)):
            docs = sorted(read_jsonl(data / "heldout" / held / f"{half}.jsonl.zst"), key=lambda d: _hash(d["path"]))
            out = []
            for d in docs:
                ids = sp.encode(d["text"])
                if len(ids) < PROMPT_TOKENS:
                    continue
                o = _hash(d["path"] + ":prompt") % (len(ids) - PROMPT_TOKENS + 1)
                out.append({"path": d["path"], "offset": o, "ids": [int(t) for t in ids[o : o + PROMPT_TOKENS]]})
                if len(out) == n:
                    break
            prompts.setdefault(name, {})[half] = out
            print(f"{name}/{half}: {len(out)} prompts")
    (carry / "prompts.json").write_text(json.dumps(prompts))
    print(f"{carry}: {sum(p.stat().st_size for p in carry.rglob('*') if p.is_file()) / 1e6:.1f} MB")


def stage_setup(carry: Path, work: Path, out: Path | None, tiny_steps: int) -> None:
    """The index of the training text, the 125M (a) and a tiny model (exported in bf16 to OUT)."""
    from benchmarks.perplexity import SCALES, train_cmd

    t = time.time()
    train = [carry / "train-code.jsonl.zst", carry / "train-english.jsonl.zst"]
    tk = carry / "tokenizer.model"
    sh(
        sys.executable,
        "-m",
        "teragram.builder.cli",
        *train,
        "--out",
        work / "idx",
        "--tokenizer",
        tk,
        "--workers",
        os.cpu_count(),
        "--quiet",
    )
    phases = {"index_s": time.time() - t}
    t = time.time()
    sh(*train_cmd("a", work, SCALES["gpu"]))
    phases["train_125m_s"] = time.time() - t
    if tiny_steps <= 0:
        (work / "setup.json").write_text(json.dumps(phases))
        return
    t = time.time()
    tiny = dict(preset="tiny", block_size=512, batch_size=32, steps=tiny_steps, lr=3e-3, min_lr=3e-4, warmup=50)
    sh(*train_cmd("a", work, tiny, out=work / "runs" / "tiny"))
    phases["train_tiny_s"] = time.time() - t
    if out is not None:
        export_bf16(work / "runs" / "tiny", out / "tiny")
    (work / "setup.json").write_text(json.dumps(phases))
    print(json.dumps(phases))


def export_bf16(run: Path, dst: Path) -> None:
    """A checkpoint's weights in bf16 (half the bytes; load_model reads them back into fp32)."""
    import torch
    from safetensors.torch import load_file, save_file
    from teragram.index import format as fmt

    src = run / fmt.read_json(run / "latest.json")["checkpoint"]
    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(dst / "model.safetensors"))
    shutil.copyfile(src / "config.json", dst / "config.json")


def _self_repeats(ids: list[int], n0: int, k: int = 8) -> float:
    """Share of generated tokens whose preceding k tokens occurred earlier in the text."""
    seen, hits = set(), 0
    for i in range(k, len(ids)):
        key = tuple(ids[i - k : i])
        if i >= n0 and key in seen:
            hits += 1
        seen.add(key)
    return hits / max(len(ids) - n0, 1)


def decode(
    model,
    idx,
    prompts: list[list[int]],
    modes: dict[str, dict],
    new_tokens: int,
    deadline: float,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Each prompt in every mode in turn (so that a deadline cuts all modes at the same prompt):
    per mode, the tokens, seconds, and the drafts' statistics (one Drafter per mode and set,
    so it learns over the prompts as a server does). Greedy at temperature 0; else sampled
    (prompt i with seed i in every mode; drafts are verified by speculative sampling, which keeps
    the model's distribution but not its random draws, so sampled texts differ between modes)."""
    import torch
    from teragram.model.generation.draft import Drafter
    from teragram.model.generation.sample import generate

    drafters = {m: Drafter(**kw) for m, kw in modes.items()}
    out = {m: {"seconds": [], "tokens": [], "ids": [], "repeats": []} for m in modes}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i, p in enumerate(prompts):
        if time.time() > deadline:
            print(f"deadline: {i} of {len(prompts)} prompts", flush=True)
            break
        for m in modes:
            sync()
            t = time.perf_counter()
            g = generate(
                model,
                idx,
                p,
                max_new_tokens=new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=i,
                draft=drafters[m],
                provenance=m == "prov",
            )
            sync()
            out[m]["seconds"].append(time.perf_counter() - t)
            out[m]["tokens"].append(len(g.new_ids))
            out[m]["ids"].append(g.new_ids)
            out[m]["repeats"].append(_self_repeats(g.ids, g.n_prompt))
    for m in modes:
        out[m]["stats"] = drafters[m].stats.to_json()
    return out


def _load(work: Path, checkpoint: Path | None, index: Path | None, device: str):
    import torch
    from teragram.index.engine import Index
    from teragram.model.checkpoint import load_model

    torch.manual_seed(0)
    model, _ = load_model(checkpoint or work / "runs" / "a", device)
    idx = Index(index or work / "idx")
    return model, idx


def _warm(model, idx, prompt: list[int]) -> None:
    """JIT compilation, CUDA context and the pages of the index, before anything is timed."""
    from teragram.model.generation.draft import Drafter
    from teragram.model.generation.sample import generate

    for d in (0, Drafter(max_tokens=8)):
        generate(model, idx, prompt, max_new_tokens=32, temperature=0, draft=d, provenance=True)


def stage_tune(a) -> None:
    model, idx = _load(a.work, a.checkpoint, a.index, a.device)
    prompts = json.loads((a.carry / "prompts.json").read_text())
    _warm(model, idx, prompts["code"]["valid"][0]["ids"])
    deadline = time.time() + a.seconds
    rows = []
    modes = {"plain": MODES["plain"]} | {f"n{g['max_tokens']}-p{g['min_prob']}": g for g in GRID}
    res = {}
    for name in SETS:
        ps = [p["ids"] for p in prompts[name]["valid"][: a.prompts]]
        res[name] = decode(model, idx, ps, modes, a.new_tokens, deadline, a.temperature, a.top_p)
    for m, kw in modes.items():
        r = {"mode": m} | kw
        for name in SETS:
            n = len(res[name]["plain"]["seconds"])
            r[f"{name}_tok_s"] = sum(res[name][m]["tokens"][:n]) / sum(res[name][m]["seconds"][:n])
            r[f"{name}_speedup"] = r[f"{name}_tok_s"] / (sum(res[name]["plain"]["tokens"][:n]) / sum(res[name]["plain"]["seconds"][:n]))
            r[f"{name}_identical"] = sum(x == y for x, y in zip(res[name][m]["ids"], res[name]["plain"]["ids"]))
        r["score"] = float(np.sqrt(r["code_speedup"] * r["english_speedup"]))
        rows.append(r)
    best = max((r for r in rows if r["mode"] != "plain"), key=lambda r: r["score"])
    choice = {"max_tokens": best["max_tokens"], "min_prob": best["min_prob"]}
    (a.work / "tuned.json").write_text(json.dumps(choice))
    cols = ["mode", "code_tok_s", "code_speedup", "english_tok_s", "english_speedup", "score", "code_identical", "english_identical"]
    md = f"Validation prompts ({a.prompts} per set, {a.new_tokens} new tokens, {_sampling(a.temperature, a.top_p)}); chosen: {choice} (best geometric mean of the two speedups)\n\n"
    info = {
        "rows": rows,
        "choice": choice,
        "prompts": a.prompts,
        "new_tokens": a.new_tokens,
        "temperature": a.temperature,
        "top_p": a.top_p,
    }
    save(a.name, info, md + table(rows, cols))
    print(md + table(rows, cols))


def stage_run(a) -> None:
    model, idx = _load(a.work, a.checkpoint, a.index, a.device)
    prompts = json.loads((a.carry / "prompts.json").read_text())
    tuned = json.loads((a.tuned or a.work / "tuned.json").read_text())
    _warm(model, idx, prompts["code"]["valid"][0]["ids"])
    modes = {m: (MODES[m] if m == "plain" else tuned | MODES[m]) for m in a.modes.split(",")}
    deadline = time.time() + a.seconds
    res = {}
    for name in a.sets.split(","):
        ps = [p["ids"] for p in prompts[name][a.half][: a.prompts]]
        res[name] = decode(model, idx, ps, modes, a.new_tokens, deadline, a.temperature, a.top_p)
    from teragram.model.generation.draft import Drafter

    default = Drafter()
    part = {
        "commit": commit(),
        "policy": {"index_draft": default.index_draft, "choose": default.choose},
        "half": a.half,
        "device": a.device,
        "checkpoint": str(a.checkpoint or "125m (a)"),
        "tuned": tuned,
        "new_tokens": a.new_tokens,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "index": str(a.index or "the training text's"),
        "sets": res,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(part))
    print(f"wrote {a.out}")


def _sampling(temperature: float, top_p: float) -> str:
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}, top-p {top_p:g}"


def stage_report(a) -> None:
    """Merge run parts (same prompts, other modes) into one table: tokens/s, speedup over
    plain, outputs identical to plain, tokens per forward pass, acceptance by match length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets: dict = {}
    meta: dict = {}
    runs = []
    for p in a.parts:
        part = json.loads(Path(p).read_text())
        meta = {k: v for k, v in part.items() if k != "sets"}
        runs.append(f"{Path(p).name} ({', '.join(next(iter(part['sets'].values())))}) at commit {part.get('commit', '?')}")
        for name, modes in part["sets"].items():
            sets.setdefault(name, {}).update(modes)
    rows = []
    for name, modes in sets.items():
        n = min(len(m["seconds"]) for m in modes.values())
        base = modes["plain"]
        base_rate = sum(base["tokens"][:n]) / sum(base["seconds"][:n])
        for m, r in modes.items():
            rate = sum(r["tokens"][:n]) / sum(r["seconds"][:n])
            same = sum(x == y for x, y in zip(r["ids"][:n], base["ids"][:n]))
            st = r["stats"]
            rows.append(
                {
                    "set": name,
                    "mode": m,
                    "prompts": n,
                    "tok_s": rate,
                    "speedup": rate / base_rate,
                    "identical": f"{same}/{n}",
                    "tok_per_fwd": st["tokens_per_forward"],
                    "accept": st["acceptance_rate"],
                    "self_repeat": float(np.mean(r["repeats"][:n])),
                }
            )
    cols = ["set", "mode", "prompts", "tok_s", "speedup", "identical", "tok_per_fwd", "accept", "self_repeat"]
    by = {f"{name}/{m}": sets[name][m]["stats"]["by_match_length"] for name in sets for m in sets[name] if m != "plain"}
    acc = ["", "Drafted tokens accepted, by source and length of the match they continue:", ""]
    for k, v in by.items():
        acc.append(f"- {k}: " + ", ".join(f"{b} {x['accepted']}/{x['drafted']}" for b, x in v.items()))
    md = (
        f"{_sampling(meta.get('temperature', 0), meta.get('top_p', 1)).capitalize()} decoding, batch 1, "
        f"{meta.get('new_tokens')} new tokens per prompt, on {meta.get('device')}; index {meta.get('index', '?')}; "
        f"model {meta.get('checkpoint')}; drafts {meta.get('tuned')} (chosen on validation prompts). "
        f"plain: no drafts; ours: drafts from the index's longest match or the document cache ({meta.get('policy')}: "
        "the index's draft is the ∞-gram's argmax token by token (top) or what followed the match's most recent "
        "occurrence (recent); the source is the one with more expected accepted tokens (expected) or the longer "
        "match (longer)); pld: the document cache only (prompt-lookup decoding); prov: ours with per-token "
        "provenance. identical: prompts whose tokens equal plain's; self_repeat: share of generated tokens "
        "whose preceding 8 tokens occurred earlier in the text (repetition loops make drafting easy). "
        f"Runs: {'; '.join(runs)}.\n\n"
    )
    md += table(rows, cols) + "\n" + "\n".join(acc)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(sets)
    ms = [m for m in ("plain", "pld", "ours", "prov") if all(m in sets[s] for s in names)]
    w = 0.8 / max(len(ms), 1)
    for j, m in enumerate(ms):
        ax.bar(
            np.arange(len(names)) + j * w, [next(r["tok_s"] for r in rows if r["set"] == s and r["mode"] == m) for s in names], w, label=m
        )
    ax.set_xticks(np.arange(len(names)) + w * (len(ms) - 1) / 2, names)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{_sampling(meta.get('temperature', 0), meta.get('top_p', 1))}, batch 1, {meta.get('device')}")
    ax.legend()
    fig.tight_layout()
    save(a.name, {"rows": rows, "meta": meta, "by_match_length": by}, md, fig)
    print(md)


POLICIES = {
    "pld": dict(sources=("cache",)),
    "longer-recent": dict(index_draft="recent", choose="longer"),
    "longer-top": dict(index_draft="top", choose="longer"),
    "expected-recent": dict(index_draft="recent", choose="expected"),
    "ours": dict(),  # the defaults: expected-top
    "index-recent": dict(sources=("index",), index_draft="recent"),
    "index-top": dict(sources=("index",), index_draft="top"),
}


def replay(idx, prompt: list[int], out: list[int], drafter) -> tuple[int, float]:
    """Greedy decoding's drafts and verifications without the model: with the model's greedy
    tokens `out` known, a drafted token is accepted exactly when it equals the next of them.
    Forward passes taken, and seconds spent drafting."""
    sc = idx.scorer(top_k=4, max_len=64)
    for t in prompt:
        sc.append(t)
    ids, i, forwards, spent = list(prompt), 0, 0, 0.0
    while i < len(out):
        t = time.perf_counter()
        d = drafter.propose(sc, sc.occurrence(), ids, len(out) - i - 1)
        spent += time.perf_counter() - t
        dt = d.tokens if d else []
        k = 0
        while k < len(dt) and dt[k] == out[i + k]:
            k += 1
        new = out[i : i + k + 1]
        drafter.stats.record(d, k, len(new))
        for tok in new:
            ids.append(tok)
            sc.append(tok)
        i += len(new)
        forwards += 1
    return forwards, spent


def stage_replay(a) -> None:
    """Draft policies compared on a run's greedy outputs (plain mode), here, with the index:
    tokens per forward pass and drafting time, for the same prompts and the same draft length
    and threshold."""
    from teragram.index.engine import Index
    from teragram.model.generation.draft import Drafter

    idx = Index(a.index)
    prompts = json.loads((a.carry / "prompts.json").read_text())
    rows, by, halves = [], {}, set()
    for p in a.parts:
        part = json.loads(Path(p).read_text())
        tuned = part["tuned"]
        halves.add(part.get("half", "test"))
        for name, modes in part["sets"].items():
            outs = modes["plain"]["ids"]
            ps = [x["ids"] for x in prompts[name][part.get("half", "test")][: len(outs)]]
            for pol, kw in POLICIES.items():
                dr = Drafter(**(tuned | kw))
                fw = sec = 0
                for pr, o in zip(ps, outs):
                    f, t = replay(idx, pr, o, dr)
                    fw, sec = fw + f, sec + t
                st = dr.stats.to_json()
                tok = sum(len(o) for o in outs)
                rows.append(
                    {"set": name, "policy": pol, "prompts": len(outs), "tok_per_fwd": tok / fw, "accept": st["acceptance_rate"]}
                    | {"draft_ms_per_fwd": 1e3 * sec / fw}
                )
                by[f"{name}/{pol}"] = st["by_match_length"]
                print(rows[-1], flush=True)
    cols = ["set", "policy", "prompts", "tok_per_fwd", "accept", "draft_ms_per_fwd"]
    md = (
        "Draft policies replayed on the greedy outputs of a run (`run --modes plain`): a drafted token is accepted exactly "
        "when it equals the model's next greedy token, so tokens per forward pass are those decoding would get, without "
        f"the model. Draft length and threshold {tuned}. pld: the document cache only (prompt-lookup decoding); "
        "longer-*: the longer of the index's longest match and the cache's; expected-*: the one with more expected "
        "accepted tokens (by the acceptance counts so far); *-recent: the index's draft is what followed its match's "
        "most recent occurrence; *-top: the ∞-gram's argmax, token by token; ours: the defaults (expected-top); "
        "index-*: the index alone. Prompts: the "
        f"{'/'.join(sorted(halves))} half.\n\n"
    )
    save(a.name, {"rows": rows, "by_match_length": by, "parts": a.parts}, md + table(rows, cols))
    print(md + table(rows, cols))


def main() -> None:
    if "--smoke" in sys.argv[1:]:  # every stage but setup (it trains the 125M) on the tiny DATA, model and index, on CPU
        with smoke_context(True) as tmp:
            carry, work, part = tmp / "carry", tmp / "work", tmp / "part.json"
            work.mkdir()
            model = ["--checkpoint", str(smoke_model(tmp)), "--index", str(smoke_index(tmp)), "--prompts", "1", "--new-tokens", "8"]
            for stage in (
                ["prepare", "--data", str(smoke_data(tmp)), "--prompts", "2", "--n-valid", "1"],
                ["tune", "--work", str(work), *model],
                ["run", "--work", str(work), *model, "--out", str(part)],
                ["report", "--parts", str(part)],
                ["replay", "--parts", str(part), "--index", str(smoke_index(tmp)), "--name", "generation_policies"],
                ["run", "--work", str(work), *model, "--temperature", "0.8", "--top-p", "0.95", "--out", str(tmp / "sampled.json")],
                ["report", "--parts", str(tmp / "sampled.json"), "--name", "generation_sampled"],
            ):
                sys.argv = [sys.argv[0], stage[0], "--carry", str(carry), *stage[1:]]
                main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "setup", "tune", "run", "report", "replay"])
    ap.add_argument("--data", type=Path, default=Path("/work/data14"))
    ap.add_argument("--carry", type=Path, default=Path(".carry19"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/gen"))
    ap.add_argument("--out", type=Path, help="setup: where the tiny model goes; run: the part's JSON file")
    ap.add_argument("--checkpoint", type=Path, help="default WORK/runs/a (the 125M)")
    ap.add_argument("--index", type=Path, help="default WORK/idx")
    ap.add_argument("--tuned", type=Path, help="default WORK/tuned.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="plain,ours,pld,prov")
    ap.add_argument("--sets", default="code,english")
    ap.add_argument("--half", default="test", choices=["valid", "test"], help="run: the prompts' half")
    ap.add_argument("--prompts", type=int, default=100, help="prompts per set (tune: validation prompts per set)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="tune, run: 0 greedy; else sampled (speculative sampling of drafts)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=1e9, help="start no prompt after this many seconds")
    ap.add_argument("--tiny-steps", type=int, default=2000)
    ap.add_argument("--n-valid", type=int, default=30)
    ap.add_argument("--parts", nargs="+", default=[])
    ap.add_argument("--name", default="generation")
    a = ap.parse_args()
    if a.stage == "prepare":
        stage_prepare(a.data, a.carry, a.prompts, a.n_valid)
    elif a.stage == "setup":
        stage_setup(a.carry, a.work, a.out, a.tiny_steps)
    elif a.stage == "tune":
        stage_tune(a)
    elif a.stage == "run":
        stage_run(a)
    elif a.stage == "replay":
        stage_replay(a)
    else:
        stage_report(a)


if __name__ == "__main__":
    main()
