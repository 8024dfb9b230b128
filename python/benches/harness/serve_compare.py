"""The body of serve_compare.py: vmem-serve against ``transformers serve --continuous-batching``
on one model directory and one KV budget, over request rates from light to past saturation, and
vmem-serve against the same engine driven in-process (``generate_batch``'s path) at the same load.

A server's saturation rate is the request rate it sustains at most: its request throughput with
every request queued at once (rate ``inf``). Rates may be given as multiples of the baseline's
(``transformers serve``'s) saturation rate, ``0.5x``, ``1x``, ``2x``: measured by this command's
own ``inf`` run of the baseline, or given with ``--capacity``.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from harness import serve_drivers, serve_report, serve_run, workload
from harness.log import log
from harness.table import ratio

NAME = "serve_compare"
#: the table's columns
COLUMNS = ["label", "rate", "requests", "completed", "failed", "cut", "req_s", "out_tok_s", "goodput",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms", "duration_s"]


def parse_rates(text: str) -> list[tuple[str, float | None]]:
    """``"0.5x,1x,4,inf"`` as ``[("0.5x", 0.5), ("1x", 1.0), ("4", None), ("inf", None)]``: each
    rate's text and, for a multiple of the baseline's saturation rate, the multiple. A bad item is
    a ValueError."""
    out: list[tuple[str, float | None]] = []
    for item in (t.strip() for t in text.split(",")):
        if item.endswith("x"):
            k = float(item[:-1]) if item[:-1] else math.nan
            if not 0 < k < math.inf:
                raise ValueError(f"a multiple of the saturation rate is above 0, got {item!r}")
            out.append((item, k))
        else:
            workload.parse_rate(item)
            out.append((item, None))
    if not out:
        raise ValueError("no rate")
    return out


def resolve(rates: Sequence[tuple[str, float | None]], capacity: float | None) -> list[tuple[str, float]]:
    """Each rate's requests per second (multiples of ``capacity``)."""
    out = []
    for text, k in rates:
        if k is None:
            out.append((text, workload.parse_rate(text)))
        else:
            if capacity is None:
                raise ValueError(f"rate {text} needs the baseline's saturation rate (--capacity)")
            out.append((text, k * capacity))
    return out


def count_for(rate: float, args: Any) -> int:
    """Requests of a run at ``rate``: about ``--rate-seconds`` of arrivals, between
    ``--min-prompts`` and ``--num-prompts`` (all of them at ``inf``)."""
    if math.isinf(rate):
        return args.num_prompts
    return max(args.min_prompts, min(args.num_prompts, math.ceil(rate * args.rate_seconds)))


def sweep(kind: str, args: Any, marker: dict[str, Any], doc: dict[str, Any], save: Any) -> None:
    """Serves every rate of ``args.rates`` with one server of ``kind``, ``inf`` first (its
    saturation rate, and the baseline's when ``kind`` is ``tf`` and none was given)."""
    prompts = serve_drivers.prompts(args, marker)
    with serve_drivers.start_server(kind, args, [("", args.model_dir)], args.kv_bytes, marker["kv_token_bytes"],
                                    f"server-{kind}.log") as srv:
        cfg = serve_drivers.client(kind, args, srv.base_url, serve_drivers.served_model(srv, args.model_dir))
        serve_run.warmup(cfg, prompts, args.warmup)
        todo = list(args.rates)
        if kind == "tf" and args.capacity is None and not any(t == "inf" for t, _ in todo):
            todo.insert(0, ("inf", None))  # its saturation rate: what the Nx rates are multiples of
        todo.sort(key=lambda r: (r[0] != "inf",))
        for text, k in todo:
            capacity = doc["capacity"].get("tf") if args.capacity is None else args.capacity
            (_, rate), = resolve([(text, k)], capacity)
            reqs = workload.rate_requests(args.trace, count_for(rate, args), rate, args.seed, args.burstiness,
                                          args.max_prompt, args.max_output, args.output_len)
            log(f"{kind} @ {text} ({rate:.3f} req/s): {len(reqs)} requests")
            run = serve_run.measure(reqs, prompts, cfg, args.slo, kind, text, log)
            run.update(server=kind, rate_text=text, rate_req_s=rate, multiple=k)
            m = run["metrics"]
            run["row"]["cut"] = m["cancelled"] + m["not_sent"]
            doc["runs"].append(run)
            if text == "inf":
                doc["capacity"][kind] = m["request_throughput"]
                log(f"{kind}: saturation rate {m['request_throughput']:.3f} req/s "
                    f"({m['output_throughput']:.1f} output tok/s)")
            log(f"{kind} @ {text}: {m['completed']} done, {m['failed']} failed, {m['output_throughput']:.1f} tok/s, "
                f"TTFT p99 {m['p99_ttft_ms']:.0f} ms")
            save()
        doc.setdefault("server_exit", {})[kind] = srv.stop()


