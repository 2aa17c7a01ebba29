"""Frameworks and widgets in a distributed cell, in a real kernel, under fork and spawn.

What runs under torchrun runs unchanged in ``%%enot_distributed``: HF Trainer, Accelerate,
Lightning's Trainer and Fabric with strategy="ddp"; what they display reaches the client (tqdm.auto
bars and ipywidgets as comm messages under the cell), once, from the master only; logs and warnings
show once. Tiny models are built in the tests (no downloads). The frameworks come from the
``integrations`` extra.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._util import METHODS, clean_env, free_port, torchrun_cmd
from tests.kernel import ROOT, CellRun, Kernel

pytestmark = [pytest.mark.integrations, pytest.mark.slow, pytest.mark.timeout(300)]

for _name in ("transformers", "accelerate", "pytorch_lightning", "ipywidgets", "tqdm"):
    pytest.importorskip(_name, reason="the frameworks come with the 'integrations' extra")


@pytest.fixture(scope="module", params=METHODS)
def nb(request, tmp_path_factory):
    """One kernel per start method, its own log (stderr) kept to look for fork warnings."""
    log = tmp_path_factory.mktemp(f"kernel-{request.param}") / "kernel.log"
    kernel = Kernel(log_path=log)
    kernel.method = request.param
    try:
        kernel.ok("%load_ext enot_nb\nimport json, os, torch")
        yield kernel
    finally:
        kernel.shutdown()


def distributed(nb: Kernel, body: str, timeout: float = 240, flags: str = "") -> CellRun:
    return nb.run(f"%%enot_distributed -n 2 --backend gloo --start-method {nb.method} {flags}\n{body}", timeout=timeout)


def ok(run: CellRun) -> CellRun:
    assert run.error is None and run.status == "ok", run.traceback + run.stderr
    return run


def value(nb: Kernel, expression: str):
    return json.loads(nb.ok(f"print(json.dumps({expression}))").stdout)


# ----------------------------------------------------------------------------- torchrun's environment

TORCHRUN_KEYS = [
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "RANK",
]


def test_workers_look_like_torchrun_workers(nb):
    ok(
        distributed(
            nb,
            f"""
import torch.distributed as dist
env = {{k: os.environ.get(k) for k in {TORCHRUN_KEYS!r}}}
elastic = dist.is_torchelastic_launched()
everyone = [None, None]
dist.all_gather_object(everyone, (env["TORCHELASTIC_RUN_ID"], env["ROLE_RANK"], env["RANK"]))
""",
        )
    )
    env = value(nb, "env")
    run_id = env.pop("TORCHELASTIC_RUN_ID")
    assert run_id and value(nb, "elastic") is True
    assert env == {
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": None,
        "RANK": "0",
    }
    assert value(nb, "everyone") == [[run_id, "0", "0"], [run_id, "1", "1"]]


# ----------------------------------------------------------------------------- Lightning

LIGHTNING_SETUP = """
import pytorch_lightning as pl
class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
regressor = Regressor()
start = regressor.layer.weight.detach().clone()
"""
TRAINER = (
    'pl.Trainer(accelerator="cpu", devices=2, strategy="{strategy}", max_epochs=2, logger=False, '
    "enable_checkpointing=False, enable_model_summary=False)"
)


DIFFERENCE = """
def largest_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
"""
# The same training in one process, to compare with: the two ranks' shards dealt as
# DistributedSampler deals them (``shuffle`` as the framework asks: Lightning's Trainer shuffles,
# Fabric keeps the loader's order), and one DDP step over both ranks' batches of ``batch``
# samples (their mean losses' gradients averaged) as one step on the union of the two batches.
# ``skip`` leaves one step out: the tests check that the tolerance would see that.
REFERENCE = (
    """
import copy
def reference_run(module, dataset, batch, epochs, lr, shuffle, skip=None):
    twin = copy.deepcopy(module)
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr)
    x, y = dataset.tensors
    samplers = [torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=shuffle) for r in (0, 1)]
    step = 0
    for epoch in range(epochs):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), batch):
            chosen = shards[0][start:start + batch] + shards[1][start:start + batch]
            if step != skip:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(twin(x[chosen]), y[chosen]).backward()
                optimizer.step()
            step += 1
    return twin
