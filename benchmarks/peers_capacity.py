"""The capacity search of ``benchmarks/peers.py --capacity``: under GPU caps, the largest model of
anchor-1.6b's width (``n_blocks`` blocks) each system trains, and how fast.

Each probe is one of ``peers.py``'s rows (a process of its own under
``torch.cuda.set_per_process_memory_fraction``) that trains ``CAPACITY_STEPS`` steps. The first size
tried is read off the line through the peaks of the sizes that trained (the 8-block row's, a
smaller cap's), the next off the line refitted, then bisection over ``n_blocks``; a smaller cap's
answer that is also this cap's is timed under this cap. Sizes whose estimated host memory
(``HOST_BYTES_PER_PARAM``) does not fit ``MemAvailable`` are not tried.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

GiB = 1 << 30
# Host bytes per parameter each system keeps, estimated from what it stores there (fp32 master 4,
# two AdamW moments 8, fp32 gradients 4, bf16 copies 2 each; this library's defaults cast on the GPU
# and keep no bf16 copy, and its plans keep some blocks resident: 14.2 measured at 32 blocks), or,
# for DeepSpeed, which also builds the fp32 model on the host and keeps pinned buffers, what its
# probes measured (ZeRO-2 20.5-25.3, ZeRO-3 22.7-26.7); the capacity search skips sizes whose
# estimate does not fit, so no probe runs the host out of memory. The measured figure of each
# probe is in its row (host_bytes_per_param).
HOST_BYTES_PER_PARAM = {
    "resident": 0.0,
    "stock_cpu_offload": 16.0,
    "deepspeed_zero2": 23.0,
    "deepspeed_zero3": 27.0,
    "torchao_cpu_offload": 16.0,
    "torch_fsdp_offload": 16.0,
    "torch_fsdp_offload_planned": 16.0,
}
# GPU bytes per parameter each system needs at least, whatever the batch: resident keeps params,
# grads and AdamW state (16), torchao the fp32 params (4), ZeRO-2 the bf16 params and gradients (4).
GPU_BYTES_PER_PARAM = {"resident": 16.0, "torchao_cpu_offload": 4.0, "deepspeed_zero2": 4.0}
HOST_MARGIN, HOST_OVERHEAD_BYTES = 1.1, 4 * GiB
CAPACITY_STEPS = 3


def model_config(n_blocks: int, seq_len: int = 2048):
    """anchor-1.6b's config with ``n_blocks`` blocks (its width, heads and MLP)."""
    from torch_fsdp_offload.models import MODEL_CONFIGS

    base = MODEL_CONFIGS["anchor-1.6b"]
    return dataclasses.replace(base, n_layers=n_blocks, max_seq_len=max(base.max_seq_len, seq_len))


def param_count(n_blocks: int) -> int:
    """Parameters of the ``n_blocks`` model (built on ``meta``: nothing is allocated)."""
    from torch_fsdp_offload.models import build_model

    return build_model(model_config(n_blocks), device="meta").param_count()


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty where unreadable."""
    values = {}
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return values


def host_fits(system: str, params: int, available_bytes: int) -> bool:
    """Whether ``params`` parameters of ``system`` fit the host's available memory (estimated)."""
    return params * HOST_BYTES_PER_PARAM[system] * HOST_MARGIN + HOST_OVERHEAD_BYTES <= available_bytes


def size_bound(system: str, available_bytes: int, gpu_cap_bytes: int, max_blocks: int = 256) -> int:
    """The largest ``n_blocks`` the estimates allow (host memory, and the GPU bytes per parameter a
    system needs whatever the batch); the search tries nothing above it."""
    per_block = param_count(2) - param_count(1)
    root = param_count(1) - per_block
    bound = 0
    for n in range(1, max_blocks + 1):
        params = root + n * per_block
        if not host_fits(system, params, available_bytes) or params * GPU_BYTES_PER_PARAM.get(system, 0.0) > gpu_cap_bytes:
            break
        bound = n
    return bound


def does_not_fit(error: str) -> bool:
    """Whether a probe's error says the size does not fit (GPU or host memory, killed, too slow),
    rather than that the system failed otherwise."""
    return error.startswith(("OOM", "timeout")) or "killed" in error or "out of memory" in error.lower()


