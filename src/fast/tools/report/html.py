"""The self-contained report.html: deployment, table and figures in one file; no scripts, no links out."""

from __future__ import annotations

import json
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

from fast.errors import ConfigError
from fast.targets import Target, parse_target
from fast.tools.report.plots import ReportFigure, Variant, report_figures, variants
from fast.tools.report.runs import Run, distinct_labels, load_run
from fast.tools.report.series import as_target, ordered, recorded_targets
from fast.tools.report.table import MISSING, Column, summary_rows, table_columns, write_summary_csv
from fast.units import parse_duration

SUMMARY_CSV = "summary.csv"
DEPLOYMENT_SECTIONS = ("network", "compute", "faults")
_UNIT_SUFFIXES = {
    "_mbps": " (Mbit/s)",
    "_gbps": " (Gbit/s)",
    "_ms": " (ms)",
    "_s": " (s)",
    "_bytes": " (bytes)",
}

STYLE = """
body{margin:0;background:#fff;color:#1f2328;line-height:1.5;
  font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1080px;margin:0 auto;padding:2.5rem 1.5rem 4rem}
h1{font-size:1.9rem;margin:0 0 .2rem;letter-spacing:-.01em}
h2{font-size:1.3rem;margin:2.6rem 0 .8rem;padding-bottom:.3rem;border-bottom:1px solid #e3e5e8}
h3{font-size:1.02rem;margin:2rem 0 .4rem}
.meta,.note,figcaption{color:#656d76;font-size:.86rem}
.meta{margin:0}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:.84rem;width:100%}
th,td{padding:.38rem .6rem;text-align:left;vertical-align:top}
thead th{border-bottom:2px solid #c9ced4;font-weight:600;vertical-align:bottom}
tbody tr:nth-child(even){background:#f5f7f9}
td{white-space:nowrap}
.num{text-align:right;font-variant-numeric:tabular-nums}
td.wrap{white-space:normal}
.swatch{display:inline-block;width:.8em;height:.8em;border-radius:2px;margin-right:.45em;vertical-align:-.05em}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.3rem 1.4rem;margin:0;font-size:.92rem}
dt{font-weight:600;color:#424a53}
dd{margin:0}
dd ul{margin:0;padding-left:1.1rem}
figure{margin:0}
img{display:block;width:100%;height:auto}
.nodata{color:#656d76;font-style:italic;border:1px dashed #c9ced4;border-radius:4px;
  padding:.9rem 1rem;margin:0}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.85em}
"""


def build_report(
    run_dirs: list[Path],
    out_html: Path,
    *,
    title: str = "FAST comparison",
    deployment: dict | None = None,
    targets: list[float | Target] | None = None,
) -> Path:
    """Write `out_html` (and summary.csv beside it) comparing the runs in `run_dirs`; return the HTML path.

    The deployment shown is `deployment` or else the first run's network/compute/faults config; targets
    default to those the runs' summaries report, else the first run's configured targets.
    """
    if not run_dirs:
        raise ConfigError("no run folders given: pass at least one folder written by `fast train`")
    runs = [load_run(Path(d)) for d in run_dirs]
    targets = ordered([as_target(t) for t in targets]) if targets is not None else _default_targets(runs)
    rows = summary_rows(runs, targets)
    all_variants = variants(runs, distinct_labels(runs))
    out_html = Path(out_html)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    write_summary_csv(rows, out_html.parent / SUMMARY_CSV)
    page = _page(
        title,
        _header(title, runs),
        _deployment_section(runs, deployment),
        _summary_section(rows, all_variants),
        _figures_section(report_figures(all_variants, targets)),
        _events_section(all_variants),
        _runs_section(all_variants),
    )
    out_html.write_text(page, encoding="utf-8")
    return out_html


def _default_targets(runs: list[Run]) -> list[Target]:
    recorded = recorded_targets(runs)
    if recorded:
        return recorded
    return configured_targets(runs[:1])


