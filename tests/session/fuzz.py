"""The session fuzzer: seeded programs of plain and session cells, each run in a real kernel with
a two-rank gloo session and plainly in a reference IPython shell, the whole user namespace of
both compared after every cell (tests/session/fuzz_dump.py).

A program is 3 to 8 cells over a small vocabulary (``_Ops``): tensors and their views, NumPy
arrays and their views, ``t.numpy()`` and ``torch.from_numpy``, lists, dicts, tuples, sets, large
plain containers and aliases into them, dataclasses and ``__slots__`` classes defined in either
kind of cell, a module with BatchNorm, its optimizer and scheduler, DDP built in a session cell
and trained in later ones, in-place writes, rebinding and ``del`` on both sides, IPython's ``_``
and ``Out``. Cells of special kinds:

* ``--no-return``: then the names the session says are stale are pulled (docs/guide/sessions.md,
  "Stale means changed and not back"), and the namespaces compared;
* ``fails``: rank 1 raises after the cell's work; the notebook mirrors the master at the failure
  (docs/guide/failures.md, "What the notebook keeps"), which is the plain run;
* ``press``: the stop button during a loop; no plain result exists, so the notebook is compared
  with the master (``%enot_pull`` of every name the ranks hold must change nothing) and the DDP
  replicas across ranks, then the reference takes the notebook's state;
* ``thread``: a plain cell leaves a callback on a thread of the kernel (a widget's stands in); it
  runs between two later cells, outside any cell, and is joined before the next;
* ``silent``: the cell is run as a frontend's ``silent=True`` request (no ``pre_run_cell``).

After the last cell a session cell has every rank dump what it holds: the master must hold what
the notebook holds (the plain cells' changes reached the ranks), and the ranks must agree (on the
DDP replicas only, after a press: other variables legitimately differ per rank there).

Excluded, as the docs list them as limits (each with its doc line):
* IPython's own names stay its own (docs/guide/sessions.md, "IPython's own names stay its own on
  both sides"): a session cell's ``Out`` value is a copy, and a ``_`` it binds stays on the ranks;
  so ``_`` and ``Out`` are written only after plain cells, and the session cells' forward passes
  bind ``_`` only where no later cell writes through it (``_`` is not compared);
* a change made only through a reference a library holds (README, "What comes back");
* a layer replaced under a live DDP wrapper (docs/guide/sessions.md, "build ddp again"): the
  wrapped module and its optimizer are never rebound or deleted while ``ddp`` lives;
* rank-dependent values outside a failing cell (every rank runs the same cell on the same data);
* a ``--no-return`` cell that rebinds a name, then pulled: the pull writes the master's value into
  the notebook's object at that path, in place (docs/guide/sessions.md, "binds the master's values
  in the notebook (in place where an object of the same type sits at that path)"), where a local
  rebinding leaves the old object (and its views) as it was.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.session import fuzz_dump

PRELUDE = (
    "import torch, numpy as np, dataclasses, threading\n"
    "import torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "from enot_nb import distributed as ed\n"
    "torch.set_num_threads(1)\n"
    "def wrap(m):\n"
    "    return DDP(m) if dist.is_initialized() else m\n"
)
"""Run plainly in both, before the session starts. ``wrap`` is DDP on the ranks and the module
itself in the reference, where DDP's average of the ranks' equal gradients is the plain one. One
thread, as each of the two ranks has on two cores: float sums then add up in the same order."""

KERNEL_PRELUDE = (
    "from tests.session.fuzz_dump import probe as _fuzz_probe, ranks_report as _fuzz_ranks, stale as _fuzz_stale\n"
    "from tests.session.fuzz_dump import held as _fuzz_held, save as _fuzz_save\n"
)
"""The kernel's probes: library functions, so the tracker's reach of a probe cell is its name."""

_BINDS_UNDERSCORE = re.compile(r"^_ = ", re.MULTILINE)
"""A cell that binds IPython's ``_`` itself (a forward pass's output)."""

WORKER_ONLY = frozenset({"ddp"})
"""Names that live only on the ranks (a DDP wrapper cannot come back): compared there."""


@dataclass
class Cell:
    kind: str
    """plain, session, no-return, fails, press, thread (a plain cell leaving a callback),
    trigger (the callback runs, outside any cell), silent."""
    code: str
    callback: str = ""
    """For trigger: the callback's name."""

    def source(self) -> str:
        """The cell as a user would type it in the session's notebook."""
        header = {"session": "%%enot_distributed\n", "no-return": "%%enot_distributed --no-return\n"}
        if self.kind in ("fails", "press"):
            return "%%enot_distributed\n" + self.code
        return header.get(self.kind, "") + self.code