def probe_seconds(probes: list[dict], system: str, n_blocks: int) -> float:
    """The seconds a probe of ``n_blocks`` blocks of ``system`` is expected to take, scaled by blocks
    from the quickest per block of its earlier probes (their child's wall time, else their setup
    plus 15 s of start-up and steps); 0 without one. Setup, which dominates, grows with the blocks."""
    rates = [(p["elapsed_s"] if "elapsed_s" in p else p["setup_s"] + 15.0) / p["n_blocks"] for p in probes
             if p.get("system") == system and p.get("n_blocks") and ("elapsed_s" in p or "setup_s" in p)]
    return min(rates) * n_blocks if rates else 0.0


def largest_fitting(probe, upper: int, known: int = 0, start: int | None = None,
                    tolerance: float = 0.0, grow=None) -> tuple[int, bool]:
    """The largest ``n`` in ``1..upper`` for which ``probe(n)`` is True, by growing then bisection.

    ``probe(n)`` returns True (trains), False (does not) or None (out of time: the search stops).
    ``known`` is a size known to fit (a smaller cap's answer), ``start`` the first size to try
    (default ``2 * known``, or 1). After a size fits, ``grow(n)`` is the next to try (default
    doubling; at least ``n + 1``). The bisection stops once the smallest size found not to fit is
    within ``tolerance`` of the answer (0: exact). Returns the largest size found to fit (``known``
    or 0 if none) and whether the search completed."""
    best, fail = known, upper + 1
    if best >= upper:
        return best, True
    n = min(max(start if start is not None else 2 * best, best + 1, 1), upper)
    while True:
        fits = probe(n)
        if fits is None:
            return best, False
        if not fits:
            fail = n
            break
        best = n
        if n >= upper:
            return best, True
        n = min(max(grow(n) if grow is not None else 2 * n, n + 1), upper)
    while fail - best > max(1, int(tolerance * best)):
        mid = (best + fail) // 2
        fits = probe(mid)
        if fits is None:
            return best, False
        best, fail = (mid, fail) if fits else (best, mid)
    return best, True


def largest_by_peak(points: list[tuple[int, float]], cap_GiB: float, margin: float = 0.97) -> int | None:
    """The largest ``n_blocks`` whose peak, on the line through the measured ``(n_blocks, peak GiB)``
    points (least squares; through the origin for one size), stays within ``margin`` of the cap;
    None without a rising line."""
    sizes = sorted({n for n, _ in points})
    if not sizes:
        return None
    if len(sizes) == 1:
        slope = statistics.fmean(peak for _, peak in points) / sizes[0]
        intercept = 0.0
    else:
        slope, intercept = statistics.linear_regression([float(n) for n, _ in points], [peak for _, peak in points])
    if slope <= 0:
        return None
    return max(0, math.floor((margin * cap_GiB - intercept) / slope))