def overhead(args: Any, marker: dict[str, Any], doc: dict[str, Any], save: Any) -> None:
    """The same load (``--overhead-requests`` prompts of the trace's lengths, ``--overhead-tokens``
    each, all at once) through vmem-serve and through the engine in-process (a child process:
    :func:`inprocess`, with ``--inproc-contender``'s vmem options); server tok/s over in-process
    tok/s."""
    prompts = serve_drivers.prompts(args, marker)
    lengths = workload.trace_lengths(args.trace, args.overhead_requests, args.max_prompt, 1, args.overhead_tokens)
    reqs = [workload.Request(i, 0.0, p, o, row) for i, (p, o, row) in enumerate(lengths)]
    ids = [workload.prompt_ids(r.index, r.prompt_len, prompts.vocab, args.seed) for r in reqs]
    log(f"in-process ({args.inproc_contender}): {len(ids)} requests x {args.overhead_tokens} tokens")
    params = {"model_dir": args.model_dir, "contender": args.inproc_contender, "kv_bytes": args.kv_bytes,
              "token_bytes": marker["kv_token_bytes"], "prompts": ids, "new_tokens": args.overhead_tokens,
              "device": args.device, "max_requests": args.inproc_max_requests, "max_context": args.inproc_max_context,
              "page_size": args.inproc_page_size, "tiny": args.tiny}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        inproc = pool.apply(inprocess, (params,))
    log(f"in-process: {inproc['tok_s']:.1f} tok/s over {inproc['wall_s']:.1f} s")
    with serve_drivers.start_server("vmem", args, [("", args.model_dir)], args.kv_bytes, marker["kv_token_bytes"],
                                    "server-vmem-overhead.log") as srv:
        cfg = serve_drivers.client("vmem", args, srv.base_url, serve_drivers.served_model(srv, args.model_dir))
        serve_run.warmup(cfg, prompts, args.warmup)
        run = serve_run.measure(reqs, prompts, cfg, args.slo, "vmem", "inf", log)
    m = run["metrics"]
    ratio = m["output_throughput"] / inproc["tok_s"] if inproc["tok_s"] else math.nan
    run.pop("per_request")
    doc["overhead"] = {"inprocess": inproc, "server": run, "server_over_inprocess": ratio,
                       "target": ">= 0.9", "met": ratio >= 0.9}
    log(f"server {m['output_throughput']:.1f} tok/s / in-process {inproc['tok_s']:.1f} tok/s = {ratio:.3f}")
    save()


def inprocess(p: dict[str, Any]) -> dict[str, Any]:
    """In a child process: the model directory loaded, served by the engine with vmem (contender
    ``p["contender"]`` of :mod:`harness.contenders` on ``p["kv_bytes"]``), every prompt at once,
    ``p["new_tokens"]`` each (:func:`harness.serving.run_contender`, what ``generate_batch`` does,
    graphs captured before the clock). Returns tok/s, wall and TTFT/TBT percentiles."""
    os.environ.update(serve_drivers.SERVER_ENV)  # before transformers is imported
    import torch
    from transformers import AutoModelForCausalLM

    import vmem.transformers as vt
    from harness import contenders as ct
    from harness import serving

    vt.install()
    dtype = torch.float32 if p["tiny"] else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(p["model_dir"], dtype=dtype, device_map=p["device"]).eval()
    if p["tiny"]:
        from harness.engine import fake_cpu_memory

        fake_cpu_memory()
    args = SimpleNamespace(new_tokens=p["new_tokens"], memory_percent=0.9, timeout=600.0,
                           max_requests=p["max_requests"], max_context=p["max_context"],
                           page_size=p["page_size"] or ("64K" if p["tiny"] else "2M"), graph_warmup=True)
    budget = {"kv_bytes": p["kv_bytes"], "token_bytes": p["token_bytes"], "max_batch_tokens": None}
    spec = ct.spec(p["contender"])
    out = serving.run_contender(model, p["contender"], p["prompts"], args, budget, {p["contender"]: spec})
    return {k: v for k, v in out.items() if isinstance(v, (int, float, str, type(None)))}


