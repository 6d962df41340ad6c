"""`kforge data-trace RUN --step N`: what one step of a run read, sample by sample. Imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kforge_cli.engine.data.trace import SampleTrace, StepTrace


def register(app: typer.Typer) -> None:
    app.command("data-trace")(data_trace)


def data_trace(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (holds config.toml).", metavar="RUN")],
    step: Annotated[int, typer.Option("--step", help="The optimizer step (1 is the first).", metavar="N")],
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank", help="Only this data-parallel rank's samples (default: the whole global batch).", metavar="R"
        ),
    ] = None,
    decode: Annotated[
        bool, typer.Option("--decode", help="Also print each sample's text (the run's tokenizer).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object: the step and every sample.")] = False,
) -> None:
    """Each sample step N read: its dataset, shard, token offset and length, and where documents end.

    Listed per micro-batch (gradient accumulation) and per data-parallel rank. With tensor, context or
    pipeline parallelism every rank of one data-parallel group reads the same samples: --rank is the
    data-parallel rank.

    The step is replayed, not looked up: from where its job (or a loss-spike rewind) began in the
    data order (RUN/data_positions.jsonl), with the settings in force then (config.toml plus the
    changes in config_changes.jsonl) and that job's batch size, accumulation and data-parallel size.

    So the answer is the same before and after a resume, a rewind or a change of the number of
    processes. Builds no model and loads no torch.
    """
    from kforge_cli.engine.data.trace import trace_step

    trace = trace_step(run_dir, step, rank=rank, decode=decode)
    if as_json:
        typer.echo(json.dumps(trace.to_dict(), indent=1))
        return
    typer.echo(_text(trace))


def _sample_line(s: SampleTrace) -> str:
    where = ", ".join(f"{Path(p.shard).name or 'built-in'}[{p.offset}:{p.offset + p.length}]" for p in s.pieces)
    ends = f"  documents end at {', '.join(map(str, s.document_ends))}" if s.document_ends else ""
    return f"  rank {s.rank} row {s.row}: {s.dataset} tokens {s.offset}+{s.length} (window {s.window}) in {where}{ends}"


def _since(t: StepTrace) -> str:
    if not t.since["line"]:
        return "step 0 (the run predates data_positions.jsonl and its settings never changed)"
    return f"data_positions.jsonl line {t.since['line']} ({t.since['reason']} at step {t.since['step']})"


def _text(t: StepTrace) -> str:
    who = "the global batch" if t.rank is None else f"data-parallel rank {t.rank}"
    lines = [
        f"step {t.step} of {t.run_dir}{'' if t.trained else ' (planned: not trained yet)'}: {who}, "
        f"{t.grad_accum_steps} micro-batch(es) x {t.dp_size} data-parallel rank(s) x {t.batch_size} sample(s) "
        f"of {t.seq_len} + 1 tokens",
        f"replayed from {_since(t)}; global sample {t.global_sample}, data step {t.data_step}",
    ]
    for skip in t.rewinds:
        lines.append(
            f"note: a loss-spike rewind (spike at step {skip.get('spike_step')}, detected at step "
            f"{skip.get('detected_at')}) went back to step {skip.get('rewound_to')}; the data this step read before "
            "it is skipped for good, this is what it read after"
        )
    for name, origin in t.datasets.items():
        lines.append(f"dataset {name}: {origin}")
    micro = -1
    for s in t.samples:
        if s.micro_batch != micro:
            micro = s.micro_batch
            lines.append(f"micro-batch {micro}:")
        lines.append(_sample_line(s))
        if s.text is not None:
            lines.append("    " + json.dumps(s.text, ensure_ascii=False))
    return "\n".join(lines)
