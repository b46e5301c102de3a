"""The benchmark's table: one row per contender and phase, then the ratios and each comparison's own
lines. ``rows`` is the flat form the GPU check's report reads too, so the two cannot disagree. Plain
Python (no torch): the GPU check's report runs it after every step."""

from __future__ import annotations


def rows(result: dict):
    """``(comparison, contender, phase, figures)`` for every timed phase of a ``run`` result, in order."""
    for comp, res in result["results"].items():
        for name, phases in res["contenders"].items():
            for phase, s in phases.items():
                yield comp, name, phase, s


def format_table(result: dict) -> str:
    """One row per contender and phase, then the ratios."""
    cfg, env = result["config"], result["env"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"{cfg['variant']} @ {cfg['img_size']}px, batch {cfg['batch_size']}, {cfg['precision']}, {cfg['device']} "
        f"({env['device_name']}, {env['torch_threads']} threads), compile={cfg['compile']}, "
        f"{cfg['steps']} steps x {cfg['repeats']} repeats after {cfg['warmup']} warm-up; "
        f"load avg {env['loadavg_1m_start']:.1f} -> {env['loadavg_1m_end']:.1f}",
        f"{'comparison':<10} {'contender':<15} {'phase':<6} {'step ms':>9} {'img/s':>10} {'peak MB':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6}",
    ]
    for comp, name, phase, s in rows(result):
        peak = (s.get("memory") or {}).get("peak_step_bytes")
        mfu = None if s.get("mfu") is None else format(100 * s["mfu"], "5.1f") + "%"
        lines.append(f"{comp:<10} {name:<15} {phase:<6} {1e3 * s['step_s']:>9.2f} {s['img_s']:>10.1f} "
                     f"{fmt(None if peak is None else peak / 2**20, '9.1f'):>9} "
                     f"{fmt(s.get('tflops'), '8.3f'):>8} {fmt(mfu, ''):>6}")
    lines.append("ratios (time ratios: < 1 means the first is faster; throughput ratios: > 1):")
    for comp, res in result["results"].items():
        lines += [f"  {comp:<10} {key:<45} {value:.3f}" for key, value in res["ratios"].items()]
        if "max_abs_logit_diff" in res:
            lines.append(f"  {comp:<10} {'max |logit diff| vitpipe vs timm':<45} {res['max_abs_logit_diff']:.2e}")
        if "mixed_batch" in res:
            m, q = res["mixed_batch"], res["square_batch"]
            lines.append(f"  {comp:<10} mixed dict: {m['images']} images x {m['seq_len']} slots, {m['valid_tokens']} valid "
                         f"({100 * m['padding_fraction']:.1f}% padding); fixed: {q['images']} images x {q['seq_len']} "
                         f"= {q['valid_tokens']} tokens")
        for name, load in res.get("serve", {}).items():
            m = load["memory"]
            lines.append(f"  {comp:<10} {name}: {load['answered']}/{load['requests']} answered ({load['failed']} failed) by "
                         f"{res['clients']} clients, p50 {load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms, mean batch "
                         f"{load['mean_batch']:.1f} (max {load['max_batch']}), RSS {m['start']['rss_mb']:.0f} -> "
                         f"{m['end']['rss_mb']:.0f} MB (peak {m['start']['peak_rss_mb']:.0f} -> "
                         f"{m['end']['peak_rss_mb']:.0f} MB; PSS "
                         f"{m['start']['pss_mb']:.0f} -> {m['end']['pss_mb']:.0f} MB) over {m['end']['processes']} processes")
        if "max_abs_loss_diff" in res:
            lines.append(f"  {comp:<10} {'|loss diff| vitpipe vs reference MAE':<45} {res['max_abs_loss_diff']:.2e}")
        if "max_abs_target_diff" in res:
            lines.append(f"  {comp:<10} {'max |logit diff| of the two passes':<45} {res['max_abs_target_diff']:.2e} "
                         f"({res['teacher']})")
        for name, fig in res.get("agreement", {}).items():
            lines.append(f"  {comp:<10} {name + ' vs tome0: max |logit diff|, top-1 agreement':<45} "
                         f"{fig['max_abs_logit_diff']:.3g}, {100 * fig['top1_agreement']:.1f}% of {fig['images']} images")
        lines += [f"  {comp:<10} {name} unavailable: {why}" for name, why in res.get("unavailable", {}).items()]
    lines.append(f"memory: {result['memory_method']}")
    return "\n".join(lines)
