"""`kforge inspect-ckpt`: what is in a checkpoint, on CPU, without a process group."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

if TYPE_CHECKING:
    from kforge_cli.engine.checkpoint.inspection import CheckpointSummary, DiffResult, TensorRecord, TensorStats

    _Block = tuple[str, int, list[TensorRecord]]  # (prefix, index, its tensors)

_Record = TypeVar("_Record")


def register(app: typer.Typer) -> None:
    app.command("inspect-ckpt")(inspect_ckpt)


def inspect_ckpt(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory (RUN_DIR/checkpoints/step_N) or a run dir.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    tensor: Annotated[str | None, typer.Option("--tensor", help="Statistics of one tensor by name.")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check the checkpoint is complete and readable.")] = False,
    diff: Annotated[
        Path | None,
        typer.Option(
            "--diff", help="Compare with another checkpoint (exit 1 when they differ, like diff).", metavar="CKPT"
        ),
    ] = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every tensor, optimizer state included, one row each.")
    ] = False,
) -> None:
    """Step, tokens, config summary and the tensors of a checkpoint.

    By default the model's tensors are grouped by block (the blocks that are alike in one row, one of
    them spelled out) and the optimizer state is one line per kind (exp_avg, exp_avg_sq, step, ...);
    --all lists every tensor. Works on any DCP checkpoint, however many ranks wrote it. With --verify:
    exit 2 when anything is missing, truncated or unreadable; --diff: the tensors that differ and by
    how much, exit 0 when identical and 1 when not.
    """
    from kforge_cli.errors import InvalidInputError

    if sum((tensor is not None, verify, diff is not None)) > 1:
        raise InvalidInputError("use one of --tensor, --verify and --diff at a time")
    if verify:
        _verify(path, as_json)
        return
    from kforge_cli.engine.checkpoint.reader import open_checkpoint

    view = open_checkpoint(path)
    if tensor is not None:
        from kforge_cli.engine.checkpoint.inspection import tensor_stats

        _emit(tensor_stats(view, tensor), as_json, _stats_text)
    elif diff is not None:
        from kforge_cli.engine.checkpoint.inspection import diff_checkpoints

        result = diff_checkpoints(view, open_checkpoint(diff))
        typer.echo(json.dumps(result.to_dict(), indent=1, default=str) if as_json else _diff_text(result))
        if not result.identical:
            raise typer.Exit(1)
    else:
        from kforge_cli.engine.checkpoint.inspection import summarize

        _emit(summarize(view), as_json, lambda data: _summary_text(data, show_all=show_all))


def _emit(data: _Record, as_json: bool, to_text: Callable[[_Record], str]) -> None:
    typer.echo(json.dumps(data, indent=1, default=str) if as_json else to_text(data))


def _verify(path: Path, as_json: bool) -> None:
    from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError
    from kforge_cli.engine.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(path)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
        if not report.ok:
            raise typer.Exit(CheckpointError.exit_code)
        return
    for w in report.warnings:
        typer.echo(f"warning: {w}", err=True)
    if not report.ok:
        n = len(report.problems)
        raise CheckpointError(
            f"{report.path} failed verification ({n} problem{'s' if n != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in report.problems)
        )
    typer.echo(
        f"OK {report.path}: complete; {report.tensors_read} tensors ({human_bytes(report.bytes_read)}) and "
        f"{report.items_read} other items read back from {report.files} shard file(s)"
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


WIDTH = 100  # columns every table row and wrapped line fits in


def _fit(text: str, width: int) -> str:
    """``text`` cut in the middle with '...' to at most ``width`` characters (both ends stay readable)."""
    if len(text) <= width:
        return text
    keep = width - 3
    return text[: keep // 2] + "..." + text[len(text) - (keep - keep // 2) :]


def _table(rows: list[list[str]], header: list[str], width: int = WIDTH) -> list[str]:
    """Columns padded to width: the first left-aligned (cut in the middle if the row would pass
    ``width`` columns), the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    room = width - sum(widths[1:]) - 2 * (len(widths) - 1)
    if widths[0] > room:
        widths[0] = max(room, 12)
        header = [_fit(header[0], widths[0]), *header[1:]]
        rows = [[_fit(r[0], widths[0]), *r[1:]] for r in rows]

    def fmt(row: list[str]) -> str:
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


def _wrap(text: str, width: int = WIDTH) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def _group(name: str) -> str:
    head = name.split(".", 1)[0]
    return head if head in ("model", "optimizer") else "other"


def _shape(t: TensorRecord) -> str:
    return "x".join(map(str, t["shape"])) or "scalar"