def capacity(runner, systems: list[str], caps: list[float], batch_size: int, available: int,
             measured: dict[str, dict], log=print, tolerance: float = 0.0, previous: dict | None = None,
             checkpoint=lambda partial: None) -> dict:
    """The capacity search of every system under every cap (module docstring), each cap in turn and
    the systems in the order given (what ``--max-seconds`` leaves out comes last), each probe a row
    of ``runner`` (``peers.Runner``: a system whose package is missing is an error row, which stops
    its search, as any failure but running out of memory or time does); ``measured``
    holds the 8-block rows at ``batch_size`` measured in this run, which seed each search's first
    size; ``tolerance`` as :func:`largest_fitting`'s. Resident FSDP2 is then run uncapped at this
    library's largest sizes first, then at the others' while time is left; where it was not run,
    ``resident_uncapped_tokens_per_s_estimated`` scales the 8-block resident row by parameters.
    ``previous`` (an earlier run's capacity result) keeps its complete searches, its probes and the
    entries of systems and caps not searched now, and seeds the others with the sizes it found; a size
    it probed is not probed again. ``checkpoint(partial)`` receives the result so far, in this
    function's form, after every probe, so a run cut short can be resumed from it."""
    previous = previous or {"results": [], "probes": [], "resident_uncapped": {}}
    # Complete, and timed under its cap (or nothing fitted): a smaller cap's answer is still timed.
    done = {(e["system"], e["gpu_cap_GiB"]): e for e in previous["results"]
            if e.get("search_complete") and ("tokens_per_s" in e or not e.get("largest_n_blocks"))}
    results, probes = [], list(previous["probes"])
    resident = {int(n): r for n, r in previous["resident_uncapped"].items() if "tokens_per_s" in r}

    def with_previous() -> list[dict]:
        # This run's entries, then the earlier run's of the systems and caps not searched (yet).
        found = {(e["system"], e["gpu_cap_GiB"]) for e in results}
        return results + [e for e in previous["results"] if (e["system"], e["gpu_cap_GiB"]) not in found]

    def save() -> None:
        # What is known so far, as a result to resume from, after every probe.
        checkpoint({"results": with_previous(), "probes": probes,
                    "resident_uncapped": {str(n): r for n, r in resident.items()}})

    known = {system: 0 for system in systems}
    for cap in caps:
        for system in systems:
            earlier = next((e for e in previous["results"] if (e["system"], e["gpu_cap_GiB"]) == (system, cap)), {})
            known[system] = max(known[system], earlier.get("largest_n_blocks", 0))
            if (system, cap) in done:
                results.append(done[(system, cap)])
                continue
            upper = size_bound(system, available, int(cap * GiB))
            reference = measured.get(system, {})
            # The peak grows with the blocks: every size of this system that trained (any cap, and
            # the 8-block row) puts a line through it, and each next size is read off that line.
            peaks = [(8, reference["peak_gpu_GiB"])] if reference.get("peak_gpu_GiB") else []
            peaks += [(p["n_blocks"], p["peak_gpu_GiB"]) for p in probes
                      if p.get("system") == system and "error" not in p and p.get("peak_gpu_GiB")]
            estimate = largest_by_peak(peaks, cap)
            start = None if estimate is None else max(known[system] + 1, estimate)
            if earlier.get("largest_n_blocks") and earlier.get("smallest_not_fitting_n_blocks"):
                # Resumed between what fitted and what did not (the earlier run's probes stand).
                upper = min(upper, earlier["smallest_not_fitting_n_blocks"] - 1)
                start = (earlier["largest_n_blocks"] + earlier["smallest_not_fitting_n_blocks"]) // 2
            rows: dict[int, dict] = {}

            def recorded(n: int) -> list[dict]:
                # The probes of this size an earlier run answered: it trained, or did not fit.
                return [p for p in probes if (p.get("system"), p.get("gpu_cap_GiB"), p.get("n_blocks")) == (system, cap, n)
                        and ("error" not in p or does_not_fit(p["error"]))]

            def probe(n: int) -> bool | None:
                # A size already answered is not run again: a search resumed from a checkpoint
                # replays its decisions without the GPU.
                if recorded(n):
                    rows[n] = recorded(n)[-1]
                    return "error" not in rows[n]
                # Out of time, or too little left to finish this size: a probe cut short says nothing.
                if runner.remaining() < max(20.0, probe_seconds(probes, system, n)):
                    return None
                row = runner.row(system, batch_size, n, cap, steps=CAPACITY_STEPS - 1, warmup=1)
                if str(row.get("error", "")).startswith("not run"):
                    return None
                rows[n] = row
                probes.append(row)
                if "error" not in row and row.get("peak_gpu_GiB"):
                    peaks.append((n, row["peak_gpu_GiB"]))
                log(f"capacity {system} cap {cap} GiB n_blocks {n}: " + (row["error"][:80] if "error" in row else f"{row['tokens_per_s']} tok/s"))
                save()
                if "error" in row and not does_not_fit(row["error"]):
                    failed.append(row["error"])  # not a size the system cannot hold: stop its search
                    return None
                return "error" not in row

            def grow(n: int) -> int:
                found = largest_by_peak(peaks, cap)
                return 2 * n if found is None else min(found, 2 * n)

            failed: list[str] = []
            best, complete = largest_fitting(probe, upper, known[system], start, tolerance, grow)
            if best and best not in rows and (recorded(best) or (complete and not failed)):
                # The answer timed under this cap: by an earlier run, else now (a smaller cap's answer),
                # once the search is complete: a size a resumed search may still outgrow is not timed.
                probe(best)
            known[system] = best
            entry = {"system": system, "gpu_cap_GiB": cap, "batch_size": batch_size, "largest_n_blocks": best,
                     "size_bound_n_blocks": upper, "search_complete": complete}
            too_large = [n for n, row in rows.items() if "error" in row]
            if too_large:
                entry["smallest_not_fitting_n_blocks"] = min(too_large)
            if failed:
                entry["error"] = failed[0]
            if best and best in rows:
                at = rows[best]
                entry.update(params=at["params"], tokens_per_s=at["tokens_per_s"], step_s=at["step_s"],
                             peak_gpu_GiB=at["peak_gpu_GiB"], host_bytes_per_param=at["host_bytes_per_param"],
                             pinned_GiB=at["pinned_GiB"])
            elif best:
                entry["note"] = "fits as the answer of a smaller cap; not timed under this cap"
            results.append(entry)
    results = with_previous()
    ours = [e.get("largest_n_blocks", 0) for e in results if e["system"] == "torch_fsdp_offload"]
    others = [e.get("largest_n_blocks", 0) for e in results if e["system"] != "torch_fsdp_offload"]
    for n in dict.fromkeys(n for n in ours + others if n):
        if n in resident:
            continue
        if param_count(n) * GPU_BYTES_PER_PARAM["resident"] > runner.args.gpu_memory_GiB * GiB:
            resident[n] = {"error": "not measurable: its parameters, gradients and AdamW state exceed the GPU"}
            continue
        if runner.remaining() < max(90.0, probe_seconds(probes, "resident", n)):
            continue
        row = runner.row("resident", batch_size, n, None, steps=CAPACITY_STEPS - 1, warmup=1)
        resident[n] = ({"tokens_per_s": row["tokens_per_s"], "peak_gpu_GiB": row["peak_gpu_GiB"]} if "error" not in row
                       else {"error": ("not measurable: " + row["error"]) if row["error"].startswith("OOM") else row["error"]})
        save()
    reference = measured.get("resident", {})
    for entry in results:
        n = entry.get("largest_n_blocks")
        if not n:
            continue
        if n in resident:
            found = resident[n]
            entry["resident_uncapped_tokens_per_s"] = found.get("tokens_per_s", found.get("error"))
            entry.pop("resident_uncapped_tokens_per_s_estimated", None)  # an earlier run's, now measured
        elif reference.get("tokens_per_s"):
            entry["resident_uncapped_tokens_per_s_estimated"] = round(
                reference["tokens_per_s"] * param_count(8) / param_count(n))
    return {"results": results, "probes": probes, "resident_uncapped": {str(n): r for n, r in resident.items()}}


