"""Write the example notebooks from their cell sources, then execute them to store outputs.

The committed notebooks carry their outputs, so a reader sees them on the repository page;
nbval re-executes them in CI and compares their outputs (notebooks/nbval_sanitize.cfg masks what truly
varies); only the live progress displays are tagged ``nbval-ignore-output``.

Usage: python scripts/build_notebooks.py [NAME.ipynb ...]   (all of them by default)
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LIVE_PROGRESS = "nbval-ignore-output"


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str, *tags: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


SETUP = code(
    """
%load_ext enot_nb
import torch
from enot_nb import distributed as ed

# One process per GPU; on a machine without GPUs, two CPU processes (gloo).
NPROCS = torch.cuda.device_count() or 2
    """
)

BLOBS = """
from torch.utils.data import TensorDataset

def make_blobs(n, seed):
    \"\"\"Four Gaussian blobs in 16 dimensions; the label is the blob.\"\"\"
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(0, 4, (n,), generator=g)
    points = centers[labels] + torch.randn(n, 16, generator=g) * 2.0
    return TensorDataset(points, labels)

train_set, test_set = make_blobs(4096, seed=0), make_blobs(1024, seed=1)
"""
"""The data set of the training notebooks (02, 05): made here, no download."""

QUICKSTART = [
    md("""
# enot_nb quickstart

`%%enot_distributed` runs a cell on several processes, each with `torch.distributed` set up.
Only the master (rank 0) prints, and what the cell defines comes back to the notebook.
"""),
    SETUP,
    code("""
%%enot_distributed -n $NPROCS
print(f"rank {ed.get_rank()} of {ed.get_world_size()}: only the master prints")
"""),
    md("`--output all` shows every rank, each line prefixed by its rank."),
    code(
        """
%%enot_distributed -n $NPROCS --output all
print(f"hello from rank {ed.get_rank()}")
"""  # the ranks' order varies: notebooks/nbval_sanitize.cfg masks it, not the lines
    ),
    md("""
## The functional API
`enot_nb.distributed` works the same here, in a script, and under `torchrun`:
`is_master`, `master_only`, `master_first` (the master runs a block first: downloads, caches) and
`sync_model` (identical weights on every rank).
"""),
    code("""
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)

@ed.master_only
def log(message):
    print(message)
"""),
    code("""
%%enot_distributed -n $NPROCS
import pathlib, tempfile
cache = pathlib.Path(tempfile.gettempdir()) / "enot_nb_quickstart_cache.txt"
with ed.master_first():           # the master writes the cache; the others wait, then read it
    if ed.is_master():
        cache.write_text("made by the master")
    cached = cache.read_text()

with torch.no_grad():              # make the ranks differ on purpose...
    model.weight.fill_(float(ed.get_rank()))
ed.sync_model(model)               # ...then average the weights across ranks
log(f"weights after sync_model: {model.weight.tolist()}")
world = ed.get_world_size()
"""),
    md("Variables the cell bound, and the model it changed, are now in the notebook:"),
    code(
        """
print(cached, world)
print(model.weight)
"""
    ),
]

TRAIN = [
    md("""
# Train a classifier on every process

A data set made here (no download), a small MLP, `DistributedDataParallel` with a
`DistributedSampler`, run on every GPU (or on 2 CPU processes) by `%%enot_distributed`.
The trained model comes back and is evaluated in the notebook.
"""),
    SETUP,
    code(
        BLOBS
        + """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
EPOCHS = 6
"""
    ),
    md("""
The training cell. `model` is synced from the master before the cell runs; the master prints
and plots; `--return model,losses` brings those two back (the model updated in place).
"""),
    code("""
%%enot_distributed -n $NPROCS --seed 0 --return model,losses
import matplotlib.pyplot as plt
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

device = torch.device("cuda", ed.get_local_rank()) if torch.cuda.is_available() else torch.device("cpu")
model.to(device)
ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
sampler = DistributedSampler(train_set, seed=0)
loader = DataLoader(train_set, batch_size=64, sampler=sampler)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

losses = []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    total = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
    dist.all_reduce(total)
    losses.append((total[0] / total[1]).item())
    if ed.is_master():
        print(f"epoch {epoch}: loss {losses[-1]:.3f}")

if ed.is_master():
    plt.plot(range(1, EPOCHS + 1), losses, marker="o")
    plt.xlabel("epoch")
    plt.ylabel("training loss")
    plt.title(f"DDP on {ed.get_world_size()} processes")
    plt.show()
"""),
    md("Back in the notebook: the trained model, evaluated on held-out data (chance is 25%)."),
    code("""
with torch.no_grad():
    x, y = test_set.tensors
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
print(f"held-out accuracy: {accuracy:.1%}")
print("well above chance:", accuracy > 0.6)
print("loss went down:", losses[-1] < losses[0])
"""),
]

LAUNCHER = [
    md("""
