"""sync_model on ResNet-50- and BERT-base-shaped models against per-tensor collectives, DDP's
own broadcast, and one collective on a pre-flattened buffer of the same bytes."""

from __future__ import annotations

import enot_nb
from benchmarks import sync_job
from benchmarks.harness import Row

TARGETS = {"sync_model, reduce": "<= 1.3x flat", "sync_model, broadcast": "<= 1.3x flat"}


def run(repeats: int = 5) -> list[Row]:
    found = enot_nb.notebook_launcher(sync_job.measure, args=(repeats,), nprocs=2)
    rows = []
    for model, variants in found.items():
        for variant, seconds in variants.items():
            mode = "broadcast" if "broadcast" in variant and "Parallel" not in variant else "all_reduce"
            reference = variants[f"flat {mode} (reference)"]
            rows.append(
                Row(
                    f"sync_model: {model}, 2 processes",
                    variant,
                    seconds,
                    "s",
                    f"flat {mode}",
                    seconds / reference,
                    TARGETS.get(variant, ""),
                    repeats,
                )
            )
        per_tensor = variants["per-tensor all_reduce"] / variants["sync_model, reduce"]
        rows.append(
            Row(
                f"sync_model: {model}, 2 processes",
                "speed-up over per-tensor all_reduce",
                per_tensor,
                "x",
                "",
                None,
                ">= 3x (ResNet-50)" if "ResNet" in model else "",
                repeats,
            )
        )
    return rows