def configured_targets(runs: list[Run]) -> list[Target]:
    """The targets the runs' configs ask for (unreadable ones skipped)."""
    found = []
    for run in runs:
        for spec in (run.config.get("run") or {}).get("targets") or []:
            try:
                found.append(parse_target(spec))
            except ConfigError:
                continue
    return ordered(found)


def _page(title: str, *sections: str) -> str:
    body = "\n".join(section for section in sections if section)
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n{body}\n</main>\n"
        "</body>\n</html>\n"
    )


def _header(title: str, runs: list[Run]) -> str:
    generated = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (
        f"<header><h1>{escape(title)}</h1>"
        f'<p class="meta">{len(runs)} variant{"s" if len(runs) != 1 else ""} · '
        f"generated {escape(generated)}</p>"
        "</header>"
    )


def _deployment_section(runs: list[Run], deployment: dict | None) -> str:
    note = ""
    if deployment is None:
        deployment = _deployment_of(runs[0])
        if any(_deployment_of(run) != deployment for run in runs[1:]):
            note = (
                '<p class="note">The runs were not all made on the same deployment; this is the first '
                "run's. See each run's config for its own.</p>"
            )
    items = [f"<dt>{escape(_humanize(key))}</dt><dd>{_describe(value)}</dd>" for key, value in deployment.items()]
    simulated = [run for run in runs if run.summary.get("simulation")]
    if simulated:
        host = ", ".join(f"{escape(run.name)} {run.summary['simulation']['host_s']:.0f} s" for run in simulated)
        items.append(
            "<dt>engine</dt><dd>simulated: every worker in one process, all times virtual (the links' and "
            f"<code>run.step_time</code>'s); host time {host}</dd>"
        )
    elif not any(key in deployment for key in DEPLOYMENT_SECTIONS):
        items.append("<dt>links</dt><dd>no link, compute or fault model configured (real local links)</dd>")
    return f'<section id="deployment"><h2>Deployment</h2><dl>{"".join(items)}</dl>{note}</section>'


def _deployment_of(run: Run) -> dict[str, Any]:
    config = run.config
    workers = run.summary.get("workers") or config.get("run", {}).get("workers")
    found: dict[str, Any] = {"workers": workers} if workers else {}
    sections = {key: _present(config[key]) if isinstance(config.get(key), dict) else config.get(key)
                for key in DEPLOYMENT_SECTIONS}  # fmt: skip
    return found | {key: value for key, value in sections.items() if value not in (None, {}, [])}


# entries that say something only while another entry is on
_ONLY_WITH = {"heavy_tail_max": "heavy_tail", "straggler_pause": "straggler_probability"}


def _present(table: dict) -> dict:
    """What a deployment table has: without entries that are off (no loss, no jitter, no heavy tail: zeros and
    zero durations), nor those that qualify an entry that is off (the pause of stragglers that never happen)."""

    def off(value: Any) -> bool:
        if isinstance(value, int | float):  # (False too)
            return value == 0
        if isinstance(value, str):
            try:
                return parse_duration(value) == 0
            except ConfigError:  # not a duration ("1Gbit")
                return False
        return False

    kept = {key: value for key, value in _given(table).items() if not off(value)}
    return {key: value for key, value in kept.items() if _ONLY_WITH.get(key, key) in kept}


def _humanize(key: str) -> str:
    for suffix, unit in _UNIT_SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)].replace("_", " ") + unit
    return key.replace("_", " ")


def _given(table: dict) -> dict:
    """A config table without its unset entries (None, empty tables and lists): only what a deployment has."""
    return {key: value for key, value in table.items() if value is not None and value != {} and value != []}


def _describe(value: Any) -> str:
    """A config value as compact HTML: scalars as text, tables as `key: value` lists, lists item by item."""
    if isinstance(value, dict):
        value = _given(value)
        if not value:
            return MISSING
        lines = [f"{escape(_humanize(str(k)))}: {_inline(v)}" for k, v in value.items()]
        return "<ul>" + "".join(f"<li>{line}</li>" for line in lines) + "</ul>"
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        return "<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in value) + "</ul>"
    return _inline(value)