@dataclass
class Program:
    seed: int
    cells: list[Cell]
    replicated: list[str] = field(default_factory=list)
    """The names the ranks must agree on after a press: DDP's module, its optimizer."""
    ddp_module: str | None = None
    """The module ``ddp`` wraps (the reference's ``ddp`` is that module)."""

    def listing(self) -> str:
        """The cells, one block each, as a person reads them."""
        return "\n".join(
            f"--- {i} {c.kind}{' ' + c.callback if c.callback else ''}\n{c.code}" for i, c in enumerate(self.cells)
        )

    def notebook(self, method: str) -> str:
        """The program as a notebook (nbformat 4 JSON) that reproduces it."""
        cells = [
            _code("%load_ext enot_nb\n" + PRELUDE),
            _code(f"%enot_session start -n 2 --backend gloo --start-method {method}"),
        ]
        for cell in self.cells:
            if cell.kind == "trigger":
                cells.append(_markdown(f"Here another thread runs `{cell.callback}()` (a widget's callback)."))
                cells.append(_code(f"threading.Thread(target={cell.callback}).start()"))
            elif cell.kind == "silent":
                cells.append(_markdown("The next cell runs as a frontend's `silent=True` request."))
                cells.append(_code(cell.source()))
            elif cell.kind == "press":
                cells.append(_markdown("Press the stop button while the next cell runs."))
                cells.append(_code(cell.source()))
            else:
                cells.append(_code(cell.source()))
        book = {"cells": cells, "metadata": {"fuzz_seed": self.seed}, "nbformat": 4, "nbformat_minor": 5}
        return json.dumps(book, indent=1)


def _code(source: str) -> dict[str, Any]:
    return {"cell_type": "code", "metadata": {}, "source": source, "outputs": [], "execution_count": None}


def _markdown(source: str) -> dict[str, Any]:
    return {"cell_type": "markdown", "metadata": {}, "source": source}


# ----------------------------------------------------------------------------- the generator