"""
    + DIFFERENCE
)
TOLERANCE = 1e-5


def check_against_reference(nb: Kernel, trained: str, reference: str, skipped: str) -> None:
    """The notebook's model equals the one-process run within TOLERANCE, and leaving out one
    step moves the reference by far more than TOLERANCE."""
    assert value(nb, f"largest_difference({trained}, {reference})") < TOLERANCE
    assert value(nb, f"largest_difference({skipped}, {reference})") > 100 * TOLERANCE


def test_lightning_trainer_ddp_trains_on_the_workers(nb):
    nb.ok(LIGHTNING_SETUP + REFERENCE)
    nb.ok(
        "expected = reference_run(regressor.layer, data, batch=8, epochs=2, lr=0.1, shuffle=True)\n"
        "one_less = reference_run(regressor.layer, data, batch=8, epochs=2, lr=0.1, shuffle=True, skip=5)"
    )
    ok(
        distributed(
            nb,
            f"""
trainer = {TRAINER.format(strategy="ddp")}
trainer.fit(regressor, torch.utils.data.DataLoader(data, batch_size=8))
seen = [trainer.world_size, trainer.global_rank, trainer.num_training_batches]
""",
        )
    )
    assert value(nb, "seen") == [2, 0, 4]  # 64 samples, batches of 8, split over 2 ranks
    check_against_reference(nb, "regressor.layer", "expected", "one_less")


def test_lightning_fabric_ddp_trains_on_the_workers(nb):
    nb.ok(
        "torch.manual_seed(1)\nnet = torch.nn.Linear(4, 1)\nfirst = net.weight.detach().clone()\n"
        "pairs = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
        + REFERENCE
        + "expected = reference_run(net, pairs, batch=4, epochs=1, lr=0.1, shuffle=False)\n"
        "one_less = reference_run(net, pairs, batch=4, epochs=1, lr=0.1, shuffle=False, skip=2)"
    )
    ok(
        distributed(
            nb,
            """