# `notebook_launcher`: a function on every process

Define a function in the notebook, run it on N processes, get the master's return value.
A failure on any rank becomes one `WorkerFailedError` naming the rank, with its traceback.
"""),
    code("""
import torch
import enot_nb
from enot_nb import WorkerFailedError
from enot_nb import distributed as ed

NPROCS = torch.cuda.device_count() or 2
"""),
    code("""
def total_of_ranks(scale):
    import torch.distributed as dist
    device = torch.device("cuda", ed.get_local_rank()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([float(ed.get_rank() + 1)], device=device)
    dist.all_reduce(value)
    return {"world": ed.get_world_size(), "sum": value.item() * scale}

result = enot_nb.notebook_launcher(total_of_ranks, args=(10,), nprocs=NPROCS)
print(result == {"world": NPROCS, "sum": 10 * NPROCS * (NPROCS + 1) / 2})
"""),
    md("A deliberate failure on rank 1, while rank 0 waits in a barrier: caught, shown, no hang."),
    code("""
def fails_on_rank_1():
    import torch.distributed as dist
    if ed.get_rank() == 1:
        raise ValueError("rank 1 could not read its shard")
    dist.barrier()

try:
    enot_nb.notebook_launcher(fails_on_rank_1, nprocs=NPROCS)
except WorkerFailedError as err:
    print(f"rank {err.rank} failed with exit code {err.exitcode}")
    print(err.traceback.strip().splitlines()[-1])
"""),
    md("Nothing was left running; launching again works right away:"),
    code("""
enot_nb.notebook_launcher(total_of_ranks, args=(1,), nprocs=NPROCS)["world"] == NPROCS
"""),
]

FRAMEWORKS = [
    md("""# Frameworks in a distributed cell

Code that runs under `torchrun` runs unchanged in `%%enot_distributed`: each worker looks like a
torchrun worker (`TORCHELASTIC_RUN_ID`, `LOCAL_WORLD_SIZE`, ... are set), and the master looks like
this kernel to display libraries, so progress bars and widgets appear here, live.

Below: a Hugging Face `Trainer`, a Lightning `Trainer` with `strategy="ddp"` and a `tqdm.auto` bar,
each on every GPU (or on 2 CPU processes). Tiny models built here: nothing is downloaded."""),
    code("""%load_ext enot_nb
import torch

# One process per GPU; on a machine without GPUs, two CPU processes (gloo).
NPROCS = torch.cuda.device_count() or 2
ON_GPU = torch.cuda.is_available()"""),
    md("""## Hugging Face `Trainer`

A small BERT made from a config, trained on random token sequences. The `Trainer` finds the
process group that the workers already form, and shows its own progress display."""),
    code("""import tempfile

import transformers

config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=2)
torch.manual_seed(0)
bert = transformers.BertForSequenceClassification(config)
before = bert.classifier.weight.detach().clone()
rows = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.tensor(i % 2)} for i in range(256)]
output_dir = tempfile.mkdtemp()"""),
    code(
        """%%enot_distributed -n $NPROCS
args = transformers.TrainingArguments(output_dir=output_dir, num_train_epochs=2, per_device_train_batch_size=16,
                                      report_to=[], use_cpu=not ON_GPU, save_strategy="no", logging_steps=4)
trainer = transformers.Trainer(model=bert, args=args, train_dataset=rows)
trainer.train()
world_size = trainer.args.world_size
del trainer, args""",
        # nbval applies neither update_display_data nor clear_output, so what it keeps of a live
        # progress display depends on timing; the next cell checks what the cell must leave.
        LIVE_PROGRESS,
    ),
    code("""print("ranks:", world_size)
print("BERT came back trained:", not torch.equal(bert.classifier.weight, before))"""),
    md("""## Lightning `Trainer` with `strategy="ddp"`

In a notebook Lightning allows only `ddp_notebook`, which forks its own processes. In a
distributed cell the workers are already the ranks, as under torchrun, so the usual `"ddp"` is
what to use (`ddp_notebook` there is refused with a clear error)."""),
    code("""import pytorch_lightning as pl


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


torch.manual_seed(0)
x = torch.randn(512, 8)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
regressor = Regressor()
with torch.no_grad():
    loss_before = torch.nn.functional.mse_loss(regressor.net(data.tensors[0]), data.tensors[1]).item()"""),
    code(
        """%%enot_distributed -n $NPROCS
trainer = pl.Trainer(accelerator="gpu" if ON_GPU else "cpu", devices=NPROCS, strategy="ddp", max_epochs=5,
                     logger=False, enable_checkpointing=False, enable_model_summary=False)
