"""Per-kernel tables of a step: the share of the step each op or fusion takes.

Two sources, one table (`kernel_table`: the top ops by time, the rest summed, shares of 1):
- a profiler trace of a run (`trace_ops`): each XLA op's measured time, from the device planes
  of a GPU or TPU trace (events with an `hlo_op` stat, or on an "XLA Ops" line: untested
  here, where no accelerator was at hand), or from XLA:CPU's per-op events on the host plane
  (tested on real traces);
- a compiled program's optimized HLO (`hlo_ops`), ahead of time for any target: each op's
  matmul FLOPs and HBM bytes (operands read + results written; a sliced operand counts its
  slice, an in-place update its update), and its time at the chip's peaks (the larger of
  FLOPs / peak FLOP/s and bytes / HBM bandwidth: a roofline per op, ops run one after another).
  A conditional's branches count as equally likely (each 1/n of its runs). Ops in a loop body
  count once per trip (the layer scan, the micro-batch loop, the decode
  loop), which XLA's own cost analysis does not: it counts a loop body once.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import math
import os
import re
from typing import Any, Iterable

# Ops that move no data of their own (views, tuples, parameters) or close an async pair whose
# start is counted.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota"}
# Ops shown in a fusion's kind: what the fusion mainly does.
_NOTABLE = ("dot", "convolution", "custom-call", "reduce", "exponential", "gather", "scatter",
            "dynamic-slice", "dynamic-update-slice", "transpose", "sort", "all-reduce",
            "all-gather", "reduce-scatter")
_SLICING = {"dynamic-slice", "slice", "gather"}
# Ops that update their first operand in place, and the index of the operand they write.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}


@dataclasses.dataclass
class OpCost:
  """One op of a step: how often it runs per step, its FLOPs, bytes and seconds in all."""

  name: str
  kind: str = ""
  source: str = ""  # the JAX op it came from (HLO metadata op_name)
  count: float = 1.0
  flops: float = 0.0
  bytes: float = 0.0
  seconds: float = 0.0
  cycles: float = 0.0  # XLA:TPU's own estimate (estimated_cycles of a fusion), where given


@dataclasses.dataclass
class Instruction:
  """One HLO instruction, as parsed from the text."""

  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  args: str = ""  # the text between the opcode's parentheses (a constant's value)


# --- HLO text -----------------------------------------------------------------------------

def _matching(text: str, start: int) -> int:
  """Returns the index just past the bracket closing the one at `start`."""
  depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
  opening = text[start]
  for i in range(start, len(text)):
    if text[i] == opening:
      depth += 1
    elif text[i] == pairs[opening]:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _instruction(line: str) -> Instruction | None:
  """Parses `[ROOT ]%name = shape opcode(operands), attrs` (None for other lines)."""
  match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
  if not match:
    return None
  rest = line[match.end():]
  end = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  close = _matching(rest, paren)
  operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
  return Instruction(match.group(1), shape, rest[:paren], operands, rest[close:],
                     rest[paren + 1:close - 1])


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """Returns ({computation name: its instructions}, the entry computation's name)."""
  computations, entry, current = {}, "", None
  for line in text.splitlines():
    header = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header and " = " not in line.split("{")[0]:
      current = computations.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (inst := _instruction(line)):
      current.append(inst)
  return computations, entry


def array_shapes(shape: str) -> list[tuple[int, list[int]]]:
  """Returns (bits per element, dims) of each array in an HLO shape (a tuple's in order)."""
  out = []
  for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
    bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d*)", dtype).group(1) or 0)
    out.append((bits, [int(d) for d in dims.split(",") if d]))
  return out


