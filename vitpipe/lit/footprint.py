"""What a fit costs, in two lines: the trainable parameters when it starts, the peak memory when it ends.

The two numbers parameter-efficient fine-tuning (``module.finetune=lora``, ``linear_probe``) is chosen
for, printed for every classifier fit so a LoRA run and a full one compare line for line:

    vitpipe: fit: 93,450 of 2,771,978 parameters trainable (3.37%; module.finetune=lora)
    vitpipe: fit: peak memory 1,234 MiB, 310 MiB above fit start (CPU: the training process's peak resident set)

Peak memory is, on CUDA, ``torch.cuda.max_memory_allocated`` since fit start (what tensors held: weights,
gradients, optimizer state, activations); on CPU, the process's peak resident set (Linux ``VmHWM``, reset at
fit start through ``/proc/self/clear_refs``), which also counts the interpreter, the imported libraries and the
data in memory; its growth above the resident set at fit start is what training added (gradients, optimizer
state, activations). Rank 0's numbers.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


def trainable_line(net: torch.nn.Module, mode: str) -> str:
    total = sum(p.numel() for p in net.parameters())
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return (f"vitpipe: fit: {trainable:,} of {total:,} parameters trainable "
            f"({100 * trainable / max(total, 1):.2f}%; module.finetune={mode})")


def _cpu_mib(field: str) -> float | None:
    """``VmHWM`` (the peak) or ``VmRSS`` (now) of this process in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


class Footprint(L.Callback):
    """Prints ``trainable_line`` at fit start and the peak memory at fit end (rank 0)."""

    def __init__(self, mode: str = "full") -> None:
        self.mode = mode
        self.cpu_start: float | None = None  # VmRSS when VmHWM was reset; None: no reset (not Linux)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after setup(): linear_probe has frozen its encoder by now
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM starts again from VmRSS
                self.cpu_start = _cpu_mib("VmRSS")
            except OSError:
                self.cpu_start = None
        if trainer.is_global_zero:
            print(trainable_line(pl_module.net, self.mode), flush=True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if pl_module.device.type == "cuda":
            mib = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
            print(f"vitpipe: fit: peak memory {mib:,.0f} MiB (CUDA: max_memory_allocated since fit start)", flush=True)
            return
        mib = _cpu_mib("VmHWM")
        if mib is None:
            return
        if self.cpu_start is None:
            print(f"vitpipe: fit: peak memory {mib:,.0f} MiB (CPU: the process's peak resident set since it started)",
                  flush=True)
            return
        print(f"vitpipe: fit: peak memory {mib:,.0f} MiB, {mib - self.cpu_start:,.0f} MiB above fit start (CPU: the "
              "training process's peak resident set)", flush=True)
