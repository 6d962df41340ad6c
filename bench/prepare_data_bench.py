"""Benchmark: tokens/s of `kforge prepare-data` on a generated 100 MB text file.

Generates English-like text (the built-in corpus grammar, many seeds) in a temporary
directory, then prepares it with the byte tokenizer (automatic workers, then every
core forced), re-runs it (the no-op path), and prepares a slice with a small BPE
tokenizer trained on the same text (1 worker vs every core: BPE is where processes
pay off). Reports tokens/s, MB/s and the peak resident memory of the main process and
of the workers, then prints a table and writes bench/results/prepare_data.json.

    python bench/prepare_data_bench.py [--mb 100] [--bpe-mb 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kforge_cli.engine.data.builtin_corpus import generate_documents
from kforge_cli.engine.data.prepare.prepare_run import prepare_data

HERE = Path(__file__).resolve().parent


def _make_text(path: Path, megabytes: int) -> int:
    """Distinct stories (a new generator seed per ~1.5 MB) until the file has ``megabytes`` MB."""
    written, seed = 0, 1
    with open(path, "w", encoding="utf-8") as fh:
        while written < megabytes * 1_000_000:
            chunk = "".join(generate_documents(4500, seed=seed))
            fh.write(chunk)
            written += len(chunk.encode())
            seed += 1
    return written


def _train_bpe(sample: Path, out: Path, vocab_size: int = 8192, chars: int = 2_000_000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(sample, encoding="utf-8") as fh:
        tok.train_from_iterator(fh.read(chars).splitlines(), trainer)
    tok.save(str(out))


def _peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # kB on Linux


def _run(name: str, src: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    res = prepare_data([src], out, **kwargs)
    tokens = sum(res.tokens.values())
    return {
        "case": name,
        "tokenizer": "byte" if kwargs.get("tokenizer", "byte") == "byte" else "bpe-8192",
        "input_mb": round(res.input_bytes / 1e6, 1),
        "workers": res.workers,
        "reused": res.reused,
        "tokens": tokens,
        "seconds": round(res.seconds, 3),
        "tokens_per_s": None if res.reused else round(tokens / res.seconds),
        "mb_per_s": None if res.reused else round(res.input_bytes / 1e6 / res.seconds, 1),
        "dtype": res.dtype,
        "peak_rss_main_mb": round(_peak_mb(resource.RUSAGE_SELF)),
        "peak_rss_workers_mb": round(_peak_mb(resource.RUSAGE_CHILDREN)),
    }


def main(megabytes: int, bpe_megabytes: int, smoke: bool = False) -> list[dict[str, Any]]:
    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kforge-prepare-bench-") as tmp_s:
        tmp = Path(tmp_s)
        big = tmp / "corpus.txt"
        t0 = time.perf_counter()
        size = _make_text(big, megabytes)
        print(f"generated {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s; {cores} cores")
        rows.append(_run("byte, auto workers", big, tmp / "byte"))
        rows.append(_run("byte, re-run (no-op)", big, tmp / "byte"))
        shutil.rmtree(tmp / "byte")
        if not smoke:  # worker processes take seconds to start: a smoke run keeps to one
            rows.append(_run(f"byte, {cores} workers", big, tmp / "byte_all", workers=cores))
            shutil.rmtree(tmp / "byte_all")
        bpe = tmp / "bpe.json"
        _train_bpe(big, bpe, *((512, 200_000) if smoke else ()))
        part = tmp / "slice.txt"
        with open(big, "rb") as src, open(part, "wb") as dst:
            dst.write(src.read(bpe_megabytes * 1_000_000))
            dst.write(src.readline())  # end on a line boundary
        rows.append(_run("bpe, 1 worker", part, tmp / "bpe1", tokenizer=str(bpe), workers=1))
        if not smoke:
            rows.append(_run(f"bpe, {cores} workers", part, tmp / "bpeN", tokenizer=str(bpe), workers=cores))
    header = f"{'case':<24}{'MB':>7}{'workers':>8}{'tokens':>13}{'s':>8}{'tokens/s':>14}{'MB/s':>8}{'RSS MB':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        rate = "-" if r["reused"] else f"{r['tokens_per_s']:,}"
        print(
            f"{r['case']:<24}{r['input_mb']:>7}{r['workers']:>8}{r['tokens']:>13,}{r['seconds']:>8.3f}"
            f"{rate:>14}{r['mb_per_s'] or '-':>8}{r['peak_rss_main_mb']:>8}"
        )
    if smoke:  # checks the script; its figures mean nothing
        return rows
    (HERE / "results").mkdir(exist_ok=True)
    report = {
        "benchmark": "prepare_data",
        "machine": {
            "cores": cores,
            "load_average_1m": round(os.getloadavg()[0], 2),  # other jobs on the machine skew the numbers
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "rows": rows,
    }
    (HERE / "results" / "prepare_data.json").write_text(json.dumps(report, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=100, help="size of the generated text file in MB")
    parser.add_argument("--bpe-mb", type=int, default=10, help="size of the slice prepared with the BPE tokenizer")
    parser.add_argument("--smoke", action="store_true", help="1 MB, one worker, no results file (checks the script)")
    args = parser.parse_args()
    main(1 if args.smoke else args.mb, 1 if args.smoke else args.bpe_mb, smoke=args.smoke)