def shape_bytes(shape: str) -> int:
  """Returns the bytes of every array in an HLO shape."""
  return sum(math.prod(dims) * bits // 8 for bits, dims in array_shapes(shape))


def _dims(shape: str) -> list[int]:
  """Returns the dims of the (first) array of a shape."""
  arrays = array_shapes(shape)
  return arrays[0][1] if arrays else []


def _attr(inst: Instruction, key: str) -> str:
  """Returns an attribute's value (`key=value` up to the next top-level comma), or ''."""
  match = re.search(rf"\b{key}=", inst.attrs)
  if not match:
    return ""
  start = match.end()
  if inst.attrs[start] in "{(\"":
    return inst.attrs[start:_matching(inst.attrs, start) if inst.attrs[start] != '"'
                      else inst.attrs.index('"', start + 1) + 1]
  return re.match(r"[^,\s]*", inst.attrs[start:]).group(0)


def _ints(text: str) -> list[int]:
  """Returns the integers in a text such as '{0,2}'."""
  return [int(x) for x in re.findall(r"\d+", text)]


# --- costs --------------------------------------------------------------------------------

def _op_flops(inst: Instruction, shapes: dict[str, str]) -> float:
  """Returns an instruction's matmul FLOPs: dots, convolutions, GEMM and attention calls."""
  out = math.prod(_dims(inst.shape))
  if inst.opcode == "dot":
    lhs = _dims(shapes.get(inst.operands[0], ""))
    return 2.0 * out * math.prod(lhs[d] for d in _ints(_attr(inst, "lhs_contracting_dims")))
  if inst.opcode == "convolution":
    return _conv_flops(inst, shapes)
  if inst.opcode == "custom-call":
    return _custom_call_flops(inst, shapes, out)
  return 0.0


def _conv_flops(inst: Instruction, shapes: dict[str, str]) -> float:
  """FLOPs of a convolution: 2 x output batch x output features x input features per group x
  the (output, kernel) position pairs of each spatial dim that read a real input element.
  XLA:TPU writes batched matmuls as convolutions whose spatial dims are padded, dilated and
  reversed, where most pairs read padding or dilation holes."""
  lhs_labels, rest = _attr(inst, "dim_labels").split("_")
  kernel_labels, out_labels = rest.split("->")
  lhs, kernel = (_dims(shapes.get(name, "")) for name in inst.operands[:2])
  out = _dims(inst.shape)
  window = _window(_attr(inst, "window"), sum(c.isdigit() for c in out_labels))
  flops = 2.0 * out[out_labels.index("b")] * out[out_labels.index("f")]
  flops *= kernel[kernel_labels.index("i")]
  for d, (stride, pad_low, lhs_dilate, rhs_dilate) in enumerate(window):
    flops *= _valid_pairs(out[out_labels.index(str(d))], kernel[kernel_labels.index(str(d))],
                          lhs[lhs_labels.index(str(d))], stride, pad_low, lhs_dilate, rhs_dilate)
  return flops


def _window(text: str, rank: int) -> list[tuple[int, int, int, int]]:
  """Returns (stride, low padding, lhs dilation, rhs dilation) of each spatial dim."""
  fields = dict(re.findall(r"(\w+)=([\d_x-]+)", text))
  get = lambda key, default: (fields[key].split("x") if key in fields else [default] * rank)
  pads = [int(p.split("_")[0]) for p in get("pad", "0_0")]
  return list(zip(map(int, get("stride", "1")), pads, map(int, get("lhs_dilate", "1")),
                  map(int, get("rhs_dilate", "1"))))


def _valid_pairs(out: int, kernel: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                 rhs_dilate: int) -> int:
  """Returns how many (output, kernel) position pairs of one spatial dim read an input element
  (not padding, not a hole of the input's dilation)."""
  extent = (size - 1) * lhs_dilate + 1
  count = 0
  for k in range(kernel):  # the outputs o with 0 <= o * stride + offset < extent, on the grid
    offset = k * rhs_dilate - pad_low
    low, high = max(0, -(offset // stride)), min(out - 1, (extent - 1 - offset) // stride)
    period = lhs_dilate // math.gcd(stride, lhs_dilate)
    first = [o for o in range(low, low + period) if (o * stride + offset) % lhs_dilate == 0]
    if first and high >= first[0]:
      count += (high - first[0]) // period + 1
  return count


def _custom_call_flops(inst: Instruction, shapes: dict[str, str], out: int) -> float:
  """FLOPs of cuBLAS GEMMs (from their dot dimensions) and cuDNN attention (4 x q elements x
  key length forward; 2.5 x that backward; half of it under a causal mask)."""
  target = _attr(inst, "custom_call_target")
  if "gemm" in target or "matmul" in target:
    lhs = _dims(shapes.get(inst.operands[0], ""))
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
    return 2.0 * out * math.prod(lhs[d] for d in _ints(match.group(1))) if match else 0.0
  if "fmha" in target and len(inst.operands) >= 2:
    q, k = (_dims(shapes.get(name, "")) for name in inst.operands[:2])
    if len(q) != 4 or len(k) != 4:
      return 0.0
    flops = 4.0 * math.prod(q) * max(k[1], k[2])
    flops *= 2.5 if "Backward" in target else 1.0
    return flops * (0.5 if "CAUSAL" in inst.attrs else 1.0)
  return 0.0


def _fused_flops(comp: str, computations: dict[str, list[Instruction]]) -> float:
  """Returns the matmul FLOPs of a fused computation (nested fusions included)."""
  insts = computations.get(comp, [])
  shapes = {i.name: i.shape for i in insts}
  return sum(_fused_flops(_attr(i, "calls"), computations) if i.opcode == "fusion"
             else _op_flops(i, shapes) for i in insts)


def _fused_ops(comp: str, computations: dict[str, list[Instruction]]) -> set[str]:
  """Returns the opcodes inside a fused computation (nested fusions included)."""
  ops = set()
  for i in computations.get(comp, []):
    ops |= _fused_ops(_attr(i, "calls"), computations) if i.opcode == "fusion" else {i.opcode}
  return ops


def _fusion_bytes(inst: Instruction, comp: str,
                  computations: dict[str, list[Instruction]]) -> float:
  """Bytes a fusion moves: each operand once, or only the slices it reads of it, and its
  results; an operand updated in place (dynamic-update-slice, scatter) moves its update,
  twice."""
  insts = computations.get(comp, [])
  users = collections.defaultdict(list)
  for i in insts:
    for operand in i.operands:
      users[operand].append(i)
  inner = {i.name: i.shape for i in insts}
  read, updated, buffers = 0.0, 0.0, 0.0
  for param in (i for i in insts if i.opcode == "parameter"):
    uses = users[param.name]
    if uses and all(u.opcode in _SLICING and u.operands[0] == param.name for u in uses):
      read += sum(shape_bytes(u.shape) for u in uses)
    elif uses and all(u.opcode in _IN_PLACE and u.operands[0] == param.name for u in uses):
      updated += sum(2 * shape_bytes(inner.get(u.operands[_IN_PLACE[u.opcode]], ""))
                     for u in uses)
      buffers += shape_bytes(param.shape)
    else:
      read += shape_bytes(param.shape)
  return read + updated + max(shape_bytes(inst.shape) - buffers, 0.0)


def _op_bytes(inst: Instruction, shapes: dict[str, str]) -> float:
  """Bytes an unfused op moves: operands and result; a slice reads and writes its result, an
  in-place update its update; an async start its operands and its largest result."""
  out = shape_bytes(inst.shape)
  if inst.opcode in _SLICING:
    return 2.0 * out
  if inst.opcode in _IN_PLACE:
    return 2.0 * shape_bytes(shapes.get(inst.operands[_IN_PLACE[inst.opcode]], ""))
  operands = sum(shape_bytes(shapes.get(name, "")) for name in inst.operands)
  if inst.opcode.endswith("-start"):
    arrays = array_shapes(inst.shape)
    out = max((math.prod(d) * b // 8 for b, d in arrays), default=0)
  return operands + out


def _trip_count(inst: Instruction, computations: dict[str, list[Instruction]]) -> int | None:
  """Returns a while loop's trip count: XLA's known_trip_count, else the one integer constant
  its condition compares the counter against (None when neither is found)."""
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
  if match:
    return int(match.group(1))
  condition = computations.get(_attr(inst, "condition").lstrip("%"), [])
  constants = [i for i in condition if i.opcode == "constant" and re.match(r"s(32|64)\[\]",
                                                                           i.shape)]
  values = {int(i.args) for i in constants if re.fullmatch(r"-?\d+", i.args)}
  return values.pop() if len(values) == 1 else None


def _walk(comp: str, times: float, computations: dict[str, list[Instruction]],
          out: list[OpCost], notes: set[str], unknown_trips: int) -> None:
  """Appends the cost of each op of `comp`, run `times` times, entering loops and calls; a
  loop whose trip count the HLO does not give runs `unknown_trips` times."""
  insts = computations.get(comp, [])
  shapes = {i.name: i.shape for i in insts}
  for inst in insts:
    op = inst.opcode
    if op == "while":
      trips = _trip_count(inst, computations)
      if trips is None:
        trips = unknown_trips
        notes.add(f"{inst.name}: no constant trip count in the HLO, its "
                  f"body counted {trips} time(s)")
      _walk(_attr(inst, "body").lstrip("%"), times * trips, computations, out, notes,
            unknown_trips)
    elif op in ("call", "conditional", "async-start"):
      called = re.findall(r"[\w.\-]+", _attr(inst, "to_apply") or _attr(inst, "calls") or
                          _attr(inst, "branch_computations"))
      # One branch of a conditional runs each time: branches count as equally likely (exact
      # for a scan that switches to layer i's weights at trip i).
      share = 1 / len(called) if op == "conditional" and called else 1
      for name in called:
        _walk(name, times * share, computations, out, notes, unknown_trips)
    elif op not in _FREE and not op.endswith("-done") and not op.endswith("-update"):
      out.append(_leaf(inst, times, computations, shapes))


def _leaf(inst: Instruction, times: float, computations: dict[str, list[Instruction]],
          shapes: dict[str, str]) -> OpCost:
  """Returns the cost of one op that runs `times` times."""
  source = re.search(r'op_name="([^"]*)"', inst.attrs)
  cycles = re.search(r'"estimated_cycles":"(\d+)"', inst.attrs)
  if inst.opcode == "fusion":
    comp = _attr(inst, "calls").lstrip("%")
    inner = _fused_ops(comp, computations)
    kind = "fusion(" + ",".join(op for op in _NOTABLE if op in inner) + ")"
    flops, nbytes = _fused_flops(comp, computations), _fusion_bytes(inst, comp, computations)
  else:
    kind = inst.opcode
    if inst.opcode == "custom-call":
      kind += " " + _attr(inst, "custom_call_target").strip('"')
    flops, nbytes = _op_flops(inst, shapes), _op_bytes(inst, shapes)
  return OpCost(inst.name, kind, source.group(1) if source else "", times, flops * times,
                nbytes * times, cycles=float(cycles.group(1)) * times if cycles else 0.0)


def hlo_ops(text: str, peak_flops: float, hbm_bytes_per_s: float,
            unknown_trips: int = 1) -> tuple[list[OpCost], list[str]]:
  """Returns (the ops of a compiled program's HLO text with their FLOPs, bytes and roofline
  seconds over a whole step, loop bodies counted once per trip, `unknown_trips` times where
  the HLO gives no count; notes on such loops)."""
  computations, entry = parse_hlo(text)
  ops, notes = [], set()
  _walk(entry, 1.0, computations, ops, notes, unknown_trips)
  for op in ops:
    op.seconds = max(op.flops / peak_flops, op.bytes / hbm_bytes_per_s)
  return ops, sorted(notes)


def group_ops(ops: Iterable[OpCost]) -> list[OpCost]:
  """Returns the ops merged by (kind, JAX source op): the same op of each unrolled layer (or
  layer with weights of its own, `layers_3/...` as `layers_*/...`), or of each traced step,
  becomes one row named after its first instance (+ how many more) and the group's source."""
  groups: dict[tuple[str, str], list[OpCost]] = collections.defaultdict(list)
  for op in ops:
    groups[(op.kind, re.sub(r"/layers_\d+/", "/layers_*/", op.source) or op.name)].append(op)
  merged = []
  for (kind, source), members in groups.items():
    extra = len({m.name for m in members}) - 1
    merged.append(OpCost(
        members[0].name + (f" (+{extra})" if extra else ""), kind,
        source if members[0].source else "",
        *(sum(getattr(m, f) for m in members) for f in ("count", "flops", "bytes", "seconds",
                                                          "cycles"))))
  return merged


def kernel_table(ops: Iterable[OpCost], top: int = 20) -> list[dict[str, Any]]:
  """Returns the `top` ops by seconds, then one row summing the rest, each with its share of
  the total seconds (the shares sum to 1)."""
  ops = sorted(ops, key=lambda o: o.seconds, reverse=True)
  total = sum(o.seconds for o in ops) or 1.0
  rows = [dict(dataclasses.asdict(o), share=o.seconds / total) for o in ops[:top]]
  rest = ops[top:]
  if rest:
    summed = OpCost(f"rest ({len(rest)} ops)", "", "", *(
        sum(getattr(o, f) for o in rest) for f in ("count", "flops", "bytes", "seconds",
                                                   "cycles")))
    rows.append(dict(dataclasses.asdict(summed), share=summed.seconds / total))
  return rows


def _short(source: str, width: int = 70) -> str:
  """The tail of a JAX op path, without the outer jit(...) and at most `width` characters."""
  source = re.sub(r"^jit\([^)]*\)/", "", source).replace("|", "/")
  return source if len(source) <= width else "..." + source[-width + 3:]


def markdown(rows: list[dict[str, Any]], measured: bool) -> str:
  """Returns a kernel table as Markdown: measured times (a trace) or estimates (HLO)."""
  time_col = "time per step (measured)" if measured else "time per step (roofline)"
  cycles = any(r["cycles"] for r in rows)
  head = ["#", "op", "kind", "JAX op", "runs per step", "FLOPs", "bytes", time_col, "share"]
  head += ["XLA:TPU estimated cycles"] if cycles else []
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for i, r in enumerate(rows):
    rank = "" if r["name"].startswith("rest (") else str(i + 1)
    cells = [rank, f"`{r['name']}`", r["kind"], _short(r["source"]), f"{r['count']:g}",
             f"{r['flops']:.3g}", f"{r['bytes']:.3g}", _seconds(r["seconds"]),
             f"{r['share']:.1%}"]
    cells += [f"{r['cycles']:.3g}"] if cycles else []
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _seconds(s: float) -> str:
  """Formats seconds as ms or us."""
  return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


# --- traces -------------------------------------------------------------------------------

def xplane_path(log_dir: str) -> str:
  """Returns the newest profile (.xplane.pb) that jax.profiler.trace wrote under `log_dir`."""
  paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb")))
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {log_dir}/plugins/profile")
  return paths[-1]


def _event_op(event: Any, line_name: str) -> tuple[str, str] | None:
  """Returns (HLO op, module) of a trace event that is an XLA op's execution, else None."""
  stats = dict(event.stats)
  if "hlo_op" in stats:
    return str(stats["hlo_op"]), str(stats.get("hlo_module", ""))
  if line_name == "XLA Ops":  # TPU device planes name each op's event after it
    return event.name, ""
  return None


def _self_times(events: list[tuple[float, float, tuple[str, str]]]) -> list[tuple[
    tuple[str, str], float]]:
  """Returns (op, seconds) of one thread's op events, less the time of ops nested in them (a
  while loop's events enclose its body's)."""
  out, stack = [], []  # stack: [end, index into out]
  for start, end, op in sorted(events, key=lambda e: (e[0], -e[1])):
    while stack and stack[-1][0] <= start:
      stack.pop()
    if stack:
      out[stack[-1][1]][1] -= end - start
    out.append([op, end - start])
    stack.append((end, len(out) - 1))
  return [(op, seconds) for op, seconds in out]


def trace_ops(path: str, module: str = "") -> tuple[list[OpCost], str]:
  """Returns (each XLA op's measured seconds, summed over the trace, and its run count; the
  plane they came from) of a profile. Ops come from the first device plane holding any (a
  GPU's kernels, a TPU core's ops), else from the host (XLA:CPU runs ops on host threads); of
  the program `module` when given, else of the program that took the most time."""
  import jax

  data = jax.profiler.ProfileData.from_file(path)
  planes = sorted(data.planes, key=lambda p: (not p.name.startswith("/device:"), p.name))
  for plane in planes:
    per_line = []
    for line in plane.lines:
      events = [(e.start_ns * 1e-9, e.end_ns * 1e-9, op) for e in line.events
                if (op := _event_op(e, line.name)) is not None]
      per_line += _self_times(events)
    if per_line:
      return _by_op(per_line, module), plane.name
  raise ValueError(f"no XLA op events in {path}")


def _by_op(timed: list[tuple[tuple[str, str], float]], module: str) -> list[OpCost]:
  """Sums (op, module) timings into OpCosts of one module."""
  modules = collections.Counter()
  for (_, mod), seconds in timed:
    modules[mod] += seconds
  chosen = module if module in modules else modules.most_common(1)[0][0]
  ops: dict[str, OpCost] = {}
  for (name, mod), seconds in timed:
    if mod == chosen:
      op = ops.setdefault(name, OpCost(name, count=0))
      op.count += 1
      op.seconds += seconds
  return list(ops.values())


def join_hlo(measured: list[OpCost], text: str, steps: int) -> list[OpCost]:
  """Returns measured ops per step, with the kind, JAX op, FLOPs and bytes of the same-named
  ops of the program's HLO text (ops of a loop body: per trip, times its runs)."""
  computations, _ = parse_hlo(text)
  found = {}
  for comp, insts in computations.items():
    shapes = {i.name: i.shape for i in insts}
    for inst in insts:
      found.setdefault(inst.name, (inst, shapes))
  out = []
  for op in measured:
    row = OpCost(op.name, count=op.count / steps, seconds=op.seconds / steps)
    if op.name in found:
      inst, shapes = found[op.name]
      cost = _leaf(inst, row.count, computations, shapes)
      row.kind, row.source, row.flops, row.bytes = cost.kind, cost.source, cost.flops, cost.bytes
    out.append(row)
  return out


def write_tables(stem: str, title: str, header: list[str], rows: list[dict[str, Any]],
                 measured: bool, extra: dict[str, Any]) -> None:
  """Writes `stem`.md (title, header lines, the table) and `stem`.json (rows and extra)."""
  os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
  with open(stem + ".md", "w") as f:
    f.write(f"# {title}\n\n" + "".join(f"- {h}\n" for h in header) + "\n" +
            markdown(rows, measured) + "\n")
  with open(stem + ".json", "w") as f:
    json.dump(dict(title=title, header=header, rows=rows, **extra), f, indent=2)