def _inline(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, dict):
        return ", ".join(f"{escape(_humanize(str(k)))}: {_inline(v)}" for k, v in _given(value).items()) or MISSING
    if isinstance(value, list):
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return escape(f"{value:g}")
    return escape(str(value))


def _summary_section(rows: list[dict[str, Any]], all_variants: list[Variant]) -> str:
    colours = {v.label: v.colour for v in all_variants}
    columns = table_columns(rows)
    groups = dict.fromkeys(column.group for column in columns)
    tables = []
    for group in groups:
        # Every table starts with the variant so that each reads on its own.
        shown = [c for c in columns if c.group == group or (c.key == "variant" and group != columns[0].group)]
        tables.append(f"<h3>{escape(group)}</h3>{_table(rows, shown, colours)}")
    return (
        f'<section id="summary"><h2>Summary</h2>{"".join(tables)}'
        '<p class="note">Accuracies are on the test set; times are wall-clock seconds from the common start; '
        "“not reached” means the run never got there. "
        "MB = 10<sup>6</sup> bytes actually sent over the wire by all workers (and servers), headers included. "
        "Replica divergence is the mean over workers of ‖w<sub>i</sub> − w̄‖ / ‖w̄‖ at the end. "
        "The predicted step time comes from the link and compute model. "
        "The shares split each worker's training time, the same way for every strategy: compute (forward, backward, "
        "the optimizer); communicate (the strategy's own work on messages, and time blocked on a transfer once every "
        "peer it needs is there); wait (blocked until the last peer has issued the collective, or the sender its "
        "message: a straggler, a barrier, an evaluation); the rest (data, records) is not shown. "
        "“—” means not recorded. "
        f"Both tables, unformatted, are in <code>{SUMMARY_CSV}</code> beside this file.</p></section>"
    )


