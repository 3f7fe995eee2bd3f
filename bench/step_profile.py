"""Split a step's CPU time into the runtime's named parts, from py-spy's raw stacks.

``bench/throughput.py --profile DIR`` samples each runtime's process tree over the measured
window (:mod:`bench.pyspy_window`). Each sampled stack is put in one part by its innermost frame
that a rule names (:data:`RULES`, first match from the leaf), so that the comm hook's time inside
a backward pass counts as the hook's, not as compute. A stack no rule names is the job's own
work: "compute", what torch runs natively below the loop's own frames. A thread other
than its process's main one is counted apart ("beside the loop"), since on saturated cores it
takes its CPU from the compute. Agents and the launcher are one part; etcd, not Python, is not
sampled (its CPU is throughput.py's row).

A part's figure is CPU milliseconds per training step, summed over the runtime's processes:
samples / py-spy's rate / steps. py-spy samples without pausing the processes, at 100 Hz per
thread, and counts only threads that run, so a part below about 1 ms a step is noise. It takes
some waits for running, though: a stack whose innermost frame blocks (:data:`WAITS`: a
condition's or a future's wait, a socket read, a selector) is left out of every part.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# (what a frame's file path contains, the part), tried from the innermost frame outwards.
RULES: tuple[tuple[str, str], ...] = (
    ("elastic/ddp_hook.py", "comm hook"),
    ("elastic/communicator.py", "comm hook"),
    ("elastic/sampler.py", "sampler"),
    ("elastic/event", "events"),
    ("elastic/step_timing.py", "step timing"),
    ("elastic/stragglers.py", "step checks"),
    ("elastic/replicas.py", "step checks"),
    ("elastic/nonfinite.py", "step checks"),
    ("elastic/step_checks.py", "step checks"),
    ("elastic/async_checkpoint.py", "checkpoints"),
    ("elastic/checkpoint", "checkpoints"),
    ("elastic/shard_io.py", "checkpoints"),
    ("elastic/saving.py", "checkpoints"),
    ("elastic/manifest.py", "checkpoints"),
    ("torch/distributed/checkpoint/", "checkpoints"),
    ("elastic/agent_link.py", "agent link"),
    ("elastic/control.py", "agent link"),
    ("elastic/curves.py", "curves"),
    ("elastic/pipeline.py", "data loading"),
    ("elastic/data.py", "data loading"),
    ("torch/utils/data/", "data loading"),
    ("torchvision/datasets/", "data loading"),
    ("torchvision/transforms/", "data loading"),
    ("torchvision/io/", "data loading"),
    ("PIL/", "data loading"),
    ("torch/optim/", "optimizer"),
    ("torch/nn/parallel/distributed.py", "DDP's own Python"),
    ("torch/nn/modules/", "forward"),
    ("torchvision/models/", "forward"),
    ("torch/nn/functional.py", "forward"),
    ("torch/autograd/", "backward"),
    ("torch/_tensor.py", "backward"),
)
# Functions whose own line blocks: a stack ending in one is a wait that py-spy took for work.
WAITS = frozenset(
    {
        "Condition.wait",
        "Event.wait",
        "Future.wait",
        "Thread.join",
        "SocketIO.readinto",
        "EpollSelector.select",
        "PollSelector.select",
        "_wait_once",
    }
)
COMPUTE = "compute"
AGENTS = "launcher and agents"
BESIDE = " (beside the loop)"
_PROCESS = re.compile(r'process (\d+):"([^"]*)";')  # a command line may hold "; "
_THREAD = re.compile(r"^thread \((\w+)\)(?::\s*(.*))?$")
_FRAME = re.compile(r"^(.*) \(([^()]*):\d+\)$")  # "function (file:line)"


@dataclass(frozen=True)
class Stack:
    """One line of py-spy's raw output: where a thread was, and how many samples saw it there."""

    commands: tuple[str, ...]  # the process chain's command lines, the root's first
    main_thread: bool  # the sampled thread is its process's first
    files: tuple[str, ...]  # each frame's file, the outermost first
    count: int
    waiting: bool = False  # its innermost frame is one of WAITS


def parse(raw: str) -> list[Stack]:
    """The stacks of py-spy's ``--format raw --threads --subprocesses`` output."""
    stacks = []
    for line in raw.splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        commands, pid, main, files, leaf = [], "", False, [], ""
        at = 0
        while m := _PROCESS.match(body, at):
            pid, at = m.group(1), m.end()
            commands.append(m.group(2))
        for frame in body[at:].split(";"):
            if m := _THREAD.match(frame):
                main = m.group(1) == pid or m.group(2) == "MainThread"
            elif m := _FRAME.match(frame):
                leaf = m.group(1)
                files.append(m.group(2))
        waiting = leaf in WAITS
        stacks.append(Stack(tuple(commands), main, tuple(files), int(count), waiting))
    return stacks


def part_of(stack: Stack) -> str | None:
    """The part a stack's samples count for; None for a wait and the bench's own process."""
    if stack.waiting:
        return None
    commands = stack.commands
    if not any("elastic.trainer" in c for c in commands):  # not a worker nor its loader
        if commands and " -m launcher" in commands[0]:
            return AGENTS
        if len(commands) <= 1:
            return None  # the bench itself, the plain loop's parent
    part = next(
        (name for file in reversed(stack.files) for rule, name in RULES if rule in file), COMPUTE
    )
    return part if stack.main_thread or part == "data loading" else part + BESIDE


def split(raw: str, rate_hz: float, steps: int) -> dict[str, float]:
    """CPU milliseconds per step by part, largest first."""
    counts: Counter[str] = Counter()
    for stack in parse(raw):
        if (part := part_of(stack)) is not None:
            counts[part] += stack.count
    return {part: n / rate_hz * 1000 / steps for part, n in counts.most_common()}


def compare(ours: dict[str, float], plain: dict[str, float]) -> str:
    """A table of both runtimes' parts, with ours' extra CPU per step in each."""
    parts = sorted(set(ours) | set(plain), key=lambda p: -(ours.get(p, 0) - plain.get(p, 0)))
    lines = [f"{'part (CPU ms per step)':40}{'ours':>9}{'plain':>9}{'ours - plain':>14}"]
    for part in parts:
        a, b = ours.get(part, 0.0), plain.get(part, 0.0)
        lines.append(f"{part:40}{a:9.1f}{b:9.1f}{a - b:+14.1f}")
    total_a, total_b = sum(ours.values()), sum(plain.values())
    lines.append(f"{'all sampled':40}{total_a:9.1f}{total_b:9.1f}{total_a - total_b:+14.1f}")
    return "\n".join(lines)


def mean_split(files: list[Path], rate_hz: float, steps: int) -> dict[str, float]:
    """The mean of several runs' splits (a part missing from a run counts 0 there)."""
    splits = [split(f.read_text(errors="replace"), rate_hz, steps) for f in files if f.exists()]
    parts = {p for s in splits for p in s}
    return {p: sum(s.get(p, 0.0) for s in splits) / max(1, len(splits)) for p in parts}
