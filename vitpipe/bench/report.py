"""The result as a plain-text table: one row per contender and phase, then the ratios."""

from __future__ import annotations

PHASES = ("train", "infer", "load")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    cfg, env = result["config"], result["env"]
    lines = [
        f"{cfg['variant']} @ {cfg['img_size']}px, batch {cfg['batch_size']}, {cfg['precision']}, {cfg['device']} "
        f"({env['device_name']}, {env['torch_threads']} threads), compile={cfg['compile']}, "
        f"{cfg['steps']} steps x {cfg['repeats']} repeats after {cfg['warmup']} warm-up; "
        f"load avg {env['loadavg_1m_start']:.1f} -> {env['loadavg_1m_end']:.1f}",
        f"{'comparison':<10} {'contender':<15} {'phase':<6} {'step ms':>9} {'img/s':>10} {'peak MB':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6}",
    ]
    for comp, res in result["results"].items():
        for name, phases in res["contenders"].items():
            for phase in PHASES:
                if phase not in phases:
                    continue
                s = phases[phase]
                peak = (s.get("memory") or {}).get("peak_step_bytes")
                lines.append(
                    f"{comp:<10} {name:<15} {phase:<6} {1e3 * s['step_s']:>9.2f} {s['img_s']:>10.1f} "
                    f"{_fmt(None if peak is None else peak / 2**20, '9.1f'):>9} {_fmt(s.get('tflops'), '8.3f'):>8} "
                    f"{'-' if s.get('mfu') is None else format(100 * s['mfu'], '5.1f') + '%':>6}"
                )
    lines.append("ratios (time ratios: < 1 means the first is faster; throughput ratios: > 1):")
    for comp, res in result["results"].items():
        for key, value in res["ratios"].items():
            lines.append(f"  {comp:<10} {key:<45} {value:.3f}")
        if "max_abs_logit_diff" in res:
            lines.append(f"  {comp:<10} {'max |logit diff| vitpipe vs timm':<45} {res['max_abs_logit_diff']:.2e}")
        for name, why in res.get("unavailable", {}).items():
            lines.append(f"  {comp:<10} {name} unavailable: {why}")
    lines.append(f"memory: {result['memory_method']}")
    return "\n".join(lines)