def _table(rows: list[dict[str, Any]], columns: list[Column], colours: dict[str, str]) -> str:
    head = "".join(f'<th class="{"num" if c.numeric else ""}">{escape(c.header)}</th>' for c in columns)
    body = []
    for row in rows:
        cells = []
        for column in columns:
            text = escape(column.cell(row))
            if column.key == "variant":
                text = f'<span class="swatch" style="background:{colours[row["variant"]]}"></span>{text}'
            cells.append(f'<td class="{"num" if column.numeric else ""}">{text}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _figures_section(figures: list[ReportFigure]) -> str:
    parts = []
    for figure in figures:
        heading = f"<h3>{escape(figure.title)}</h3>"
        if figure.png_base64 is None:
            parts.append(f'<figure>{heading}<p class="nodata">{escape(figure.note)}</p></figure>')
            continue
        caption = f"<figcaption>{escape(figure.note)}</figcaption>" if figure.note else ""
        image = f'<img alt="{escape(figure.title)}" src="data:image/png;base64,{figure.png_base64}">'
        parts.append(f"<figure>{heading}{image}{caption}</figure>")
    return f'<section id="figures"><h2>Curves</h2>{"".join(parts)}</section>'


def _events_section(all_variants: list[Variant]) -> str:
    items = []
    for v in all_variants:
        failures = v.run.summary.get("failures") or []
        skipped = v.run.summary.get("skipped_steps")
        events = [_inline(failure) for failure in failures]
        if isinstance(skipped, int) and skipped > 0:
            events.append(f"{skipped} skipped step{'s' if skipped != 1 else ''}")
        events += _membership_events(v.run.summary.get("membership") or [])
        if events:
            items.append(f"<dt>{escape(v.label)}</dt><dd><ul>{''.join(f'<li>{e}</li>' for e in events)}</ul></dd>")
    if not items:
        return ""
    heading = "Failures, skipped steps and membership changes"
    return f'<section id="events"><h2>{heading}</h2><dl>{"".join(items)}</dl></section>'


MEMBERSHIP_EVENTS_SHOWN = 20


def _membership_events(changes: list[dict[str, Any]]) -> list[str]:
    """A live run's membership, change by change: who left and joined at which step, and the catch-up."""
    lines, shown = [], MEMBERSHIP_EVENTS_SHOWN
    if len(changes) - 1 > shown:
        lines.append(escape(f"{len(changes) - 1} membership changes; the first {shown} (all in summary.json's "
                            "`membership`):"))  # fmt: skip
    for change in changes[1 : shown + 1]:
        left = ", ".join(f"{e.get('member')} ({e.get('how')})" for e in change.get("left", []))
        what = [f"left: {left}" if left else "", f"joined: {', '.join(map(str, change.get('joined', [])))}"
                if change.get("joined") else ""]  # fmt: skip
        healed = change.get("healed") or []
        if healed:
            what.append(
                f"{len(healed)} healed from {_workers(change.get('healed_from'))}: "
                f"{change.get('catch_up_bytes', 0) / 1e6:.2f} MB in {change.get('catch_up_s', 0):.2f} s"
            )
        # (an asynchronous run's workers are at different steps: the change's time instead)
        when = f"step {change['step']}" if change.get("step") is not None else f"{change.get('time_s', 0):.1f} s"
        lines.append(escape(f"{when}: {len(change.get('members', []))} workers; "
                            + "; ".join(w for w in what if w)))  # fmt: skip
    return lines


def _workers(ids: Any) -> str:
    """The sources of a change's catch-ups, as "worker 0" or "workers 0, 3"."""
    ids = sorted(set(ids), key=str) if isinstance(ids, list) else [ids]
    if ids == ["servers"]:  # (an asynchronous run's joiners pull from the servers)
        return "the servers"
    return f"worker{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def _runs_section(all_variants: list[Variant]) -> str:
    rows = []
    for v in all_variants:
        config = v.run.config
        strategy = (config.get("strategy") or {}) | {"name": v.run.strategy}
        rows.append(
            f'<tr><td><span class="swatch" style="background:{v.colour}"></span>{escape(v.label)}</td>'
            f"<td><code>{escape(str(v.run.directory))}</code></td>"
            f'<td class="wrap">{_named(strategy)}</td>'
            f'<td class="wrap">{_named(config.get("codec") or {})}</td>'
            f'<td class="wrap">{_named(config.get("optimizer") or {}, ("lr", "momentum"))}</td>'
            f'<td class="num">{_inline(v.run.summary.get("epochs"))}</td>'
            f'<td class="num">{_seconds(v.run.summary.get("wall_time_s"))}</td></tr>'
        )
    head = (
        "<tr><th>variant</th><th>folder</th><th>strategy</th><th>codec</th><th>optimizer</th>"
        '<th class="num">epochs</th><th class="num">wall time (s)</th></tr>'
    )
    table = f'<div class="scroll"><table><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table></div>'
    return f'<section id="runs"><h2>Runs</h2>{table}{_environment(all_variants)}</section>'


def _named(table: dict, keys: tuple[str, ...] | None = None) -> str:
    """A config table as its name and, in brackets, its other entries (or only `keys`) that are set."""
    options = {k: val for k, val in table.items() if k != "name" and (keys is None or k in keys) and val is not None}
    return escape(str(table.get("name", MISSING))) + (f" ({_inline(options)})" if options else "")


def _seconds(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else MISSING


def _environment(all_variants: list[Variant]) -> str:
    env = all_variants[0].run.summary.get("env")
    if not isinstance(env, dict) or not env:
        return ""
    same = all(
        json.dumps(v.run.summary.get("env"), sort_keys=True) == json.dumps(env, sort_keys=True) for v in all_variants
    )
    scope = "all runs" if same else f"{escape(all_variants[0].label)} (the runs' environments differ)"
    items = "".join(f"<dt>{escape(_humanize(str(k)))}</dt><dd>{_inline(val)}</dd>" for k, val in env.items())
    return f"<h3>Environment of {scope}</h3><dl>{items}</dl>"