trainer.fit(regressor, torch.utils.data.DataLoader(data, batch_size=32))
del trainer""",
        # nbval applies neither update_display_data nor clear_output, so what it keeps of a live
        # progress display depends on timing; the next cell checks what the cell must leave.
        LIVE_PROGRESS,
    ),
    code("""with torch.no_grad():
    loss_after = torch.nn.functional.mse_loss(regressor.net(data.tensors[0]), data.tensors[1]).item()
print("the LightningModule came back trained:", loss_after < loss_before / 2)"""),
    md("""## A live `tqdm.auto` bar

The master's widgets reach this notebook through the kernel, under this cell; the other ranks'
are dropped like their output."""),
    code(
        """%%enot_distributed -n $NPROCS
import time

from tqdm.auto import tqdm

for step in tqdm(range(20), desc="master"):
    time.sleep(0.05)"""  # the bar's first render is compared (the widget itself is not: its id is random)
    ),
]

SESSION = [
    md("""
# A persistent session

`%enot_session start` starts the workers once; every `%%enot_distributed` cell after it runs on
them, one after another, each rank in a namespace of its own that lives across cells. A DDP
wrapper, an optimizer, a DataLoader built in one cell are there in the next, and the cell costs
what it does: no start, no import, no process group, no model shipped. The notebook mirrors the
master: after each session cell it holds what rank 0 holds, in place; a plain cell's changes
reach every rank before the next session cell.
"""),
    SETUP,
    code("%enot_session start -n $NPROCS --seed 0"),
    code(
        BLOBS
        + """torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
lr = 0.05
"""
    ),
    md("Build DDP once: the wrapper stays on the ranks (it cannot cross; the notebook gets `model`)."),
    code("""
%%enot_distributed
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

ddp = DistributedDataParallel(model)
sampler = DistributedSampler(train_set, seed=0)
loader = DataLoader(train_set, batch_size=64, sampler=sampler)
optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
epochs_done = 0

def train(epochs, quiet=False):
    global epochs_done
    for _ in range(epochs):
        sampler.set_epoch(epochs_done)
        total = torch.zeros(2)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)))])
        dist.all_reduce(total)
        epochs_done += 1
        if not quiet:
            print(f"epoch {epochs_done}: loss {(total[0] / total[1]).item():.3f}")
"""),
    code("""
%%enot_distributed
train(3)
"""),
    md("A plain cell: the model is the master's, trained, in the notebook."),
    code("""
def accuracy():
    with torch.no_grad():
        x, y = test_set.tensors
        return (model(x).argmax(dim=1) == y).float().mean().item()

print(f"after {epochs_done} epochs: held-out accuracy above chance: {accuracy() > 0.5}")
"""),
    md("Change the learning rate in a plain cell; it reaches every rank before the next session cell."),
    code("lr = 0.01"),
    code("""
%%enot_distributed
for group in optimizer.param_groups:
    group["lr"] = lr
train(2)
print("learning rate on rank", ed.get_rank(), "is", optimizer.param_groups[0]["lr"])
"""),
    md("""
## Interrupt and continue

The stop button (here a timer sends the kernel the same SIGINT) prints where each rank is, then
raises `KeyboardInterrupt` inside the cell on every rank, here in the middle of training. The
workers stay, with their state; the notebook holds the master's state at the interrupt, as a
local cell would. A rank caught inside a collective its peers left is released, and the group is
made again where it has to be; either way every rank then moves `ddp` onto the ranks' group with
its reducer reset, and takes the master's weights and optimizer state where its own differ (a
press between one rank's optimizer step and another's), so the same `ddp` and `optimizer` train on.
"""),
    code("""
import os, signal, threading
threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
"""),
    code(
        """
%%enot_distributed
train(10_000, quiet=True)   # the stop button lands while the ranks train
""",
        "raises-exception",
        LIVE_PROGRESS,  # the stacks printed at the press vary
    ),
    code("""
%%enot_distributed
start = epochs_done
train(1, quiet=True)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(both, flat)
print("the same ddp trained on:", epochs_done == start + 1, "- the replicas are equal:", torch.equal(*both))
"""),
    code("%enot_session", LIVE_PROGRESS),  # pids, memory and uptime vary
    code("""
print(f"held-out accuracy above chance: {accuracy() > 0.5}")
%enot_session stop
"""),
]


def build(name: str, cells: list) -> None:
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    nbformat.write(notebook, NOTEBOOKS / name)
    print("wrote", NOTEBOOKS / name)


ALL = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_train_classifier.ipynb": TRAIN,
    "03_launcher_and_errors.ipynb": LAUNCHER,
    "04_frameworks.ipynb": FRAMEWORKS,
    "05_session.ipynb": SESSION,
}

if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or ALL:  # e.g. `python scripts/build_notebooks.py 05_session.ipynb`
        build(name, ALL[name])