def num(v: Any, fmt: str = ".1f") -> str:
    """``v`` formatted, ``n/a`` when it is no number."""
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return "n/a"


def comparison(doc: dict[str, Any]) -> list[str]:
    """The lines that state the targets: saturation rates and their ratio; at each multiple of the
    baseline's saturation rate (``1x`` and beyond), TTFT p99 and throughput of each; the overhead."""
    cap = doc["capacity"]
    lines = []
    runs = {(r["server"], r["rate_text"]): r["metrics"] for r in doc["runs"]}
    inf = {s: runs.get((s, "inf")) for s in ("vmem", "tf")}
    if inf["tf"] and inf["vmem"]:
        v, t = inf["vmem"]["output_throughput"], inf["tf"]["output_throughput"]
        lines.append(f"saturation rate (rate inf): vmem {num(cap.get('vmem'), '.3f')} req/s, tf "
                     f"{num(cap.get('tf'), '.3f')} req/s; output tok/s vmem {num(v)} / tf {num(t)} = {ratio(v, t)} "
                     "(target >= 3x)")
    for text in sorted({t for s, t in runs if t.endswith("x")}, key=lambda t: float(t[:-1])):
        v, t = runs.get(("vmem", text)), runs.get(("tf", text))
        if v and t:
            tok = ratio(v["output_throughput"], t["output_throughput"])
            lines.append(f"at {text} tf's saturation rate: TTFT p99 tf {num(t['p99_ttft_ms'], '.0f')} ms / vmem "
                         f"{num(v['p99_ttft_ms'], '.0f')} ms = {ratio(t['p99_ttft_ms'], v['p99_ttft_ms'])} (target "
                         f">= 3x at 1x); output tok/s vmem/tf = {tok}")
    o = doc.get("overhead")
    if o:
        server, inproc = o["server"]["metrics"]["output_throughput"], o["inprocess"]["tok_s"]
        lines.append(f"server overhead: vmem-serve {num(server)} tok/s / in-process {num(inproc)} tok/s = "
                     f"{num(o['server_over_inprocess'], '.3f')} (target >= 0.9)")
    return lines


def write(out_dir: str, doc: dict[str, Any]) -> str:
    """serve_compare.json/.txt/.svg of ``doc``; returns the text."""
    rows = [r["row"] for r in doc["runs"]]
    notes = [n for r in doc["runs"] for n in r["notes"]] + comparison(doc)
    head = (f"{doc['meta']['model']} on {doc['meta']['device']}, KV {doc['meta']['kv_bytes'] / 2**30:.2f} GiB each "
            f"(transformers serve: {doc['meta']['tf_blocks']} blocks of {doc['meta']['block_size']}); "
            + ", ".join(f"{k} {v}" for k, v in doc["meta"]["versions"].items()))
    text = serve_report.text(rows, notes, title=head, cols=COLUMNS)
    serve_report.save(out_dir, NAME, doc, text)
    series: dict[str, list[tuple[float, float, str]]] = {}
    for r in sorted(doc["runs"], key=lambda r: float(r["rate_req_s"])):
        m = r["metrics"]
        series.setdefault(r["server"], []).append((m["output_throughput"], m["p99_ttft_ms"], r["rate_text"]))
    serve_report.write_svg(os.path.join(out_dir, f"{NAME}.svg"), serve_report.line_svg(
        series, "output tokens/s", "TTFT p99 (ms)", f"vmem-serve vs transformers serve, {doc['meta']['model']}",
        log_y=True))
    return text


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of several commands' parts: the first's meta, every run (a (server, rate) in
    two parts is a ValueError), the capacities and the overhead found."""
    if not docs:
        raise ValueError("nothing to merge")
    out = dict(docs[0], runs=[], capacity={}, overhead=None)
    for d in docs:
        if d["meta"]["model"] != out["meta"]["model"] or d["meta"]["kv_bytes"] != out["meta"]["kv_bytes"]:
            raise ValueError("the parts differ in their model or KV budget")
        for r in d["runs"]:
            if any((q["server"], q["rate_text"]) == (r["server"], r["rate_text"]) for q in out["runs"]):
                raise ValueError(f"{r['server']} @ {r['rate_text']} is in two parts")
            out["runs"].append(r)
        out["capacity"].update(d.get("capacity") or {})
        out["overhead"] = d.get("overhead") or out["overhead"]
    return out