def _block_key(name: str) -> tuple[str, int, str] | None:
    """``layers.3.attention.wq.weight`` -> ("layers", 3, "attention.wq.weight"); None outside a numbered block."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _model_rows(tensors: list[TensorRecord], shards: bool) -> list[list[str]]:
    """The model's tensors, each run of alike blocks (same tensors, shapes, dtypes) as one row and
    the first of them spelled out beneath it; other tensors one row each."""
    rows: list[list[str]] = []
    pending: list[_Block] = []  # in order
    items: list[TensorRecord | _Block] = []  # a tensor outside the blocks, or a block
    for t in tensors:
        name = t["name"].removeprefix("model.")
        key = _block_key(name)
        if key is None:
            items.append({**t, "name": name})
            continue
        prefix, index, rest = key
        if pending and pending[-1][:2] == (prefix, index):
            pending[-1][2].append({**t, "name": rest})
        else:
            pending.append((prefix, index, [{**t, "name": rest}]))
            items.append(pending[-1])

    def signature(block: _Block) -> tuple[str, tuple[tuple[str, tuple[int, ...], str], ...]]:
        return (block[0], tuple((t["name"], tuple(t["shape"]), t["dtype"]) for t in block[2]))

    merged: list[TensorRecord | list[_Block]] = []  # a tensor, or a run of alike blocks
    for item in items:
        if isinstance(item, tuple) and merged and isinstance(merged[-1], list):
            run = merged[-1]
            if signature(run[-1]) == signature(item) and run[-1][1] + 1 == item[1]:
                run.append(item)
                continue
        merged.append([item] if isinstance(item, tuple) else item)

    def row(name: str, shape: str, dtype: str, numel: int, nbytes: int, n_shards: str) -> list[str]:
        return [name, shape, dtype, f"{numel:,}", human_bytes(nbytes), *([n_shards] if shards else [])]

    for item in merged:
        if not isinstance(item, list):
            rows.append(
                row(item["name"], _shape(item), item["dtype"], item["numel"], item["bytes"], str(item["shards"]))
            )
            continue
        first, last = item[0], item[-1]
        prefix, tensors_of_one = first[0], first[2]
        span = f"{prefix}.{first[1]}" if len(item) == 1 else f"{prefix}.{first[1]}-{last[1]}"
        dtypes = sorted({t["dtype"] for t in tensors_of_one})
        numel = sum(t["numel"] for b in item for t in b[2])
        nbytes = sum(t["bytes"] for b in item for t in b[2])
        n_tensors = len(tensors_of_one)
        count = f"{_plural(len(item), 'block')} x {n_tensors}" if len(item) > 1 else _plural(n_tensors, "tensor")
        rows.append(row(span, count, dtypes[0] if len(dtypes) == 1 else "mixed", numel, nbytes, ""))
        for t in tensors_of_one:
            rows.append(row(f"    {t['name']}", _shape(t), t["dtype"], t["numel"], t["bytes"], str(t["shards"])))
    return rows


def _optimizer_lines(tensors: list[TensorRecord]) -> list[str]:
    """One line per kind of optimizer state (``optimizer.state.<param>.<kind>``), other entries by name."""
    kinds: dict[str, list[TensorRecord]] = {}
    for t in tensors:
        name = t["name"].removeprefix("optimizer.")
        kind = name.rsplit(".", 1)[-1] if name.startswith("state.") else name
        kinds.setdefault(kind, []).append(t)
    rows = []
    for kind, ts in kinds.items():
        dtypes = ", ".join(sorted({t["dtype"] for t in ts}))
        numel, nbytes = sum(t["numel"] for t in ts), sum(t["bytes"] for t in ts)
        rows.append([kind, _plural(len(ts), "tensor"), dtypes, f"{numel:,}", human_bytes(nbytes)])
    return _table(rows, ["optimizer state", "tensors", "dtype", "numel", "size"])


def _summary_text(s: CheckpointSummary, show_all: bool = False) -> str:
    status = "complete" if s["complete"] else "INCOMPLETE (its save never finished)"
    if s["complete"] and s.get("file_problems"):
        status = f"DAMAGED: {s['file_problems'][0]}; run --verify for every problem"
    elif s["complete"] and s.get("weights_only"):
        status = "complete, weights only"
    lines = [f"{s['path']}  [{s['format']}, {status}]"]
    if s["step"] is not None:
        tokens = f", {s['tokens_seen']:,} tokens seen" if isinstance(s.get("tokens_seen"), int) else ""
        lines.append(f"step {s['step']}{tokens}" + (f" (saved: {s['reason']}, {s['time']})" if s.get("reason") else ""))
    if world_size := s["world_size"]:
        mesh_sizes = s["mesh"]
        mesh = ", ".join(f"{k}={v}" for k, v in mesh_sizes.items()) if isinstance(mesh_sizes, dict) else ""
        mesh = f" ({mesh})" if mesh else ""
        ranks = _plural(world_size, "rank") if isinstance(world_size, int) else f"{world_size} ranks"
        lines += _wrap(f"written by {ranks}{mesh}; DCP dirs: {', '.join(s['dcp_dirs'])}")
    if model_cfg := s["model"]:
        lines += _wrap("model: " + ", ".join(f"{k}={v}" for k, v in model_cfg.items() if v is not None))
    if vlm := s["vlm"]:
        lines += _wrap("vlm: " + ", ".join(f"{k}={v}" for k, v in vlm.items()))
    run_ids = s["metrics_run_ids"]
    for name, run_id in run_ids.items() if isinstance(run_ids, dict) else ():
        lines.append(f"{name} run id: {run_id}")
    versions = [f"{name} {v}" for name, v in (("kforge", s["kforge_version"]), ("torch", s["torch_version"])) if v]
    if versions:
        lines += _wrap("saved with " + ", ".join(versions) + (f", profile {s['profile']}" if s.get("profile") else ""))
    sharded = any(t["shards"] != 1 for t in s["tensors"])
    if not show_all:
        model = [t for t in s["tensors"] if _group(t["name"]) == "model"]
        if model:
            header = ["model tensors", "shape", "dtype", "numel", "size", *(["shards"] if sharded else [])]
            lines += ["", *_table(_model_rows(model, sharded), header)]
        optimizer = [t for t in s["tensors"] if _group(t["name"]) == "optimizer"]
        if optimizer:
            lines += ["", *_optimizer_lines(optimizer)]
        other = [t for t in s["tensors"] if _group(t["name"]) == "other"]
        if other:
            rows = [[t["name"], _shape(t), t["dtype"], f"{t['numel']:,}", human_bytes(t["bytes"])] for t in other]
            lines += ["", *_table(rows, ["other tensors", "shape", "dtype", "numel", "size"])]
    for group in ("model", "optimizer", "other") if show_all else ():
        rows = [
            [
                t["name"].removeprefix(f"{group}."),
                _shape(t),
                t["dtype"],
                f"{t['numel']:,}",
                human_bytes(t["bytes"]),
                *([str(t["shards"])] if sharded else []),
            ]
            for t in s["tensors"]
            if _group(t["name"]) == group
        ]
        if rows:
            header = [f"{group} tensors", "shape", "dtype", "numel", "size", *(["shards"] if sharded else [])]
            lines += ["", *_table(rows, header)]
    t = s["totals"]
    lines.append("")
    for group, g in (("model", t["model"]), ("optimizer", t["optimizer"]), ("other", t["other"])):
        if g["tensors"]:
            lines.append(
                f"{group}: {_plural(g['tensors'], 'tensor')}, {human_count(g['numel'])} elements "
                f"({g['numel']:,}), {human_bytes(g['bytes'])}"
            )
    lines += _wrap(
        f"total: {_plural(t['all']['tensors'], 'tensor')}, {human_bytes(t['all']['bytes'])} in "
        f"{_plural(t['files'], 'shard file')} ({human_bytes(t['file_bytes'])} on disk), "
        f"{_plural(s['non_tensor_items'], 'non-tensor item')}" + ("" if show_all else "; --all lists every tensor")
    )
    return "\n".join(lines)


def _stats_text(s: TensorStats) -> str:
    shape = "x".join(map(str, s["shape"])) or "scalar"
    lines = [f"{s['name']}  {shape} {s['dtype']}  ({s['numel']:,} elements, {s['shards']} shard(s))"]
    values = {"mean": s["mean"], "std": s["std"], "min": s["min"], "max": s["max"], "norm": s["norm"]}
    for key, value in values.items():
        lines.append(f"  {key:<5} {value:.6g}" if value is not None else f"  {key:<5} -")
    lines.append(f"  nan   {s['nan']}\n  inf   {s['inf']}\n  zeros {s['zeros']}")
    return "\n".join(lines)


def _diff_text(d: DiffResult) -> str:
    lines = [f"A: {d.a}", f"B: {d.b}"]
    rows = [[x.name, f"{x.changed:,}", f"{x.max_abs:.3e}", f"{x.rel_l2:.3e}"] for x in d.differing]
    if rows:
        lines += ["", *_table(rows, ["differing tensor", "changed", "max |B-A|", "|B-A|/|A|"])]
    for names, label in ((d.only_in_a, "only in A"), (d.only_in_b, "only in B"), (d.shape_mismatch, "shape differs")):
        for name in names:
            lines.append(f"{label}: {name}")
    same = d.compared - len(d.differing)
    lines.append(
        f"\n{len(d.differing)} of {d.compared} common tensors differ, {same} identical"
        + ("" if not (d.only_in_a or d.only_in_b) else f"; {len(d.only_in_a)} only in A, {len(d.only_in_b)} only in B")
    )
    return "\n".join(lines)