@dataclass
class _Model:
    """What the generated program has bound so far, by kind (the same on both sides)."""

    kinds: dict[str, str] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)  # class name -> "dc" or "slots"
    module_of: dict[str, str] = field(default_factory=dict)  # optimizer -> module; scheduler -> optimizer
    ddp: str | None = None  # the module ddp wraps
    count: int = 0

    def new(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def of(self, *kinds: str) -> list[str]:
        return sorted(n for n, k in self.kinds.items() if k in kinds)

    def protected(self) -> set[str]:
        """What must stay bound as it is while ddp lives: its module, their optimizer, scheduler."""
        if self.ddp is None:
            return set()
        opts = {o for o, m in self.module_of.items() if m == self.ddp}
        return {self.ddp} | opts | {s for s, o in self.module_of.items() if o in opts}


class _Ops:
    """The vocabulary: each op returns its code (updating the model) or None where it does not
    apply now. ``where``: the kind of cell it is for (some only run in one kind)."""

    def __init__(self, rng: random.Random, model: _Model) -> None:
        self.rng, self.m = rng, model

    def pick(self, where: str, binds: bool = True) -> str:
        names = [n for n in dir(self) if n.startswith("op_")]
        for _ in range(50):
            op = getattr(self, self.rng.choice(names))
            code = op(where) if binds or not getattr(op, "binds", False) else None
            if code:
                return code
        return "pass"

    # -- making things
    def op_tensor(self, where: str) -> str:
        n = self.m.new("t")
        self.m.kinds[n] = "tensor"
        return f"{n} = torch.arange({self.rng.randint(3, 6)}, dtype=torch.float32) * {self.rng.randint(1, 3)}"

    def op_tensor_view(self, where: str) -> str | None:
        ts = self.m.of("tensor")
        if not ts:
            return None
        n = self.m.new("v")
        self.m.kinds[n] = "tensor"
        return f"{n} = {self.rng.choice(ts)}{self.rng.choice(['[1:]', '[:2]', '.view(-1)', '[::2]'])}"

    def op_numpy_of_tensor(self, where: str) -> str | None:
        ts = self.m.of("tensor")
        if not ts:
            return None
        n = self.m.new("a")
        self.m.kinds[n] = "array"
        return f"{n} = {self.rng.choice(ts)}.numpy()"

    def op_array(self, where: str) -> str:
        n = self.m.new("a")
        self.m.kinds[n] = "array"
        return f"{n} = np.arange({self.rng.randint(3, 6)}, dtype=np.float64)"

    def op_array_view(self, where: str) -> str | None:
        arrays = self.m.of("array")
        if not arrays:
            return None
        n = self.m.new("row")
        self.m.kinds[n] = "array"
        return f"{n} = {self.rng.choice(arrays)}{self.rng.choice(['[1:]', '[:2]', '[::2]'])}"

    def op_from_numpy(self, where: str) -> str | None:
        arrays = self.m.of("array")
        if not arrays:
            return None
        n = self.m.new("t")
        self.m.kinds[n] = "tensor"
        return f"{n} = torch.from_numpy({self.rng.choice(arrays)})"

    def op_containers(self, where: str) -> str:
        things = self.m.of("tensor", "array", "obj", "dict", "scalar") or ["0"]
        x = self.rng.choice(things)
        n = self.m.new(self.rng.choice(["L", "D", "T", "S"]))
        kind = {"L": "list", "D": "dict", "T": "tuple", "S": "set"}[n[0]]
        self.m.kinds[n] = kind
        return {
            "list": f"{n} = [{x}, 1, 'a']",
            "dict": f"{n} = {{'k': {x}, 'v': 2}}",
            "tuple": f"{n} = ({x}, 3)",
            "set": f"{n} = {{1, 2, {self.rng.randint(3, 9)}}}",
        }[kind]

    def op_big(self, where: str) -> str:
        n = self.m.new("log")
        self.m.kinds[n] = "big"
        size = self.rng.choice([999, 1000, 1200, 1500])
        return f"{n} = [{{'i': i, 'v': float(i)}} for i in range({size})]"

    def op_alias_into_big(self, where: str) -> str | None:
        bigs = self.m.of("big")
        if not bigs:
            return None
        n = self.m.new("rec")
        self.m.kinds[n] = "dict"
        return f"{n} = {self.rng.choice(bigs)}[{self.rng.choice([-1, 0, 5, 998])}]"

    def op_class(self, where: str) -> str:
        n = self.m.new("Cls")
        style = self.rng.choice(["dc", "slots"])
        self.m.classes[n] = style
        if style == "dc":
            return f"@dataclasses.dataclass\nclass {n}:\n    x: int\n    items: list"
        return (
            f"class {n}:\n    __slots__ = ('x', 'items')\n"
            "    def __init__(self, x, items):\n        self.x, self.items = x, items"
        )

    def op_instance(self, where: str) -> str | None:
        if not self.m.classes:
            return None
        cls = self.rng.choice(sorted(self.m.classes))
        n = self.m.new("o")
        self.m.kinds[n] = "obj"
        things = self.m.of("tensor", "array") or ["None"]
        return f"{n} = {cls}({self.rng.randint(0, 5)}, [{self.rng.choice(things)}])"

    def op_module(self, where: str) -> str | None:
        if len(self.m.of("module")) >= 2:
            return None
        n = self.m.new("net")
        self.m.kinds[n] = "module"
        return (
            f"torch.manual_seed({self.rng.randint(0, 9)})\n"
            f"{n} = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))"
        )

    def op_param_alias(self, where: str) -> str | None:
        modules = self.m.of("module")
        if not modules:
            return None
        n = self.m.new("w")
        self.m.kinds[n] = "param"
        return f"{n} = {self.rng.choice(modules)}[{self.rng.choice([0, 2])}].{self.rng.choice(['weight', 'bias'])}"

    def op_optimizer(self, where: str) -> str | None:
        free = [m for m in self.m.of("module") if m not in self.m.module_of.values()]
        if not free:
            return None
        module = self.rng.choice(free)
        n = self.m.new("opt")
        self.m.kinds[n] = "opt"
        self.m.module_of[n] = module
        return f"{n} = torch.optim.SGD({module}.parameters(), lr=0.1, momentum=0.9)"

    def op_scheduler(self, where: str) -> str | None:
        opts = [o for o in self.m.of("opt") if o not in self.m.module_of.values()]
        if not opts:
            return None
        opt = self.rng.choice(opts)
        n = self.m.new("sched")
        self.m.kinds[n] = "sched"
        self.m.module_of[n] = opt
        return f"{n} = torch.optim.lr_scheduler.StepLR({opt}, 1, gamma=0.5)"

    def op_ddp(self, where: str) -> str | None:
        if where != "session" or self.m.ddp is not None or not self.m.of("module"):
            return None
        self.m.ddp = self.rng.choice(self.m.of("module"))
        return f"ddp = wrap({self.m.ddp})"

    # -- changing things
    def op_tensor_write(self, where: str) -> str | None:
        ts = self.m.of("tensor")
        if not ts:
            return None
        t = self.rng.choice(ts)
        return self.rng.choice([f"{t}.add_(1)", f"{t}[0] = {self.rng.randint(5, 9)}", f"{t}.mul_(2)"])

    def op_array_write(self, where: str) -> str | None:
        arrays = self.m.of("array")
        if not arrays:
            return None
        a = self.rng.choice(arrays)
        return self.rng.choice([f"{a}[0] = {self.rng.randint(5, 9)}", f"{a} += 10", f"{a} *= 3"])

    def op_read(self, where: str) -> str | None:
        things = self.m.of("tensor", "array")
        if not things:
            return None
        n = self.m.new("s")
        self.m.kinds[n] = "scalar"
        return f"{n} = float({self.rng.choice(things)}.sum())"

    def op_container_write(self, where: str) -> str | None:
        choices = self.m.of("list", "dict", "set", "obj", "big")
        if not choices:
            return None
        c = self.rng.choice(choices)
        kind = self.m.kinds[c]
        things = self.m.of("tensor", "array", "scalar") or ["7"]
        x = self.rng.choice(things)
        if kind == "list":
            return f"{c}.append({x})"
        if kind == "dict":
            return self.rng.choice([f"{c}['v'] = {self.rng.randint(10, 99)}", f"{c}['k2'] = {x}"])
        if kind == "set":
            return f"{c}.add({self.rng.randint(10, 99)})"
        if kind == "big":
            return self.rng.choice(
                [
                    f"{c}.append({{'i': -1, 'v': 0.5}})",
                    f"{c}[5]['v'] += 1",
                    f"{c}[-1]['v'] = -{self.rng.randint(1, 9)}.0",
                ]
            )
        return self.rng.choice([f"{c}.x += 1", f"{c}.items.append({x})"])

    def op_read_big(self, where: str) -> str | None:
        bigs = self.m.of("big")
        if not bigs:
            return None
        n = self.m.new("s")
        self.m.kinds[n] = "scalar"
        return f"{n} = sum(r['v'] for r in {self.rng.choice(bigs)})"

    def op_param_write(self, where: str) -> str | None:
        params = self.m.of("param")
        if not params:
            return None
        p = self.rng.choice(params)
        return self.rng.choice([f"{p}.data.mul_(0.5)", f"with torch.no_grad():\n    {p}.add_(1)"])

    def op_forward(self, where: str) -> str | None:
        modules = self.m.of("module")
        if not modules:
            return None
        module = self.rng.choice(modules)
        batch = f"torch.randn(8, 4, generator=torch.Generator().manual_seed({self.rng.randint(0, 99)}))"
        if module == self.m.ddp and where != "plain":
            return None  # through ddp (op_step) on the ranks: its hooks expect it
        return (
            f"_ = {module}({batch})" if self.rng.random() < 0.5 else f"{module}.{self.rng.choice(['eval', 'train'])}()"
        )

    def op_step(self, where: str) -> str | None:
        opts = [o for o in self.m.of("opt") if self.m.module_of[o] in self.m.kinds]
        if not opts:
            return None
        opt = self.rng.choice(opts)
        module = self.m.module_of[opt]
        if module == self.m.ddp:
            if where == "plain":
                return None  # ddp lives on the ranks
            module = "ddp"
        batch = f"torch.randn(8, 4, generator=torch.Generator().manual_seed({self.rng.randint(0, 99)}))"
        scheds = [s for s, o in self.m.module_of.items() if o == opt and s in self.m.kinds]
        step = f"{opt}.zero_grad()\n{module}({batch}).pow(2).mean().backward()\n{opt}.step()"
        return step + "".join(f"\n{s}.step()" for s in scheds)

    def op_lr(self, where: str) -> str | None:
        opts = self.m.of("opt")
        if not opts:
            return None
        return f"{self.rng.choice(opts)}.param_groups[0]['lr'] = {self.rng.choice([0.05, 0.01, 0.2])}"

    def op_rebind(self, where: str) -> str | None:
        if where == "no-return":
            return None  # the pull writes the master's new value into the old object (see the module's docstring)
        ts = [t for t in self.m.of("tensor", "scalar", "array") if t not in self.m.protected()]
        if not ts:
            return None
        t = self.rng.choice(ts)
        return f"{t} = {t} + 1"

    op_rebind.binds = True  # type: ignore[attr-defined]

    def op_del(self, where: str) -> str | None:
        if where == "no-return":
            return None  # a name a --no-return cell deleted has nothing to pull
        names = [n for n in self.m.kinds if n not in self.m.protected() and n not in self.m.module_of.values()]
        if not names:
            return None
        n = self.rng.choice(sorted(names))
        del self.m.kinds[n]
        self.m.module_of.pop(n, None)  # an optimizer deleted: no press loop steps it
        for dependent in [d for d, of in self.m.module_of.items() if of == n]:
            self.m.module_of.pop(dependent)
        return f"del {n}"

    op_del.binds = True  # type: ignore[attr-defined]


def generate(seed: int, *, presses: bool = True) -> Program:
    """A program of 3 to 8 cells (see the module's docstring)."""
    rng = random.Random(seed)
    model = _Model()
    ops = _Ops(rng, model)
    cells: list[Cell] = []
    length = rng.randint(3, 8)
    kinds = ["plain"] * 8 + ["session"] * 8 + ["no-return"] * 2 + ["fails"] * 2 + ["thread", "silent", "underscore"]
    kinds += ["press"] if presses else []
    while len(cells) < length:
        kind = rng.choice(kinds)
        if not any(c.kind in ("session", "fails", "no-return") for c in cells) and kind != "plain":
            kind = "session"  # something on the ranks before the special cells
        if kind == "underscore":
            things = model.of("tensor", "array")
            if things:
                shown = Cell("plain", rng.choice(things))
                write = Cell("plain", rng.choice(["_", "Out[max(Out)]"]) + rng.choice(["[0] = 42", " *= 2"]))
                if not any(c.kind != "plain" and _BINDS_UNDERSCORE.search(c.code) for c in cells):
                    cells += [shown, write]  # (else a session cell's _ is the plain run's: not written)
            continue
        if kind == "thread":
            writes = [op for op in (ops.op_tensor_write, ops.op_array_write, ops.op_container_write) if op("plain")]
            if not writes:
                continue
            name = f"_fuzz_cb{len(cells)}"
            body = rng.choice(writes)("plain")
            assert body is not None
            declared = "".join(f"    global {n}\n" for n in sorted(_bound(body)))
            cells.append(Cell("thread", f"def {name}():\n{declared}    {body}\n_fuzz_leave({name})"))
            cells.append(Cell("session", ops.pick("session", binds=False)))
            cells.append(Cell("trigger", "", callback=name))
            continue
        if kind == "press":
            cells.append(Cell("press", _press_loop(model, rng)))
            continue
        where = {"fails": "session", "silent": "plain"}.get(kind, kind)
        code = "\n".join(ops.pick(where) for _ in range(rng.randint(1, 3)))
        if kind == "fails":
            code += "\nif ed.get_rank() == 1:\n    raise RuntimeError('fuzz: rank 1 fails')"
        cells.append(Cell(kind, code))
    return Program(seed, cells, sorted(model.protected()), model.ddp)


def _press_loop(model: _Model, rng: random.Random) -> str:
    """A loop the stop button interrupts: DDP training where it lives, else an in-place count."""
    if model.ddp is not None:
        opts = [o for o, m in model.module_of.items() if m == model.ddp]
        if opts:
            opt = opts[0]
            return (
                "_fuzz_g = torch.Generator().manual_seed(0)\n"
                "for _fuzz_i in range(10**9):\n"
                f"    {opt}.zero_grad()\n"
                "    ddp(torch.randn(8, 4, generator=_fuzz_g)).pow(2).mean().backward()\n"
                f"    {opt}.step()\n"
                "    if _fuzz_i == 2:\n        print('fuzz-running', flush=True)"
            )
    n = model.new("count")
    model.kinds[n] = "tensor"
    return (
        f"{n} = torch.zeros(2)\n"
        "for _fuzz_i in range(10**9):\n"
        f"    {n}.add_(1)\n"
        "    if _fuzz_i == 2:\n        print('fuzz-running', flush=True)"
    )


# ----------------------------------------------------------------------------- running one


class Mismatch(AssertionError):
    """The session's notebook (or its ranks) and the reference differ after a cell."""


class Invalid(Exception):
    """The program cannot run plainly (a shrunk one that lost a cell a later one needs)."""


class Reference:
    """The plain run: an IPython shell in this process."""

    def __init__(self) -> None:
        from IPython.core.interactiveshell import InteractiveShell

        self.shell = InteractiveShell.instance()
        self.threads = torch.get_num_threads()

    def close(self) -> None:
        """This process's torch threads as they were (the prelude sets one)."""
        torch.set_num_threads(self.threads)

    def reset(self) -> None:
        self.shell.reset(new_session=False)
        self.run(PRELUDE)

    def run(self, code: str, silent: bool = False) -> None:
        result = self.shell.run_cell(code, store_history=not silent, silent=silent)
        error = result.error_in_exec or result.error_before_exec
        if error is not None:
            raise Invalid(f"the plain run failed on {code!r}: {error!r}")

    def dump(self) -> dict[str, Any]:
        return fuzz_dump.dump(self.shell.user_ns, WORKER_ONLY | set(self.shell.user_ns_hidden))


class Leaving:
    """A callback left on a thread of the kernel, run on demand from here (a FIFO per side)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="enot-fuzz-")
        self.go, self.done = os.path.join(self.folder, "go"), os.path.join(self.folder, "done")
        os.mkfifo(self.go)
        os.mkfifo(self.done)

    def code(self) -> str:
        """The kernel's ``_fuzz_leave(callback)``: one daemon thread, started by the first, runs
        the callback it is told by name each time it is told (one thread for all: two waiting on
        one FIFO, the wrong one could take the word), and lives on between, as a widget's thread
        does, until told to end."""
        return (
            "_fuzz_callbacks = {}\n"
            "def _fuzz_leave(callback):\n"
            "    def run():\n"
            "        while True:\n"
            f"            with open({self.go!r}) as go:\n"
            "                name = go.read()\n"
            "            if name not in _fuzz_callbacks:\n"
            "                return\n"
            "            try:\n"
            "                _fuzz_callbacks[name]()\n"
            "            finally:\n"
            f"                with open({self.done!r}, 'w') as done:\n"
            "                    done.write('x')\n"
            "    if not _fuzz_callbacks:\n"
            "        threading.Thread(target=run, daemon=True).start()\n"
            "    _fuzz_callbacks[callback.__name__] = callback\n"
        )

    def run_one(self, name: str, timeout: float = 60) -> None:
        """Tell the waiting thread to run the callback ``name`` and wait until it has (bounded)."""

        def tell_and_wait() -> None:
            with open(self.go, "w") as go:
                go.write(name)
            with open(self.done) as done:
                done.read()

        helper = threading.Thread(target=tell_and_wait, daemon=True)
        helper.start()
        helper.join(timeout)
        if helper.is_alive():
            raise Mismatch("the kernel's callback thread did not run")

    def close(self) -> None:
        """Tell a waiting thread to end (if one waits), and remove the FIFOs."""
        try:
            end = os.open(self.go, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO where no thread waits
        except OSError:
            pass
        else:
            os.write(end, b"q")
            os.close(end)
        for path in (self.go, self.done):
            os.unlink(path)
        os.rmdir(self.folder)


def kernel_dump(kernel: Any) -> dict[str, Any]:
    return _json_line(kernel, "_fuzz_probe()")


def _json_line(kernel: Any, code: str) -> Any:
    run = kernel.run(code)
    if run.error is not None:
        raise Mismatch(f"{code} failed: {run.traceback}")
    return json.loads(run.stdout.strip().splitlines()[-1])


class Runner:
    """Runs programs in a kernel that keeps its session between them, and in the reference."""

    def __init__(self, kernel: Any, reference: Reference, method: str) -> None:
        self.kernel, self.reference, self.method = kernel, reference, method
        self.cells = 0

    def run(self, program: Program) -> None:
        """Run ``program`` in both; raise Mismatch at the first difference."""
        kernel, reference = self.kernel, self.reference
        reference.reset()
        leaving = Leaving()
        try:
            kernel.ok("%enot_session stop\n%reset -f", timeout=120)
            kernel.ok(PRELUDE + KERNEL_PRELUDE + leaving.code())
            reference.run(leaving.code().replace("threading.Thread(target=run, daemon=True).start()", "pass"))
            kernel.ok(f"%enot_session start -n 2 --backend gloo --start-method {self.method}", timeout=180)
            presses = False
            for i, cell in enumerate(program.cells):
                where = f"after cell {i} ({cell.kind})"
                self._cell(cell, leaving, program, where)
                presses |= cell.kind == "press"
                self.cells += 1
                _compare(kernel_dump(kernel), reference.dump(), where)
            self._ranks(program.replicated if presses else None, "after the last cell")
        finally:
            leaving.close()

    def _cell(self, cell: Cell, leaving: Leaving, program: Program, where: str) -> None:
        kernel, reference = self.kernel, self.reference
        if cell.kind == "trigger":
            try:
                reference.shell.user_ns[cell.callback]()
            except Exception as err:  # noqa: BLE001 - the callback's names are gone: no finding
                raise Invalid(f"the callback {cell.callback} fails plainly: {err!r}") from err
            leaving.run_one(cell.callback)
            return
        if cell.kind == "press":
            self._press(cell, program, where)
            return
        if cell.kind == "silent":
            reference.run(cell.code, silent=True)
            _silent(kernel, cell.code)
            return
        reference.run(cell.code)  # first: a program that cannot run plainly is no finding
        run = kernel.run(cell.source(), timeout=120)
        if cell.kind == "fails":
            if (
                run.error is None
                or run.error["ename"] != "WorkerFailedError"
                or "rank 1" not in run.stderr + run.traceback
            ):
                raise Mismatch(f"{where}: rank 1's failure was not reported: {run.error} {run.stderr[-2000:]}")
        elif run.error is not None or "UsageError" in run.stderr:  # (a refused cell is no error to IPython)
            raise Mismatch(
                f"{where}: the cell failed in the session's kernel only:\n{run.traceback}\n{run.stderr[-3000:]}"
            )
        if cell.kind == "no-return":  # what the cell changed (stale) and bound: pulled
            pulled = sorted(set(_json_line(kernel, "_fuzz_stale()")) | _bound(cell.code))
            if pulled:
                kernel.ok("%enot_pull " + ",".join(pulled), timeout=120)

    def _press(self, cell: Cell, program: Program, where: str) -> None:
        """The stop button during the loop; then the notebook must be the master (a pull of every
        name the ranks hold changes nothing) and the DDP replicas equal; the reference then takes
        the notebook's state (no plain run can say where the press landed)."""
        kernel = self.kernel
        pressed: list[bool] = []

        def press(run: Any) -> None:
            if "fuzz-running" in run.stdout and not pressed:
                pressed.append(True)
                kernel.manager.interrupt_kernel()

        run = kernel.run(cell.source(), timeout=180, on_output=press)
        if not pressed or run.error is None:
            raise Mismatch(f"{where}: the press did not stop the cell: {run.error} {run.stdout[-1000:]}")
        before = kernel_dump(kernel)
        held = _json_line(kernel, "_fuzz_held()")
        if held:
            pulled = kernel.run("%enot_pull " + ",".join(held), timeout=120)
            if pulled.error is not None:
                raise Mismatch(f"{where}: the pull after the press failed:\n{pulled.traceback}")
        _compare(kernel_dump(kernel), before, where + ", the pull of what the ranks hold", "after the pull", "before")
        self._ranks(program.replicated, where)
        changed = sorted(_bound(cell.code) | (set(program.replicated) if "ddp(" in cell.code else set()))
        path = os.path.join(tempfile.mkdtemp(prefix="enot-fuzz-"), "state.pt")
        try:
            kernel.ok(f"_fuzz_save({path!r}, {changed!r})")
            fuzz_dump.load_into(self.reference.shell.user_ns, path)
        finally:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))

    def _ranks(self, replicated: list[str] | None, where: str) -> None:
        """Every rank dumps what it holds: the master must hold the notebook's values, and the
        ranks agree (on ``replicated`` only, where given)."""
        notebook = kernel_dump(self.kernel)
        names = sorted(notebook)
        report = _json_line(
            self.kernel, f"%%enot_distributed --no-return\n_fuzz_ranks(globals(), {names!r}, {replicated!r})"
        )
        if report["apart"]:
            raise Mismatch(f"{where}: the ranks differ: {report['apart']}")
        master = report["master"]
        if master.pop("<missing on the master>"):
            raise Mismatch(f"{where}: the master lacks {sorted(set(names) - set(master))}")
        _compare(master, notebook, where + ", the master against the notebook", "the master", "the notebook")


def _bound(code: str) -> set[str]:
    """The names a cell binds at its top level (not in its comprehensions or definitions)."""
    names: set[str] = set()
    scopes = (ast.FunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    todo: list[ast.AST] = [ast.parse(code)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        if not isinstance(node, scopes):
            todo.extend(ast.iter_child_nodes(node))
    return {n for n in names if not n.startswith("_")}


def _silent(kernel: Any, code: str, timeout: float = 60) -> None:
    """Run ``code`` as a frontend's ``silent=True`` request (no history, no run_cell events)."""
    msg_id = kernel.client.execute(code, silent=True, store_history=False)
    deadline = time.monotonic() + timeout
    while True:
        reply = kernel.client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    if reply["content"]["status"] != "ok":
        raise Mismatch(f"the silent run of {code!r} failed: {reply['content'].get('evalue')}")


def _compare(
    left: dict[str, Any], right: dict[str, Any], where: str, lname: str = "the notebook", rname: str = "the plain run"
) -> None:
    found = fuzz_dump.diff(left, right)
    if found:
        raise Mismatch(f"{where}: {lname} (left) and {rname} (right) differ at {found}")