def estimate_seconds(systems: list[str], batch_sizes: list[int], caps: list[float], available: int,
                     row_s: float = 45.0, probe_s: float = 35.0) -> tuple[float, int]:
    """Worst-case seconds of a run (rows at ``row_s`` each; capacity probes at ``probe_s``, doubling
    and bisection up to each size bound) and the number of capacity probes."""
    probes = 0
    for cap in caps:
        for system in systems:
            upper = size_bound(system, available, int(cap * GiB))
            probes += 2 * max(1, upper.bit_length())
    return len(systems) * len(batch_sizes) * row_s + probes * probe_s, probes


def print_capacity(found: dict) -> None:
    print(f"{'system':22s} {'cap GiB':>7s} {'blocks':>6s} {'params B':>8s} {'tokens/s':>9s} {'host B/param':>12s} "
          f"{'resident uncapped tok/s':>24s} complete")
    for e in found["results"]:
        if "error" in e:
            print(f"{e['system']:22s} {e['gpu_cap_GiB']:7.0f} error: {e['error'][:90]}")
            continue
        params = f"{e['params'] / 1e9:8.2f}" if "params" in e else f"{'-':>8s}"
        print(f"{e['system']:22s} {e['gpu_cap_GiB']:7.0f} {e['largest_n_blocks']:6d} {params} {e.get('tokens_per_s', '-'):>9} "
              f"{e.get('host_bytes_per_param', '-'):>12} {str(e.get('resident_uncapped_tokens_per_s', '-'))[:24]:>24s} "
              f"{e['search_complete']}")
