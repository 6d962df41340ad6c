"""`kforge inspect-ckpt`: what is in a checkpoint, on CPU, without a process group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def register(app: typer.Typer) -> None:
    app.command("inspect-ckpt")(inspect_ckpt)


def inspect_ckpt(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory (RUN_DIR/checkpoints/step_N) or a run dir.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    tensor: Annotated[str | None, typer.Option("--tensor", help="Statistics of one tensor by name.")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Check the checkpoint is complete and readable.")] = False,
    diff: Annotated[Path | None, typer.Option("--diff", help="Compare with another checkpoint.")] = None,
) -> None:
    """Step, tokens, config summary and every tensor (shape, dtype, size, shards) of a checkpoint.

    Works on any DCP checkpoint, however many ranks wrote it. With --verify: exit 2 when
    anything is missing, truncated or unreadable; --diff: the tensors that differ and by how much.
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
        _emit(result.to_dict(), as_json, _diff_text)
    else:
        from kforge_cli.engine.checkpoint.inspection import summarize

        _emit(summarize(view), as_json, _summary_text)


def _emit(data: dict[str, Any], as_json: bool, to_text: Any) -> None:
    typer.echo(json.dumps(data, indent=1, default=str) if as_json else to_text(data))


def _verify(path: Path, as_json: bool) -> None:
    from kforge_cli.engine.checkpoint.errors import CheckpointError
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


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    """Columns padded to width: the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return [fmt(header), *(fmt(r) for r in rows)]


def _group(name: str) -> str:
    head = name.split(".", 1)[0]
    return head if head in ("model", "optimizer") else "other"


def _summary_text(s: dict[str, Any]) -> str:
    status = "complete" if s["complete"] else "INCOMPLETE (its save never finished)"
    if s["complete"] and s.get("file_problems"):
        status = f"DAMAGED: {s['file_problems'][0]}; run --verify for every problem"
    elif s["complete"] and s.get("weights_only"):
        status = "complete, weights only"
    lines = [f"{s['path']}  [{s['format']}, {status}]"]
    if s["step"] is not None:
        tokens = f", {s['tokens_seen']:,} tokens seen" if isinstance(s.get("tokens_seen"), int) else ""
        lines.append(f"step {s['step']}{tokens}" + (f" (saved: {s['reason']}, {s['time']})" if s.get("reason") else ""))
    if s.get("world_size"):
        mesh = ", ".join(f"{k}={v}" for k, v in (s.get("mesh") or {}).items())
        mesh = f" ({mesh})" if mesh else ""
        lines.append(f"written by {s['world_size']} rank(s){mesh}; DCP dirs: {', '.join(s['dcp_dirs'])}")
    if s.get("model"):
        lines.append("model: " + ", ".join(f"{k}={v}" for k, v in s["model"].items() if v is not None))
    if s.get("vlm"):
        lines.append("vlm: " + ", ".join(f"{k}={v}" for k, v in s["vlm"].items()))
    for name, run_id in (s.get("metrics_run_ids") or {}).items():
        lines.append(f"{name} run id: {run_id}")
    versions = [f"{k.removesuffix('_version')} {s[k]}" for k in ("kforge_version", "torch_version") if s.get(k)]
    if versions:
        lines.append("saved with " + ", ".join(versions) + (f", profile {s['profile']}" if s.get("profile") else ""))
    for group in ("model", "optimizer", "other"):
        rows = [
            [
                t["name"],
                "x".join(map(str, t["shape"])) or "scalar",
                t["dtype"],
                f"{t['numel']:,}",
                human_bytes(t["bytes"]),
                str(t["shards"]),
            ]
            for t in s["tensors"]
            if _group(t["name"]) == group
        ]
        if rows:
            lines += ["", *_table(rows, [f"{group} tensors", "shape", "dtype", "numel", "size", "shards"])]
    t = s["totals"]
    lines.append("")
    for group in ("model", "optimizer", "other"):
        if t[group]["tensors"]:
            g = t[group]
            lines.append(
                f"{group}: {g['tensors']} tensors, {human_count(g['numel'])} elements "
                f"({g['numel']:,}), {human_bytes(g['bytes'])}"
            )
    lines.append(
        f"total: {t['all']['tensors']} tensors, {human_bytes(t['all']['bytes'])} in {t['files']} shard "
        f"file(s) ({human_bytes(t['file_bytes'])} on disk), {s['non_tensor_items']} non-tensor items"
    )
    return "\n".join(lines)


def _stats_text(s: dict[str, Any]) -> str:
    shape = "x".join(map(str, s["shape"])) or "scalar"
    lines = [f"{s['name']}  {shape} {s['dtype']}  ({s['numel']:,} elements, {s['shards']} shard(s))"]
    for key in ("mean", "std", "min", "max", "norm"):
        value = s[key]
        lines.append(f"  {key:<5} {value:.6g}" if value is not None else f"  {key:<5} -")
    lines.append(f"  nan   {s['nan']}\n  inf   {s['inf']}\n  zeros {s['zeros']}")
    return "\n".join(lines)


def _diff_text(d: dict[str, Any]) -> str:
    lines = [f"A: {d['a']}", f"B: {d['b']}"]
    rows = [[x["name"], f"{x['changed']:,}", f"{x['max_abs']:.3e}", f"{x['rel_l2']:.3e}"] for x in d["differing"]]
    if rows:
        lines += ["", *_table(rows, ["differing tensor", "changed", "max |B-A|", "|B-A|/|A|"])]
    for key, label in (("only_in_a", "only in A"), ("only_in_b", "only in B"), ("shape_mismatch", "shape differs")):
        for name in d[key]:
            lines.append(f"{label}: {name}")
    same = d["compared"] - len(d["differing"])
    lines.append(
        f"\n{len(d['differing'])} of {d['compared']} common tensors differ, {same} identical"
        + (
            ""
            if not (d["only_in_a"] or d["only_in_b"])
            else f"; {len(d['only_in_a'])} only in A, {len(d['only_in_b'])} only in B"
        )
    )
    return "\n".join(lines)