from lightning_fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
wrapped, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(pairs, batch_size=4))
for x, y in loader:
    loss = torch.nn.functional.mse_loss(wrapped(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
fabric_seen = [fabric.world_size, fabric.global_rank, len(loader)]
del wrapped, loader, fabric
""",
        )
    )
    assert value(nb, "fabric_seen") == [2, 0, 4]
    check_against_reference(nb, "net", "expected", "one_less")


@pytest.mark.parametrize(
    "starter",
    [
        f"{TRAINER.format(strategy='ddp_notebook')}.fit(regressor, torch.utils.data.DataLoader(data))",
        "import torch.multiprocessing as mp\nfrom tests.helpers import jobs\nmp.spawn(jobs.forms_a_group, nprocs=2)",
        "import accelerate\naccelerate.notebook_launcher(print, num_processes=2)",
    ],
)
def test_processes_started_inside_a_worker_are_a_clear_error(nb, starter):
    nb.ok(LIGHTNING_SETUP)
    run = distributed(nb, starter, timeout=60)
    assert run.status == "error" and "LaunchError" in run.traceback
    assert "already one rank" in run.traceback and "strategy='ddp'" in run.traceback


def test_helper_processes_that_form_no_group_keep_working(nb):
    run = ok(
        distributed(
            nb,
            "import torch.multiprocessing as mp\n"
            "mp.start_processes(print, args=('helper',), nprocs=2, start_method='fork')",
        )
    )
    assert "0 helper" in run.stdout and "1 helper" in run.stdout


def test_dataloader_workers_keep_working(nb):
    ok(
        distributed(
            nb,
            """
loader = torch.utils.data.DataLoader(torch.arange(16.0), batch_size=4, num_workers=2,
                                     sampler=torch.utils.data.DistributedSampler(torch.arange(16.0)))
total = sum(batch.sum().item() for batch in loader)
del loader
""",
        )
    )
    # The master's shard, as DistributedSampler deals it (shuffled with seed 0), summed.
    expected = value(nb, "sum(list(torch.utils.data.DistributedSampler(torch.arange(16.0), num_replicas=2, rank=0)))")
    assert value(nb, "total") == expected == 73  # rank 1's shard sums to 47, an unshuffled one to 56


def test_torch_compile_workers_keep_working(nb):
    ok(
        distributed(
            nb,
            """
import torch._inductor.config
torch._inductor.config.compile_threads = 2  # compile in a pool of worker processes
compiled = torch.compile(lambda t: (t.sin() + 1).sum())(torch.ones(8)).item()
""",
        )
    )
    assert abs(value(nb, "compiled") - (8 + 8 * 0.8414709848)) < 1e-4


# ----------------------------------------------------------------------------- HF and Accelerate


HF_SETUP = """
import torch, transformers
# No dropout: nothing random in a step, so two runs of the same training compare exactly.
config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=2,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
torch.manual_seed(0)
bert = transformers.BertForSequenceClassification(config)
rows = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.tensor(i % 2)} for i in range(32)]
"""
HF_TRAINING = """
args = transformers.TrainingArguments(output_dir=OUTPUT_DIR, max_steps=3, per_device_train_batch_size=4,
                                      report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
hf = transformers.Trainer(model=bert, args=args, train_dataset=rows, callbacks=[KeepSteps()])
hf.train()
hf_seen = [hf.args.world_size, hf.state.global_step]
del hf, args
"""
# Rank 0's weights after each step (the check that a step left out would show).
HF_STEPS = """
import copy
kept_steps = []
class KeepSteps(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        kept_steps.append(copy.deepcopy(model.state_dict()))
"""
# The same training run by torchrun (2 ranks, gloo, on the CPU), as a script; rank 0 saves.
HF_SCRIPT = """
import sys
OUTPUT_DIR = sys.argv[1]
torch.distributed.init_process_group("gloo")
{training}
if torch.distributed.get_rank() == 0:
    torch.save(kept_steps, OUTPUT_DIR + "/torchrun.pt")
torch.distributed.destroy_process_group()
"""


def test_hf_trainer_trains_a_model_built_in_the_notebook(nb, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(HF_SETUP + HF_STEPS + HF_SCRIPT.format(training=HF_TRAINING))
    torchrun = subprocess.run(
        torchrun_cmd("--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(tmp_path)),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert torchrun.returncode == 0, torchrun.stdout[-3000:] + torchrun.stderr[-3000:]
    nb.ok(HF_SETUP + HF_STEPS + f"OUTPUT_DIR = {str(tmp_path / 'cell')!r}")
    ok(distributed(nb, HF_TRAINING))
    assert value(nb, "hf_seen") == [2, 3]
    nb.ok(f"by_torchrun = torch.load({str(tmp_path / 'torchrun.pt')!r})")
    difference = "max((a[k] - b[k]).abs().max().item() for k in a)"
    assert value(nb, f"(lambda a, b: {difference})(bert.state_dict(), by_torchrun[-1])") < 1e-6
    # A step left out would show: the last step moved the weights far more than the tolerance.
    assert value(nb, f"(lambda a, b: {difference})(by_torchrun[-2], by_torchrun[-1])") > 1e-5


def test_accelerate_prepare_backward_gather(nb):
    nb.ok(
        "torch.manual_seed(2)\nsmall = torch.nn.Linear(3, 1)\nsmall_start = small.weight.detach().clone()\n"
        # The same step in one process (both ranks' inputs are the same: their average is it).
        "import copy\nexpected = copy.deepcopy(small)\nstep = torch.optim.SGD(expected.parameters(), lr=0.1)\n"
        "expected(torch.ones(4, 3)).pow(2).mean().backward()\nstep.step()"
    )
    ok(
        distributed(
            nb,
            """
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
model, opt = accelerator.prepare(small, torch.optim.SGD(small.parameters(), lr=0.1))
loss = model(torch.ones(4, 3)).pow(2).mean()
accelerator.backward(loss)
opt.step()
gathered = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
acc_seen = [accelerator.num_processes, accelerator.is_main_process]
del model, opt, accelerator, loss
""",
        )
    )
    assert value(nb, "gathered") == [0, 1] and value(nb, "acc_seen") == [2, True]
    assert value(nb, "(small.weight - expected.weight).abs().max().item()") < 1e-6
    assert value(nb, "(small.bias - expected.bias).abs().max().item()") < 1e-6
    assert value(nb, "(expected.weight - small_start).abs().min().item()") > 1e-3  # the step moved it


# ----------------------------------------------------------------------------- widgets and output

TQDM = "from tqdm.auto import tqdm\nfor step in tqdm(range(5)):\n    pass"


def test_tqdm_auto_bar_reaches_the_client_once(nb):
    local = nb.ok(TQDM)
    run = ok(distributed(nb, TQDM))
    opened = [m for m in run.comms if m["msg_type"] == "comm_open"]
    assert len(opened) == sum(m["msg_type"] == "comm_open" for m in local.comms) > 0  # one bar
    html = [s["value"] for s in run.comm_states() if isinstance(s.get("value"), str)]
    assert any("5/5" in text for text in html), html  # the final update
    assert 5 in [s.get("value") for s in run.comm_states()]  # the progress itself
    assert "it/s" not in run.stderr  # not a text bar
    views = [d for d in run.displays if "application/vnd.jupyter.widget-view+json" in d["data"]]
    model_ids = {m["content"]["comm_id"] for m in opened}
    assert views and all(v["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] in model_ids for v in views)


def test_ipywidgets_progress_updated_in_a_loop(nb):
    body = (
        "import ipywidgets\nbar = ipywidgets.IntProgress(max=4)\ndisplay(bar)\n"
        "for i in range(4):\n    bar.value = i + 1\ndel bar"
    )
    local = nb.ok(body)
    run = ok(distributed(nb, body))
    values = [s["value"] for s in run.comm_states() if "value" in s]
    assert values == [s["value"] for s in local.comm_states() if "value" in s] and values[-1] == 4


def test_a_widget_shown_before_the_cell_updates_live(nb):
    nb.ok("import ipywidgets\nearlier = ipywidgets.IntProgress(max=3)\ndisplay(earlier)")
    run = distributed(nb, "for i in range(3):\n    earlier.value = i + 1")
    if nb.method == "spawn":  # a widget holds a comm and locks: it cannot be sent to a new process
        assert run.status == "error" and "'earlier' could not be sent to the workers" in run.traceback
        return
    ok(run)
    assert [s["value"] for s in run.comm_states()] == [1, 2, 3]  # under the cell, from the master


def _order(run: CellRun) -> list[str]:
    """What the client received, in order: stream text, display data, Output's msg_id changes."""
    seen = []
    for kind, content in run.arrived:
        if kind == "stream":
            seen += [line for line in content["text"].splitlines() if line]
        elif kind == "display_data":
            seen.append("display " + content["data"]["text/plain"])
        elif kind == "comm_msg" and "msg_id" in content["data"].get("state", {}):
            seen.append("capture on" if content["data"]["state"]["msg_id"] else "capture off")
    return seen


def test_output_widget_captures_under_the_cell(nb):
    body = (
        "import ipywidgets\nout = ipywidgets.Output()\ndisplay(out)\nprint('before')\n"
        "with out:\n    print('inside the widget')\nprint('after')\ndel out"
    )
    local, run = nb.ok(body), ok(distributed(nb, body))
    # The front end puts into the widget what arrives, under the cell, while its msg_id is set.
    expected = ["display Output()", "before", "capture on", "inside the widget", "capture off", "after"]
    assert _order(local) == expected and _order(run) == expected
    assert {"msg_id": run.msg_id} in run.comm_states()


def test_prints_and_display_data_keep_their_order(nb):
    body = "print('a')\ndisplay('X')\nprint('b')\ndisplay('Y')\nprint('c')"
    assert _order(ok(distributed(nb, body))) == _order(nb.ok(body)) == ["a", "display 'X'", "b", "display 'Y'", "c"]


def test_a_widget_made_in_the_cell_keeps_working_in_the_notebook(nb):
    ok(distributed(nb, "import ipywidgets\nmade = ipywidgets.IntProgress(max=3)\ndisplay(made)\nmade.value = 3"))
    run = nb.ok("made.value = 1")  # a local cell: the kernel now owns the widget's comm
    assert [s.get("value") for s in run.comm_states()] == [1]


def test_values_shown_by_the_displayhook_and_no_input_in_a_one_off_cell(nb):
    run = ok(distributed(nb, "get_ipython().run_cell('6 * 7')\nimport sys\nsys.displayhook(12345)"))
    assert [d["data"]["text/plain"] for d in run.displays] == ["42", "12345"]
    run = distributed(nb, "import getpass\nsecret = getpass.getpass('password: ')", timeout=60)
    assert run.status == "error" and "getpass() and the debugger need a way back from the notebook" in run.traceback


def test_widgets_from_a_launched_function(nb):
    nb.ok("""
import enot_nb
def progress():
    from tqdm.auto import tqdm
    for _ in tqdm(range(3)):
        pass
    return "done"
""")
    run = nb.ok(f'enot_nb.notebook_launcher(progress, nprocs=2, backend="gloo", start_method="{nb.method}")')
    assert run.result["text/plain"] == "'done'"
    assert any("3/3" in str(s.get("value")) for s in run.comm_states())


def test_logs_and_warnings_show_once(nb):
    nb.ok(
        "import logging, warnings, pytorch_lightning, transformers\n"
        "logging.basicConfig(level=logging.INFO, force=True)\ntrain_log = logging.getLogger('train')"
    )
    body = (
        "train_log.info('step %d', 7)\nwarnings.warn('mind the learning rate')\n"
        "pytorch_lightning._logger.info('from Lightning')\n"
        "transformers.logging.get_logger('transformers').warning('from transformers')"
    )
    local = nb.ok(body)
    run = ok(distributed(nb, body))
    # transformers' logger propagates to the root handler too when CI=true: then a local cell shows
    # it twice, and so must the distributed one.
    for text in ("INFO:train:step 7", "UserWarning: mind the learning rate", "from Lightning", "from transformers"):
        assert local.stderr.count(text) >= 1, local.stderr
        assert run.stderr.count(text) == local.stderr.count(text), (local.stderr, run.stderr)
    nb.ok("logging.getLogger().handlers.clear()")


def test_no_worker_wrote_to_the_kernels_sockets(nb):
    """ipykernel refuses (and logs) a send from a forked process: none was attempted."""
    nb.ok("1")  # the kernel has written everything it logged
    assert "send message from fork" not in nb.log_path.read_text(errors="replace")


# ----------------------------------------------------------------------------- the Lightning adapter

ADAPTED = """
import sys
sys.ps1 = ">>> "  # what a kernel has: Lightning would compute _IS_INTERACTIVE = True
import torch, lightning_fabric.connector  # imported before the worker starts (as under fork)
from enot_nb._worker import frameworks as _frameworks
_frameworks.adapt()
import pytorch_lightning, pytorch_lightning.callbacks.progress.rich_progress  # imported after (as in a cell)
print(sorted(name for name in _frameworks.LIGHTNING_FLAG_SOURCES + _frameworks.LIGHTNING_FLAG_HOLDERS
             if name in sys.modules and getattr(sys.modules[name], "_IS_INTERACTIVE") is False))
"""


def test_the_lightning_flag_is_cleared_in_every_module_that_holds_it():
    import subprocess

    import pytorch_lightning.callbacks.progress.rich_progress  # noqa: F401 - the holders exist
    import pytorch_lightning.trainer.connectors.accelerator_connector  # noqa: F401

    from enot_nb._worker import frameworks as _frameworks

    out = subprocess.run([sys.executable, "-c", ADAPTED], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    installed = [
        name
        for name in _frameworks.LIGHTNING_FLAG_SOURCES + _frameworks.LIGHTNING_FLAG_HOLDERS
        if name.split(".")[0] in ("lightning_fabric", "pytorch_lightning")
    ]
    assert json.loads(out.stdout.replace("'", '"')) == sorted(installed)
    assert pytorch_lightning.__version__ == _frameworks.LIGHTNING_TESTED


def test_a_lightning_without_the_flag_is_a_clear_error():
    import types

    from enot_nb._worker import frameworks as _frameworks
    from enot_nb.errors import IncompatibleFrameworkError

    with pytest.raises(
        IncompatibleFrameworkError,
        match=r"lightning_fabric.connector has no "
        r"_IS_INTERACTIVE.*pytorch-lightning==2\.6\.6",
    ):
        _frameworks._clear_flag(types.ModuleType("lightning_fabric.connector"))
